"""LFM3-VL's vision tower (Lfm3VlVisionModel): its short convs are 2-D bands over the packed patches and its attention
layers block-diagonal softmax layers. The maps reproduce each layer's real output (the test's own hooks), the band is
the model's Conv2d column by column, nothing crosses frames or items, packed items equal items run alone, the
three methods run, and nothing is left on the model."""
import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from test_engine import assert_untouched, model_state
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.lfm3_vl.configuration_lfm3_vl import Lfm3VlVisionConfig
from transformers.models.lfm3_vl.modeling_lfm3_vl import Lfm3VlVisionModel
from transformers.vision_utils import get_vision_position_ids

import mamba_captum as mc
from mamba_captum.operators import banded_maps
from mamba_captum.vision import PackedPatches

GRID = [[1, 4, 4], [1, 2, 6]]  # two images of different grids: 16 + 12 = 28 patches
VIDEO = [[2, 2, 4], [1, 4, 2]]  # a two-frame video and an image: frames are segments too
MERGE, PATCH = 2, 12  # spatial_merge_size; values per patch (3 channels × 2 × 2 pixels)
CONV_LAYERS, ATTENTION_LAYERS = (0, 2), (1, 3)


def make_tower(dtype=torch.float32, attn="sdpa", seed=0):
    config = Lfm3VlVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, patch_size=2, temporal_patch_size=1, spatial_merge_size=MERGE,
                                conv_kernel_size=3, initializer_range=0.3,
                                layer_types=["conv", "full_attention", "conv", "full_attention"])
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return Lfm3VlVisionModel(config).to(dtype).eval()


def patches(grid=GRID, dtype=torch.float32, seed=0):
    count = sum(t * h * w for t, h, w in grid)
    pixels = torch.randn(count, PATCH, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return pixels, torch.tensor(grid)


def record(tower, pixels, grid, taps):
    """Run the tower once with the test's own hooks: per layer, {name: tensor} from ``taps`` (layer -> list of
    (submodule, name, pre, reader))."""
    records, handles = {}, []
    for index, entries in taps.items():
        for module, name, pre, read in entries:
            if pre:
                hook = lambda mod, args, index=index, name=name, read=read: records.setdefault(index, {}).update(
                    {name: read(args[0].detach())})
                handles.append(module.register_forward_pre_hook(hook))
            else:
                hook = lambda mod, args, out, index=index, name=name, read=read: records.setdefault(index, {}).update(
                    {name: read(out[0] if isinstance(out, tuple) else out)})
                handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        tower(pixels, grid_thw=grid)
    for handle in handles:
        handle.remove()
    return records


def packed_conv_output(conv_out, layout, item_slices):
    """The spatial conv's raster output (T, D, H, W) of each item, in order -> packed (N, D) in merge-block order."""
    out = torch.zeros(layout.length, conv_out[0].shape[1], dtype=conv_out[0].dtype)
    for item, frames in enumerate(conv_out):
        out[layout.raster_tokens(item).flatten()] = frames.permute(0, 2, 3, 1).reshape(-1, frames.shape[1])
    return out


def test_token_order_is_the_models():
    layout = PackedPatches.from_grid(torch.tensor(GRID), MERGE)
    positions = get_vision_position_ids(torch.tensor(GRID), MERGE)  # (N, 2): row, column of each packed patch
    assert layout.length == positions.shape[0] == 28
    for item, part in enumerate(layout.item_slices()):
        raster = layout.raster_tokens(item)[0]  # (H, W) -> packed index
        rows, cols = torch.meshgrid(torch.arange(raster.shape[0]), torch.arange(raster.shape[1]), indexing="ij")
        assert torch.equal(positions[raster.flatten(), 0], rows.flatten())
        assert torch.equal(positions[raster.flatten(), 1], cols.flatten())
        assert int(raster.min()) == part.start and int(raster.max()) == part.stop - 1


def test_band_by_hand_and_against_conv2d_on_impulses():
    layout = PackedPatches.from_grid([[1, 2, 4]], MERGE)  # packed order: (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) ...
    taps = torch.arange(1.0, 10.0)[None].double()  # one channel, w[a, b] = 3a + b + 1
    ones = torch.ones(1, 8, 1, dtype=torch.float64)
    band = banded_maps(ones, ones, taps, reduce=None, neighbours=layout.neighbours(3))[0, 0]  # (8, 8)
    # patch (0, 1) reads (0,0) w[1,0]=4, itself w[1,1]=5, (1,0) w[2,0]=7, (1,1) w[2,1]=8, (0,2) w[1,2]=6, (1,2) w[2,2]=9
    assert band[1].tolist() == [4, 5, 7, 8, 6, 0, 9, 0]
    # patch (1, 3), the last: (0,2) w[0,0]=1, (0,3) w[0,1]=2, (1,2) w[1,0]=4, itself w[1,1]=5
    assert band[7].tolist() == [0, 0, 0, 0, 1, 2, 4, 5]

    # every column of the model's hidden map (the band alone) is the model's Conv2d applied to that patch's impulse
    tower = make_tower(torch.float64)
    pixels, grid = patches(GRID, torch.float64)
    maps = mc.implicit_attention(tower, pixels, grid_thw=grid, formulation="hidden", reduce=None,
                                 layers=[CONV_LAYERS[0]])[CONV_LAYERS[0]][0]  # (D, N, N)
    conv = tower.layers[CONV_LAYERS[0]].conv.spatial_conv
    layout = PackedPatches.from_grid(grid, MERGE)
    expected = torch.zeros_like(maps)
    for item, part in enumerate(layout.item_slices()):
        raster = layout.raster_tokens(item)[0]
        for j in range(part.start, part.stop):
            impulse = torch.zeros(1, maps.shape[0], *raster.shape, dtype=torch.float64)
            impulse[..., raster == j] = 1.0
            response = F.conv2d(impulse, conv.weight, padding=conv.padding, groups=conv.groups)[0]  # (D, H, W)
            expected[:, raster.flatten(), j] = response.flatten(1)
    assert torch.equal(maps != 0, expected != 0)
    assert relative_error(maps, expected) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv_layers_reproduce_their_output(dtype):
    tower = make_tower(dtype)
    pixels, grid = patches(GRID, dtype)
    layout = PackedPatches.from_grid(grid, MERGE)
    conv_out = {index: [] for index in CONV_LAYERS}
    handles = [tower.layers[i].conv.spatial_conv.register_forward_hook(
        lambda mod, args, out, i=i: conv_out[i].append(out.detach())) for i in CONV_LAYERS]
    records = record(tower, pixels, grid, {i: [
        (tower.layers[i].conv.in_proj, "projected", False, lambda t: t.detach()),
        (tower.layers[i].conv.out_proj, "out_in", True, lambda t: t)] for i in CONV_LAYERS})
    for handle in handles:
        handle.remove()
    unified = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None)
    hidden = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None, formulation="hidden")
    bound = 1e-10 if dtype == torch.float64 else 1e-5
    for i in CONV_LAYERS:
        in_gate, _, x = records[i]["projected"].double().chunk(3, dim=-1)
        H = unified[i][0].double()  # (D, N, N) over x
        assert H.shape == (16, 28, 28)
        got = torch.einsum("cij,jc->ic", H, x)
        assert relative_error(got, records[i]["out_in"]) <= bound, i
        # hidden: the band alone over u = B ⊙ x gives the Conv2d output (read from its raster output)
        M = hidden[i][0].double()
        got = torch.einsum("cij,jc->ic", M, in_gate * x)
        assert relative_error(got, packed_conv_output(conv_out[i], layout, layout.item_slices())) <= bound, i
        assert records[i]["out_in"].abs().max() > 1e-2  # not vacuous


@pytest.mark.parametrize("attn, dtype", [("sdpa", torch.float32), ("sdpa", torch.float64), ("eager", torch.float32),
                                         ("eager", torch.float64),
                                         ("flex_attention", torch.float32)])  # flex on CPU: no float64
def test_attention_layers_reproduce_their_output(attn, dtype):
    tower = make_tower(dtype, attn)
    pixels, grid = patches(GRID, dtype)
    records = record(tower, pixels, grid, {i: [
        (tower.layers[i].self_attn.v_proj, "v", False, lambda t: t.detach()),
        (tower.layers[i].self_attn.out_proj, "out_in", True, lambda t: t),
        (tower.layers[i].self_attn, "out", False, lambda t: t.detach())] for i in ATTENTION_LAYERS})
    maps = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None, layers=list(ATTENTION_LAYERS))
    assert list(maps) == list(ATTENTION_LAYERS)
    # HF's eager attention takes the softmax in float32 even for float64 models: its output is rounded to that
    bound = 1e-5 if dtype == torch.float32 else (1e-6 if attn == "eager" else 1e-10)
    for i in ATTENTION_LAYERS:
        P = maps[i][0].double()  # (H, N, N)
        assert P.shape == (4, 28, 28)
        v = records[i]["v"].double().view(28, 2, 4).repeat_interleave(2, dim=1)  # kv heads repeated: (N, H, d)
        got = torch.einsum("hij,jhd->ihd", P, v).reshape(28, 16)
        assert relative_error(got, records[i]["out_in"]) <= bound, i
        out_proj = tower.layers[i].self_attn.out_proj.weight.double()
        assert relative_error(got @ out_proj.T, records[i]["out"]) <= bound, i
        assert torch.allclose(P.sum(-1), torch.ones(4, 28, dtype=P.dtype))  # rows sum to one within their frame


def test_flash_varlen_calls_keep_their_segments():
    """Flash attention gets one call with cu_seq_lens_q / _k: the recorded segments keep P block-diagonal (a torch
    stand-in for flash's varlen kernel, registered under a name with "flash", takes flash's code path)."""

    def varlen(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
               cu_seq_lens_k=None, is_causal=False, **kwargs):
        outputs = []
        key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
        for start, stop in zip(cu_seq_lens_q[:-1].tolist(), cu_seq_lens_q[1:].tolist()):
            outputs.append(F.scaled_dot_product_attention(query[:, :, start:stop], key[:, :, start:stop],
                                                          value[:, :, start:stop], scale=scaling))
        return torch.cat(outputs, dim=2).transpose(1, 2), None

    ALL_ATTENTION_FUNCTIONS["test_flash_varlen"] = varlen
    try:
        tower = make_tower(torch.float64, "sdpa")
        pixels, grid = patches(VIDEO, torch.float64)
        sdpa = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None)
        tower.config._attn_implementation = "test_flash_varlen"
        operators, _, errors = mc.build_operators(tower, pixels, grid_thw=grid)
        flash = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None)
    finally:
        del ALL_ATTENTION_FUNCTIONS["test_flash_varlen"]
    assert max(errors.values()) <= 1e-10
    for i in ATTENTION_LAYERS:
        assert relative_error(flash[i], sdpa[i]) <= 1e-10


@pytest.mark.parametrize("grid", [GRID, VIDEO])
def test_nothing_crosses_frames_or_items(grid):
    tower = make_tower()
    pixels, grid = patches(grid)
    frames = PackedPatches.from_grid(grid, MERGE).frames()
    outside = frames[:, None] != frames[None, :]
    for formulation in ("unified", "hidden"):
        for reduce in (None, "abs_mean"):
            maps = mc.implicit_attention(tower, pixels, grid_thw=grid, formulation=formulation, reduce=reduce)
            for key, value in maps.items():
                assert torch.all(value[..., outside] == 0), (key, formulation, reduce)
                assert value[..., ~outside].abs().max() > 0


def test_packed_items_equal_items_alone():
    tower = make_tower(torch.float64)
    pixels, grid = patches(GRID, torch.float64)
    layout = PackedPatches.from_grid(grid, MERGE)
    packed = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None)
    rollout = mc.MambaRollout(tower).attribute(pixels, grid_thw=grid)[:, 0]
    raw = mc.MambaRawAttention(tower).attribute(pixels, grid_thw=grid)[:, 0]
    for item, part in enumerate(layout.item_slices()):
        alone = mc.implicit_attention(tower, pixels[part], grid_thw=grid[item:item + 1], reduce=None)
        for key in packed:
            assert relative_error(packed[key][..., part, part], alone[key]) <= 1e-10, (item, key)
        single = mc.MambaRollout(tower).attribute(pixels[part], grid_thw=grid[item:item + 1])[:, 0]
        assert relative_error(rollout[part], single) <= 1e-10
        single = mc.MambaRawAttention(tower).attribute(pixels[part], grid_thw=grid[item:item + 1])[:, 0]
        assert relative_error(raw[part], single) <= 1e-10


def test_reductions_rows_and_components():
    tower = make_tower(torch.float64)
    pixels, grid = patches(GRID, torch.float64)
    full = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None)
    for reduce, fn in (("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1)),
                       ("abs_mean", lambda t: t.abs().mean(1))):
        reduced = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=reduce)
        rows = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=reduce, rows=[0, -1, 20])
        for key in full:
            assert relative_error(reduced[key], fn(full[key])) <= 1e-12, (key, reduce)
            assert torch.equal(rows[key], reduced[key][:, [0, 27, 20]])
    # without the taps the band is diag(C ⊙ B); without the gates it is the taps alone (the hidden map)
    records = record(tower, pixels, grid, {0: [(tower.layers[0].conv.in_proj, "projected", False, lambda t: t)]})
    in_gate, out_gate, _ = records[0]["projected"].chunk(3, dim=-1)
    diagonal = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None, layers=[0], components=("gate", "act"))
    assert relative_error(diagonal[0][0], torch.diag_embed((in_gate * out_gate).T)) <= 1e-12
    taps = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None, layers=[0], components=("conv",))
    hidden = mc.implicit_attention(tower, pixels, grid_thw=grid, reduce=None, layers=[0], formulation="hidden")
    assert relative_error(taps[0], hidden[0]) <= 1e-12


def test_methods_shapes_and_no_side_effects():
    tower = make_tower()
    before = model_state(tower)
    pixels, grid = patches(GRID)
    head = torch.nn.Linear(16, 3)

    def scores(pixel_values, grid_thw):  # (1, K): a head on the mean of the tower's output tokens
        return head(tower(pixel_values, grid_thw=grid_thw).last_hidden_state.mean(0, keepdim=True))

    for method in (mc.MambaRawAttention(tower), mc.MambaRollout(tower)):
        relevance = method.attribute(pixels, grid_thw=grid)
        assert relevance.shape == pixels.shape and torch.equal(relevance, relevance[:, :1].expand_as(relevance))
        grids = PackedPatches.from_grid(grid, MERGE).to_grids(relevance[:, 0])
        assert [tuple(g.shape) for g in grids] == [(1, 4, 4), (1, 2, 6)]
    for rule in ("grad_x_operator", "residual"):
        relevance = mc.MambaAttribution(tower, forward_func=scores).attribute(
            (pixels,), target=1, additional_forward_args={"grid_thw": grid}, gradient_rule=rule)
        assert isinstance(relevance, tuple) and relevance[0].shape == pixels.shape
        assert bool(torch.isfinite(relevance[0]).all()) and relevance[0].abs().max() > 0
    with pytest.raises(TypeError, match="returns hidden states, no scores"):
        mc.MambaAttribution(tower).attribute(pixels, grid_thw=grid)
    with pytest.raises(ValueError, match="CLS token"):
        mc.MambaRollout(tower).attribute(pixels, grid_thw=grid, recipe="official")
    with pytest.raises(ValueError, match="position= does not apply"):
        mc.MambaRollout(tower).attribute(pixels, grid_thw=grid, position=0)
    with pytest.raises(TypeError, match="attribute_generation"):
        mc.MambaRollout(tower).attribute_generation(pixels)
    assert_untouched(tower, before)


def test_bad_inputs_are_refused_and_leave_nothing():
    tower = make_tower()
    before = model_state(tower)
    pixels, grid = patches(GRID)
    with pytest.raises(ValueError, match="grid_thw="):
        mc.implicit_attention(tower, pixel_values=pixels)
    with pytest.raises(ValueError, match="holds 28 patches, pixel_values 27"):
        mc.implicit_attention(tower, pixel_values=pixels[:27], grid_thw=grid)
    with pytest.raises(ValueError, match="multiples of the tower's spatial_merge_size"):
        mc.implicit_attention(tower, pixel_values=pixels, grid_thw=torch.tensor([[1, 4, 7]]))
    with pytest.raises(TypeError, match="grid_thw must be a tensor"):
        mc.implicit_attention(tower, pixel_values=pixels, grid_thw=GRID)
    with pytest.raises(ValueError, match="no attention_mask"):
        mc.implicit_attention(tower, pixels, torch.ones(1, 28), grid_thw=grid)
    with pytest.raises(ValueError, match="given twice"):
        mc.implicit_attention(tower, pixels, pixel_values=pixels, grid_thw=grid)
    with pytest.raises(TypeError, match="pixels_values= is neither"):
        mc.implicit_attention(tower, grid_thw=grid, pixels_values=pixels)
    with pytest.raises(TypeError, match="pixel values are torch.float64"):
        mc.implicit_attention(tower, pixels.double(), grid_thw=grid)
    # keyword and positional forms give the same maps
    keyword = mc.implicit_attention(tower, pixel_values=pixels, grid_thw=grid)
    positional = mc.implicit_attention(tower, pixels, grid_thw=grid)
    assert all(torch.equal(keyword[k], positional[k]) for k in keyword)
    assert_untouched(tower, before)
