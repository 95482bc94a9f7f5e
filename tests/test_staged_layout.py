"""Multi-stage image models (StagedLayout): the downsample windows, the blocks' maps at each stage's resolution, and
the methods' rollout across stages, checked against the matrices written out by hand.

The model is a toy two-stage classifier built from Vim mixers (a supported mixer over (B, L, C) tokens): an 8 × 8
grid, a 2 × 2 stride-2 patch merging, a 4 × 4 grid, the mean of the last stage's tokens into the head. Its second
stage keeps its residual stream channel-first (B, C, H, W), as VMamba and EfficientViM do.
"""
import pytest
import torch
from torch import nn

import mamba_captum as mc
from mamba_captum.attr._rollout import rollout_step
from mamba_captum.layout import Stage, StagedLayout
from mamba_captum.vision import VimMixer


class TokenBlock(nn.Module):
    """r + mixer(norm(r)) over a (B, L, C) stream."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = VimMixer(dim, d_state=4, d_conv=3, expand=1)

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class GridBlock(TokenBlock):
    """The same over a channel-first (B, C, H, W) stream."""

    def forward(self, x):
        batch, channels, height, width = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        out = tokens + self.mixer(self.norm(tokens))
        return out.transpose(1, 2).reshape(batch, channels, height, width)


class ToyStaged(nn.Module):
    def __init__(self, dims=(8, 12), classes=3):
        super().__init__()
        self.stem = nn.Conv2d(3, dims[0], 4, 4)
        self.stage0 = nn.ModuleList([TokenBlock(dims[0]) for _ in range(2)])
        self.merge = nn.Conv2d(dims[0], dims[1], 2, 2)
        self.stage1 = nn.ModuleList([GridBlock(dims[1]) for _ in range(2)])
        self.head = nn.Linear(dims[1], classes)

    def token_layout(self):
        return StagedLayout((32, 32), (Stage((8, 8), 2), Stage((4, 4), 2, (2, 2, 0))))

    def stage_blocks(self):
        return nn.ModuleList([*self.stage0, *self.stage1])

    def forward(self, pixels):
        x = self.stem(pixels)  # (B, C0, 8, 8)
        batch = x.shape[0]
        x = x.flatten(2).transpose(1, 2)
        for block in self.stage0:
            x = block(x)
        x = self.merge(x.transpose(1, 2).reshape(batch, -1, 8, 8))  # (B, C1, 4, 4)
        for block in self.stage1:
            x = block(x)
        return self.head(x.mean((2, 3)))


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return ToyStaged().double().eval()


@pytest.fixture(scope="module")
def pixels():
    torch.manual_seed(1)
    return torch.randn(2, 3, 32, 32, dtype=torch.float64)


def test_transition_is_the_window_by_hand():
    layout = StagedLayout((16, 16), (Stage((4, 4), 1), Stage((2, 2), 1, (2, 2, 0))))
    expected = torch.zeros(4, 16, dtype=torch.float64)
    for coarse_row in range(2):
        for coarse_col in range(2):
            for r in range(2):
                for c in range(2):
                    expected[coarse_row * 2 + coarse_col, (2 * coarse_row + r) * 4 + 2 * coarse_col + c] = 0.25
    assert torch.equal(layout.transition(1), expected)
    # a 3 × 3 stride-2 conv with padding 1: the corner token reads the 2 × 2 fine tokens inside the image
    padded = StagedLayout((16, 16), (Stage((4, 4), 1), Stage((2, 2), 1, (3, 2, 1))))
    corner = padded.transition(1)[0].reshape(4, 4)
    assert torch.equal(corner, torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0] * 4, [0] * 4]).double() / 4)
    rows = torch.rand(3, 4, dtype=torch.float64)
    assert torch.allclose(layout.carry(rows).sum(-1), rows.sum(-1))  # spreading keeps the total


def test_layout_refuses_a_grid_its_downsample_does_not_make():
    with pytest.raises(ValueError, match="makes a"):
        StagedLayout((16, 16), (Stage((4, 4), 1), Stage((3, 3), 1, (2, 2, 0))))
    with pytest.raises(ValueError, match="first stage"):
        StagedLayout((16, 16), (Stage((4, 4), 1, (2, 2, 0)),))


def test_as_tokens_takes_either_channel_order():
    layout = StagedLayout((16, 16), (Stage((4, 2), 1),))
    first = torch.arange(2 * 5 * 4 * 2.0).reshape(2, 5, 4, 2)  # (B, C, H, W)
    tokens = layout.as_tokens(first, 0)
    assert tokens.shape == (2, 8, 5) and torch.equal(tokens[:, 3], first[:, :, 1, 1])
    last = first.permute(0, 2, 3, 1)  # (B, H, W, C)
    assert torch.equal(layout.as_tokens(last, 0), tokens)
    with pytest.raises(ValueError, match="not"):
        layout.as_tokens(torch.zeros(2, 5, 3, 3), 0)


def test_maps_at_each_stage_resolution(toy, pixels):
    maps = mc.implicit_attention(toy, pixels)
    assert list(maps) == [0, 1, 2, 3]
    assert [tuple(m.shape) for m in maps.values()] == [(2, 64, 64)] * 2 + [(2, 16, 16)] * 2


def test_rollout_crosses_the_merge_by_its_window(toy, pixels):
    maps = mc.implicit_attention(toy, pixels)
    layout = toy.token_layout()
    factors = [rollout_step(maps[i]) for i in range(4)]
    coarse = factors[3] @ factors[2]  # (B, 16, 16)
    fine = factors[1] @ factors[0]  # (B, 64, 64)
    product = coarse @ layout.transition(1) @ fine  # (B, 16, 64)
    expected = torch.full((2, 16), 1 / 16, dtype=torch.float64)[:, None, :] @ product
    relevance = mc.MambaRollout(toy).attribute(pixels)
    assert relevance.shape == (2, 1, 32, 32)
    assert torch.allclose(relevance, layout.to_pixels(expected[:, 0]), atol=1e-12)


def test_raw_attention_reads_each_layer_through_the_query_footprint(toy, pixels):
    maps = mc.implicit_attention(toy, pixels)
    layout = toy.token_layout()
    query = torch.full((2, 16), 1 / 16, dtype=torch.float64)
    footprint = query @ layout.transition(1)  # the pooled query on the first stage's tokens
    rows = [torch.einsum("bq,bqj->bj", footprint, maps[i]) for i in range(2)] + \
           [torch.einsum("bq,bqj->bj", query, maps[i]) @ layout.transition(1) for i in range(2, 4)]
    expected = sum(rows) / 4
    relevance = mc.MambaRawAttention(toy).attribute(pixels)
    assert torch.allclose(relevance, layout.to_pixels(expected), atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"gradient_rule": "residual"}])
def test_attribution_batched_equals_single(toy, pixels, options):
    method = mc.MambaAttribution(toy)
    both = method.attribute(pixels, target=1, **options)
    assert both.shape == (2, 1, 32, 32) and bool(torch.isfinite(both).all())
    for index in range(2):
        alone = method.attribute(pixels[index:index + 1], target=1, **options)
        assert torch.allclose(alone[0], both[index], atol=1e-10)


def test_the_official_recipes_are_refused(toy, pixels):
    with pytest.raises(ValueError, match="no CLS"):
        mc.MambaRollout(toy).attribute(pixels, recipe="official")


def test_no_hooks_left_and_the_model_unchanged(toy, pixels):
    before = {k: v.clone() for k, v in toy.state_dict().items()}
    mc.MambaAttribution(toy).attribute(pixels)
    modules = list(toy.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)
    assert all(torch.equal(before[k], v) for k, v in toy.state_dict().items())


def test_a_declared_stream_settles_a_width_equal_to_the_grid():
    ambiguous = torch.arange(2 * 4 * 4 * 4.0).reshape(2, 4, 4, 4)
    with pytest.raises(ValueError, match="two of them"):
        StagedLayout((16, 16), (Stage((4, 4), 1),)).as_tokens(ambiguous, 0)
    last = StagedLayout((16, 16), (Stage((4, 4), 1),), stream="channels_last").as_tokens(ambiguous, 0)
    first = StagedLayout((16, 16), (Stage((4, 4), 1),), stream="channels_first").as_tokens(ambiguous, 0)
    assert torch.equal(last[:, 5], ambiguous[:, 1, 1, :]) and torch.equal(first[:, 5], ambiguous[:, :, 1, 1])
