"""MambaVision's operators (mamba_captum.families.mambavision; operators.windowed, operators.channel_conv,
kernels.windows): y = H x for every mixer and conv block against this file's own forward hooks (float64, unified and
hidden), a hand-checked windowed scatter, block-diagonal maps across windows, the engine on the multi-stage model
(maps per block at each level's length, the three methods, batching, hooks), and the refusals."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import mamba_captum as mc
from mamba_captum.families import mambavision as adapter
from mamba_captum.families.registry import adapter_for
from mamba_captum.kernels.windows import grid_to_windows, window_order
from mamba_captum.operators import SoftmaxOperator, WindowedOperator
from mamba_captum.vision.modeling_mambavision import MambaVision

ALL = frozenset({"s6", "gate", "act", "conv", "norm"})
# level grids 16/8/4/2 at 64²: level 2 is four 2×2 windows, level 3 one; depths 1/1/3/2: blocks 0, 1 conv blocks,
# 2, 3 Mamba and 4 attention (level 2), 5 Mamba and 6 attention (level 3)
TINY = dict(dim=8, in_dim=4, depths=[1, 1, 3, 2], num_heads=[1, 2, 2, 4], window_size=[4, 4, 2, 2], mlp_ratio=2,
            num_classes=5, layer_scale=0.5, layer_scale_conv=0.7)
LENGTHS = [256, 64, 16, 16, 16, 4, 4]


def tiny_model(img_size=64, seed=0, dtype=torch.float64):
    """Every parameter and BatchNorm statistic random (no term hides behind an initial 0 or 1), eval mode."""
    torch.manual_seed(seed)
    model = MambaVision(**TINY, img_size=img_size).to(dtype)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                continue
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("A_log"):
                tensor.uniform_(-1.0, 1.0)
            else:
                tensor.normal_(0.0, 0.4 if tensor.dim() > 1 else 0.3)
    return model.eval()


def pixels_of(batch=2, size=64, seed=1, dtype=torch.float64):
    return torch.randn(batch, 3, size, size, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def mixer_of(model, block):
    module = model.stage_blocks()[block]
    return module.mixer if hasattr(module, "mixer") else module


def record(model, pixels, block, inside=()):
    """The module's input and output, and for each named submodule its (input, output), by this file's hooks."""
    module = mixer_of(model, block)
    seen = {}
    hooks = [module.register_forward_hook(lambda m, a, o: seen.update(input=a[0], output=o))]
    for name in inside:
        hooks.append(module.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: seen.__setitem__(name, (a[0], o))))
    with torch.no_grad():
        model(pixels)
    for hook in hooks:
        hook.remove()
    return module, seen


def rebuilt(module, hidden, formulation, components=ALL):
    call = SimpleNamespace(located=SimpleNamespace(module=module, name="mixer"), hidden_states=hidden,
                           attention_mask=None)
    with torch.no_grad():
        return adapter.rebuild(call, formulation, components, torch.float64)


def windows_in_grid_order(windows, rows, cols, window):
    """(B · nW, T, ...) -> (B, L, ...): window n = b·nW + wr·(cols/window) + wc, token t = i·window + j is grid token
    (wr·window + i)·cols + wc·window + j (this file's own loops)."""
    per_row = cols // window
    count = (rows // window) * per_row
    batch = windows.shape[0] // count
    out = windows.new_zeros(batch, rows * cols, *windows.shape[2:])
    for b in range(batch):
        for n in range(count):
            wr, wc = divmod(n, per_row)
            for t in range(window * window):
                i, j = divmod(t, window)
                out[b, (wr * window + i) * cols + wc * window + j] = windows[b * count + n, t]
    return out


def same_window(rows, cols, window):
    """(L, L) bool: tokens i and j in the same window."""
    r, c = torch.arange(rows * cols) // cols, torch.arange(rows * cols) % cols
    w = (r // window) * (cols // window) + c // window
    return w[:, None] == w[None, :]


def close(a, b, tol=1e-5):
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


# -- the registry, the window order, the scatter -----------------------------------------------------------------
def test_the_registry_sends_the_three_classes_here():
    for name in ("MambaVisionMixer", "MambaVisionAttention", "MambaVisionConvBlock"):
        assert adapter_for(name).module is adapter and adapter_for(name).NONCAUSAL


def test_the_window_order_by_hand():
    assert window_order(4, 4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    assert window_order(2, 6, 2).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    grid = torch.arange(2 * 4 * 6 * 3.0).reshape(2, 4, 6, 3)
    windows = grid_to_windows(grid, 2)  # the model's cut: the same order
    order = window_order(4, 6, 2)
    assert torch.equal(windows.reshape(2, 24, 3), grid.reshape(2, 24, 3)[:, order])
    with pytest.raises(ValueError, match="whole number"):
        window_order(4, 5, 2)


def test_the_windowed_scatter_by_hand():
    """Four 2×2 windows of a 4×4 grid, one head: entry (s, s') of window w lands at grid tokens (order[4w + s],
    order[4w + s']), zero across windows; rows and contributions alike."""
    probs = torch.arange(1.0, 65.0, dtype=torch.float64).reshape(4, 1, 4, 4)  # window w, entry 16w + 4s + s' + 1
    values = torch.arange(1.0, 17.0, dtype=torch.float64).reshape(4, 1, 4, 1)  # window w token s: 4w + s + 1
    inner = SoftmaxOperator(probs, None, values=values, output=(probs @ values).transpose(1, 2))
    operator = WindowedOperator(inner, window_order(4, 4, 2))
    full = operator.maps("mean")
    assert full.shape == (1, 16, 16)
    # grid token 5 = (1, 1) is window 0's token 3; grid token 6 = (1, 2) is window 1's token 2
    assert full[0, 5, 0].item() == 13.0 and full[0, 5, 4].item() == 15.0 and full[0, 5, 5].item() == 16.0
    assert full[0, 6, 2].item() == 16 + 9 and full[0, 6, 7].item() == 16 + 12 and full[0, 6, 6].item() == 16 + 11
    assert full[0, 5, 2].item() == 0.0 and full[0, 5, 6].item() == 0.0  # across windows
    expected = torch.zeros(16, 16, dtype=torch.float64)
    for w, cells in enumerate([[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]):
        for s, i in enumerate(cells):
            for t, j in enumerate(cells):
                expected[i, j] = probs[w, 0, s, t]
    assert torch.equal(full[0], expected)
    rows = torch.tensor([15, 0, 6])
    assert torch.equal(operator.maps("sum", rows)[0], expected[rows])
    operator.output = operator.from_windows(inner.output)
    grad = torch.ones_like(operator.output)
    value_grid = operator.from_windows(values[:, 0])[0, :, 0]  # (16,) grid order
    assert torch.equal(operator.contributions(grad, rows)[0], expected[rows] * value_grid[None, :])


# -- y = H x per mixer, against this file's hooks -----------------------------------------------------------------
@pytest.mark.parametrize("block", [2, 3, 5])
def test_the_mamba_mixer_is_its_operator(block):
    model = tiny_model()
    mixer, seen = record(model, pixels_of(), block, inside=("in_proj", "x_proj", "out_proj"))
    rows, cols = seen["input"].shape[1:3]
    window = mixer.window_size
    grid = lambda t: windows_in_grid_order(t, rows, cols, window)  # noqa: E731
    projected, u = grid(seen["in_proj"][1]), grid(seen["x_proj"][0])  # x̃ z̃ and u = silu(conv(x̃)), grid order
    mixed = grid(seen["out_proj"][0])  # out_proj's input [y ; z]
    half = mixed.shape[-1] // 2
    operator, output = rebuilt(mixer, seen["input"], "unified")
    assert (output - seen["output"]).abs().max().item() <= 1e-12
    assert (operator.readout(operator.output) - seen["output"]).abs().max().item() <= 1e-12
    per_channel = operator.maps(None)  # (B, 2C', L, L): the scan half, then the z half
    assert close(torch.einsum("bcij,bjc->bic", per_channel, projected), mixed)
    asked = torch.tensor([rows * cols - 1, 0, 1])
    assert close(operator.maps("mean"), per_channel.mean(1), 1e-12)
    assert close(operator.maps("abs_mean"), per_channel.abs().mean(1), 1e-12)
    assert close(operator.maps("sum", asked), per_channel.sum(1)[:, asked], 1e-12)
    grad = torch.randn(operator.output.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = torch.einsum("bic,bcij,bjc->bij", grad, per_channel, projected)
    assert close(operator.contributions(grad), expected, 1e-12)
    assert close(operator.contributions(grad, asked), expected[:, asked], 1e-12)
    hidden_operator, _ = rebuilt(mixer, seen["input"], "hidden")
    hidden_values = torch.cat([u, mixed[..., half:]], dim=-1)  # u and z = silu(ẑ)
    assert close(torch.einsum("bcij,bjc->bic", hidden_operator.maps(None), hidden_values), mixed)
    across = ~same_window(rows, cols, window)
    assert bool(across.any()) == (block != 5)  # level 3's 2 × 2 grid is one window
    for maps in (per_channel, hidden_operator.maps(None)):
        assert not bool(maps[..., across].any())
    assert bool((per_channel[..., ~across].abs() > 0).any())
    # the scan half is causal in each window's own row-major order: the last token of window 0 reads its first
    order = window_order(rows, cols, window)
    first, last = order[0].item(), order[window * window - 1].item()
    assert per_channel[:, :half, last, first].abs().max().item() > 0


@pytest.mark.parametrize("block", [4, 6])
def test_the_attention_is_its_softmax(block):
    model = tiny_model()
    attention, seen = record(model, pixels_of(), block, inside=("qkv", "proj"))
    rows, cols = seen["input"].shape[1:3]
    window = attention.window_size
    grid = lambda t: windows_in_grid_order(t, rows, cols, window)  # noqa: E731
    qkv = grid(seen["qkv"][1])  # (B, L, 3C)
    mixed = grid(seen["proj"][0])  # the heads' outputs before proj, (B, L, C)
    dim, heads = mixed.shape[-1], attention.num_heads
    values = (qkv[..., 2 * dim:] - attention.qkv.bias[2 * dim:]).reshape(*mixed.shape[:2], heads, -1)
    for formulation in ("unified", "hidden"):
        operator, output = rebuilt(attention, seen["input"], formulation)
        assert (output - seen["output"]).abs().max().item() <= 1e-12
        probs = operator.maps(None)  # (B, heads, L, L)
        Pv = torch.einsum("bhij,bjhd->bihd", probs, values).flatten(2)
        assert close(Pv + attention.qkv.bias[2 * dim:], mixed, 1e-12)  # the value bias: from no token
        assert not bool(probs[..., ~same_window(rows, cols, window)].any())
        assert close(probs.sum(-1), torch.ones_like(probs.sum(-1)), 1e-12)
        assert close(operator.maps("mean", [3, 0]), probs.mean(1)[:, [3, 0]], 1e-12)
        grad = torch.randn(operator.output.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        expected = torch.einsum("bihd,bhij,bjhd->bij", grad, probs, values)
        assert close(operator.contributions(grad), expected, 1e-12)


def conv_branch_jacobian(block, gate, rows, cols, hidden=False):
    """J[o, i, c, j] = ∂ branch_o[i] / ∂ x_c[j] at a fixed GELU gain (this file's own BatchNorm affine and convs);
    hidden: the first conv and BN1's scale alone."""
    def affine(norm):
        scale = norm.weight / torch.sqrt(norm.running_var + norm.eps)
        return scale, norm.bias - norm.running_mean * scale

    s1, _ = affine(block.norm1)
    s2, _ = affine(block.norm2)
    gamma = block.gamma if block.layer_scale else torch.ones_like(s2)

    def linear(x):  # (C, H, W) -> (C, H, W)
        out = s1[:, None, None] * F.conv2d(x[None], block.conv1.weight, padding=1)[0]
        if hidden:
            return out
        out = gate * out
        return (gamma * s2)[:, None, None] * F.conv2d(out[None], block.conv2.weight, padding=1)[0]

    channels = block.conv1.in_channels
    J = torch.autograd.functional.jacobian(linear, torch.zeros(channels, rows, cols, dtype=torch.float64))
    return J.reshape(channels, rows * cols, channels, rows * cols)


@pytest.mark.parametrize("block", [0, 1])
def test_the_conv_block_is_its_operator(block):
    model = tiny_model()
    conv_block, seen = record(model, pixels_of(1), block, inside=("norm1", "act1", "norm2"))
    x = seen["input"][0]
    channels, rows, cols = x.shape
    u = seen["norm1"][1][0]  # GELU's input
    gate = seen["act1"][1][0] / u
    J = conv_branch_jacobian(conv_block, gate, rows, cols)  # (C, L, C, L)
    x_tokens = x.reshape(channels, -1)
    Hx = torch.einsum("oicj,cj->oi", J, x_tokens)
    # the branch from the hooks, less what comes from no token: γ (BN2(conv2(GELU(u)))) − γ BN2(conv2(g ⊙ c1))
    s1 = conv_block.norm1.weight / torch.sqrt(conv_block.norm1.running_var + conv_block.norm1.eps)
    c1 = u - s1[:, None, None] * F.conv2d(x[None], conv_block.conv1.weight, padding=1)[0]
    s2 = conv_block.norm2.weight / torch.sqrt(conv_block.norm2.running_var + conv_block.norm2.eps)
    from_none = conv_block.gamma[:, None, None] * (
        s2[:, None, None] * F.conv2d((gate * c1)[None], conv_block.conv2.weight, padding=1)[0]
        + s2[:, None, None] * conv_block.conv2.bias[:, None, None]
        + (conv_block.norm2.bias - conv_block.norm2.running_mean * s2)[:, None, None])
    branch = seen["output"][0] - x
    assert close(Hx, (branch - from_none).reshape(channels, -1))

    operator, output = rebuilt(conv_block, seen["input"], "unified")
    assert (output - seen["output"]).abs().max().item() <= 1e-12
    assert close(operator.output[0].T, Hx, 1e-12)
    per_output = J.sum(2)  # (C_out, L, L): Σ over input channels
    assert close(operator.maps(None)[0], per_output, 1e-12)
    assert close(operator.maps("mean")[0], per_output.mean(0), 1e-12)
    assert close(operator.maps("abs_mean")[0], per_output.abs().mean(0), 1e-12)
    rows_asked = torch.tensor([rows * cols - 1, 0, cols + 3])
    assert close(operator.maps("sum", rows_asked)[0], per_output.sum(0)[rows_asked], 1e-12)
    grad = torch.randn(1, rows * cols, channels, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    expected = torch.einsum("io,oicj,cj->ij", grad[0], J, x_tokens)
    assert close(operator.contributions(grad)[0], expected, 1e-12)
    assert close(operator.contributions(grad, rows_asked)[0], expected[rows_asked], 1e-12)
    # a 5 × 5 reach: tokens three rows apart do not meet, two rows apart do
    assert per_output[:, 0, 3 * cols].abs().max().item() == 0.0 and per_output[:, 0, 2 * cols + 2].abs().max() > 0

    hidden_operator, _ = rebuilt(conv_block, seen["input"], "hidden")
    J1 = conv_branch_jacobian(conv_block, gate, rows, cols, hidden=True)
    assert close(hidden_operator.maps(None)[0], J1.sum(2), 1e-12)
    assert close(torch.einsum("oicj,cj->oi", J1, x_tokens), (u - c1).reshape(channels, -1), 1e-12)
    assert (hidden_operator.readout(hidden_operator.output) - seen["output"]).abs().max().item() <= 1e-12


# -- the engine on the multi-stage model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model(dtype=torch.float32)


@pytest.fixture(scope="module")
def pixels():
    return pixels_of(dtype=torch.float32)


def test_implicit_attention_gives_each_block_at_its_level(model, pixels):
    layout = model.token_layout()
    assert [layout.stages[layout.stage_of_block(b)].length for b in range(layout.num_blocks)] == LENGTHS
    for formulation in ("unified", "hidden"):
        maps = mc.implicit_attention(model, pixels, formulation=formulation)
        assert sorted(maps) == list(range(7))
        assert [tuple(maps[b].shape) for b in range(7)] == [(2, n, n) for n in LENGTHS]
        assert all(bool(torch.isfinite(m).all()) for m in maps.values())
        across = ~same_window(4, 4, 2)
        for b in (2, 3, 4):  # level 2: four windows
            assert maps[b][:, across].abs().max().item() == 0.0 and maps[b][:, ~across].abs().max().item() > 0
        # level 3, one window of 4: the scan reads back to the first token; the 'same' convs (unified only) one
        # token forward
        assert maps[5][:, 3, 0].abs().min().item() > 0
        assert (maps[5][:, 0, 1].abs().min().item() > 0) == (formulation == "unified")


def test_the_methods_give_pixel_maps_batched_as_single(model, pixels):
    for method in (mc.MambaRollout, mc.MambaRawAttention, mc.MambaAttribution):
        both = method(model).attribute(pixels, target=1) if method is mc.MambaAttribution \
            else method(model).attribute(pixels)
        assert both.shape == (2, 1, 64, 64) and bool(torch.isfinite(both).all())
        alone = method(model).attribute(pixels[1:], target=1) if method is mc.MambaAttribution \
            else method(model).attribute(pixels[1:])
        assert close(alone[0], both[1], 1e-4)
    modules = list(model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in modules)


# -- refusals ---------------------------------------------------------------------------------------------------------
def test_a_padded_grid_is_refused_by_name():
    model = tiny_model(img_size=48)  # level 2: 3 × 3 padded to 4 × 4 for 2 × 2 windows
    mixer, seen = record(model, pixels_of(1, 48), 2)
    with pytest.raises(ValueError, match="padded from the level's 3×3"):
        rebuilt(mixer, seen["input"], "unified")
    with pytest.raises(ValueError, match="padded"):
        mc.implicit_attention(model, pixels_of(1, 48))


def test_train_mode_is_refused():
    model = tiny_model()
    for block in (0, 2, 4):
        module, seen = record(model, pixels_of(1), block)
        module.train()
        with pytest.raises(ValueError, match="train"):
            rebuilt(module, seen["input"], "unified")
