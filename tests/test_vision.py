"""Vision Mamba: the official architectures and checkpoints, the bidirectional operator's identities, image inputs
and pixel attributions. Shapes of the tiny model (tests/tiny_models.VIM): 32×32 images, 8-pixel patches, a 4×4
grid, the CLS token in the middle (index 8), L = 17, d_inner = 24, N = 4, K = 4."""
import argparse
import contextlib
import copy

import numpy
import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from tiny_models import VIM, make_vim

import mamba_captum as mc
import mamba_captum.vision.modeling_vim as vim_module
from mamba_captum.vision import TokenLayout, load_vim, preprocess, read_checkpoint, to_display, vim_small, vim_tiny
from mamba_captum.vision.checkpoints import VARIANTS

LENGTH = 17


def pixels(batch=2, seed=1, dtype=torch.float32):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- the official checkpoints -------------------------------------------------------------------------------------
def official_shapes(embed: int, tokens: int, depth: int = 24, classes: int = 1000) -> dict:
    """The keys and shapes of an official Vim checkpoint, written out from the official code's modules (bimamba
    v2: every scan parameter twice, the backward one with suffix _b / A_b_log / D_b), not from our model."""
    inner, rank, state = 2 * embed, -(-embed // 16), 16
    shapes = {"cls_token": (1, 1, embed), "pos_embed": (1, tokens, embed),
              "patch_embed.proj.weight": (embed, 3, 16, 16), "patch_embed.proj.bias": (embed,),
              "norm_f.weight": (embed,), "head.weight": (classes, embed), "head.bias": (classes,)}
    for i in range(depth):
        p = f"layers.{i}.mixer."
        shapes.update({p + "in_proj.weight": (2 * inner, embed), p + "out_proj.weight": (embed, inner),
                       f"layers.{i}.norm.weight": (embed,)})
        for conv, x_proj, dt_proj, a_log, d in (("conv1d", "x_proj", "dt_proj", "A_log", "D"),
                                                ("conv1d_b", "x_proj_b", "dt_proj_b", "A_b_log", "D_b")):
            shapes.update({p + conv + ".weight": (inner, 1, 4), p + conv + ".bias": (inner,),
                           p + x_proj + ".weight": (rank + 2 * state, inner), p + dt_proj + ".weight": (inner, rank),
                           p + dt_proj + ".bias": (inner,), p + a_log: (inner, state), p + d: (inner,)})
    return shapes


@pytest.mark.parametrize("factory, embed, stride, tokens", [(vim_tiny, 192, 16, 197), (vim_tiny, 192, 8, 730),
                                                            (vim_small, 384, 16, 197)])
def test_the_factories_build_the_official_keys_and_shapes(factory, embed, stride, tokens):
    expected = official_shapes(embed, tokens)
    model = factory(stride=stride)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    assert model.layers[0].mixer.dt_rank == (12 if embed == 192 else 24)
    assert model.token_layout().cls_index == (98 if tokens == 197 else 364)


@pytest.mark.parametrize("embed, tokens, name", [
    (192, 197, "vim_tiny_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2"),
    (192, 730, "vim_tiny_patch16_stride8_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2"),
    (384, 197, "vim_small_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2")])
def test_an_official_state_dict_loads_key_for_key_and_the_variant_is_detected(embed, tokens, name):
    generator = torch.Generator().manual_seed(0)
    state = {k: torch.randn(shape, generator=generator) * 0.02 for k, shape in official_shapes(embed, 730 if tokens
                                                                                                == 730 else 197).items()}
    model = load_vim({"model": state, "epoch": 300})
    assert model.variant == name and name in VARIANTS and not model.training
    assert model.patch_embed.stride == (8 if tokens == 730 else 16)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_checkpoint_file_with_its_training_arguments_loads(tmp_path):
    model = make_vim()
    path = tmp_path / "vim.pth"
    torch.save({"model": model.state_dict(), "optimizer": {"state": {}}, "epoch": 3,
                "args": argparse.Namespace(model="vim_tiny", lr=5e-4)}, path)
    loaded = load_vim(path, img_size=32)
    x = pixels()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert set(read_checkpoint(path)) == set(model.state_dict())


class NotAllowed:  # an arbitrary class in a pickle: weights_only loading refuses it
    pass


def test_unreadable_files_are_refused_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_vim(tmp_path / "missing.pth")
    path = tmp_path / "odd.pth"
    torch.save({"model": make_vim().state_dict(), "extra": NotAllowed()}, path)
    with pytest.raises(ValueError, match="weights_only=False"):
        load_vim(path)
    with pytest.raises(ValueError, match="not a Vim checkpoint"):
        load_vim({"model": {"backbone.embeddings.weight": torch.zeros(3, 3)}})


def test_missing_unexpected_and_mismatched_keys_are_named():
    state = make_vim().state_dict()
    del state["layers.1.mixer.D_b"]
    state["layers.0.mixer.gamma"] = torch.ones(12)
    state["layers.0.mixer.out_proj.weight"] = torch.zeros(12, 23)
    with pytest.raises(ValueError) as error:
        load_vim(state, img_size=32)
    message = str(error.value)
    assert "missing keys (1): layers.1.mixer.D_b" in message
    assert "unexpected keys (1): layers.0.mixer.gamma" in message
    assert "layers.0.mixer.out_proj.weight (12, 23) (model: (12, 24))" in message


def test_weights_that_are_not_floating_point_are_named_not_cast():
    state = make_vim().state_dict()
    assert all(value.is_floating_point() for value in state.values())  # a Vim has no integer buffers
    quantized = {key: (value * 100).to(torch.int8) for key, value in state.items()}
    with pytest.raises(ValueError) as refused:
        load_vim(quantized, img_size=32)
    first = ", ".join(f"{key} (int8)" for key in list(state)[:4])
    assert str(refused.value).startswith(f"mamba_captum: the checkpoint holds {len(state)} tensors that are not "
                                         f"floating point: {first} and {len(state) - 4} more. A Vim's weights are "
                                         "all float")
    assert "not a Vim model checkpoint, or a quantized one" in str(refused.value)
    # one integer weight among float ones: load_state_dict would cast it into the float parameter without a word
    state["layers.1.mixer.in_proj.weight"] = state["layers.1.mixer.in_proj.weight"].round().long()
    with pytest.raises(ValueError, match=r"holds 1 tensor that is not floating point: "
                                         r"layers.1.mixer.in_proj.weight \(int64\)\. A Vim's"):
        load_vim(state, img_size=32)
    with pytest.raises(ValueError, match="dtype=torch.int8; a Vim computes in a floating-point dtype"):
        load_vim(make_vim().state_dict(), img_size=32, dtype=torch.int8)


def test_an_image_size_that_cannot_hold_the_grid_is_refused():
    state = make_vim().state_dict()  # a 4×4 grid of 8-pixel patches: 10-pixel images hold at most 3×3
    with pytest.raises(ValueError, match="no stride without gaps gives 16 patches"):
        load_vim(state, img_size=10)
    with pytest.raises(ValueError, match="stride=6 does not give 16 patches"):
        load_vim(state, img_size=32, stride=6)


# -- the forward pass ---------------------------------------------------------------------------------------------
def reference_forward(model, x):
    """Vim's forward written token by token from the official code's math (float64): patches, CLS insertion,
    Add → RMSNorm → bidirectional mixer, final norm, CLS row (or mean) → head."""
    model = model.double()
    x = x.double()
    embed = model.patch_embed
    patches = F.conv2d(x, embed.proj.weight, embed.proj.bias, stride=embed.stride).flatten(2).transpose(1, 2)
    index = model.cls_index()
    tokens = patches if index is None else torch.cat(
        [patches[:, :index], model.cls_token.expand(x.shape[0], -1, -1), patches[:, index:]], 1)
    residual = tokens + model.pos_embed

    def rms(h, weight):
        return h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5) * weight

    def scan(mixer, x_in, z, suffix):
        conv = getattr(mixer, "conv1d" + suffix)
        A = -torch.exp(mixer.A_log if suffix == "" else mixer.A_b_log)
        D = mixer.D if suffix == "" else mixer.D_b
        length, taps = x_in.shape[1], conv.weight.shape[-1]
        out = torch.zeros_like(x_in)
        state = torch.zeros(x_in.shape[0], x_in.shape[2], A.shape[1], dtype=torch.float64)
        for t in range(length):
            pre = conv.bias + sum(conv.weight[:, 0, taps - 1 - k] * x_in[:, t - k] for k in range(taps) if t - k >= 0)
            u = F.silu(pre)  # (B, D)
            # u of token t only depends on x up to t: recompute x_proj on it
            dt, B, C = torch.split(u @ getattr(mixer, "x_proj" + suffix).weight.t(),
                                   [mixer.dt_rank, mixer.d_state, mixer.d_state], -1)
            dt_proj = getattr(mixer, "dt_proj" + suffix)
            delta = F.softplus(dt @ dt_proj.weight.t() + dt_proj.bias)
            state = torch.exp(delta[..., None] * A) * state + (delta * u)[..., None] * B[:, None, :]
            out[:, t] = ((state * C[:, None, :]).sum(-1) + D * u) * F.silu(z[:, t])
        return out

    for block in model.layers:
        mixer = block.mixer
        xz = rms(residual, block.norm.weight) @ mixer.in_proj.weight.t()
        x_in, z = xz.chunk(2, -1)
        y = (scan(mixer, x_in, z, "") + scan(mixer, x_in.flip(1), z.flip(1), "_b").flip(1)) / 2
        residual = residual + y @ mixer.out_proj.weight.t()
    hidden = rms(residual, model.norm_f.weight)
    pooled = hidden[:, index] if index is not None else hidden.mean(1)
    return pooled @ model.head.weight.t() + model.head.bias


@pytest.mark.parametrize("cls_position", ["middle", "first", "last", None])
def test_the_forward_is_the_official_math_token_by_token(cls_position):
    model = make_vim(cls_position=cls_position)
    x = pixels()
    with torch.no_grad():
        got = model.double()(x.double())
        expected = reference_forward(make_vim(cls_position=cls_position), x)
    assert relative_error(got, expected) < 1e-10


def test_float32_forward_is_the_float64_forward():
    x = pixels()
    with torch.no_grad():
        assert relative_error(make_vim()(x), make_vim().double()(x.double())) < 1e-5


# -- the operator: y = H x ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def recorded_mixers(model):
    """The test's own hooks: per mixer, (conv input x, out_proj input) of the real forward pass."""
    records = []
    handles = []
    for block in model.layers:
        entry = {}
        records.append(entry)
        handles.append(block.mixer.in_proj.register_forward_hook(
            lambda m, a, out, entry=entry: entry.__setitem__("x", out.detach().chunk(2, -1)[0])))
        handles.append(block.mixer.out_proj.register_forward_pre_hook(
            lambda m, a, entry=entry: entry.__setitem__("y", a[0].detach())))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def without_untokened_parts(model):
    """Conv biases and D skips to 0: what the unified operator leaves out, so that out_proj's input is H x."""
    with torch.no_grad():
        for block in model.layers:
            for parameter in (block.mixer.conv1d.bias, block.mixer.conv1d_b.bias, block.mixer.D, block.mixer.D_b):
                parameter.zero_()
    return model


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 3e-5), (torch.float64, 1e-10)])
def test_unified_maps_reproduce_out_projs_input(dtype, tolerance):
    model = without_untokened_parts(make_vim(dtype=dtype))
    x = pixels(dtype=dtype)
    with recorded_mixers(model) as records, torch.no_grad():
        model(x)
    maps = mc.implicit_attention(model, x, reduce=None)
    assert sorted(maps) == [0, 1]
    for layer, record in enumerate(records):
        H = maps[layer]  # (B, D_in, L, L)
        assert H.shape == (2, 24, LENGTH, LENGTH) and H.dtype == dtype
        got = torch.einsum("bcij,bjc->bic", H.double(), record["x"].double())
        assert relative_error(got, record["y"]) < tolerance
        # non-causal: the backward scan fills the upper triangle
        assert H.triu(1).abs().max() > 0.01 * H.abs().max() and H.tril(-1).abs().max() > 0.01 * H.abs().max()


@contextlib.contextmanager
def recorded_scans():
    """The test's own record of every scan the model runs: (u, pure S6 output without D skip and gate)."""
    calls = []
    original = vim_module.selective_scan

    def recording(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
        pure = original(u, delta, A, B, C, delta_bias=delta_bias, delta_softplus=delta_softplus)
        calls.append((u.detach().transpose(1, 2), pure.detach().transpose(1, 2)))
        return original(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)

    vim_module.selective_scan = recording
    try:
        yield calls
    finally:
        vim_module.selective_scan = original


def test_hidden_maps_are_the_two_scans_spliced():
    model = make_vim(dtype=torch.float64)
    x = pixels(dtype=torch.float64)
    with recorded_scans() as calls, torch.no_grad():
        model(x)
    operators, _, errors = mc.build_operators(model, x, formulation="hidden")
    combined = mc.implicit_attention(model, x, formulation="hidden", reduce=None)
    for layer in (0, 1):
        (u_f, y_f), (u_b, y_b) = calls[2 * layer], calls[2 * layer + 1]  # forward, then backward (reversed)
        op = operators[layer]
        alpha_f, alpha_b = op.forward.maps(None), op.backward.maps(None)  # each causal in its own order
        assert relative_error(torch.einsum("bcij,bjc->bic", alpha_f, u_f), y_f) < 1e-10
        assert relative_error(torch.einsum("bcij,bjc->bic", alpha_b, u_b), y_b) < 1e-10
        assert torch.equal(alpha_f, alpha_f.tril()) and torch.equal(alpha_b, alpha_b.tril())
        spliced = alpha_f + alpha_b.flip(-2, -1)  # α_f + J α_b J
        assert relative_error(combined[layer], spliced) < 1e-12
        assert errors[layer] < 1e-10


def test_reductions_are_the_reductions_of_the_per_channel_maps():
    model = make_vim()
    x = pixels(batch=3)
    for formulation in ("unified", "hidden"):
        full = mc.implicit_attention(model, x, formulation=formulation, reduce=None)
        for reduce, reduction in (("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1)),
                                  ("abs_mean", lambda t: t.abs().mean(1))):
            reduced = mc.implicit_attention(model, x, formulation=formulation, reduce=reduce)
            for layer in full:
                # abs_mean: the two directions' diagonals add per channel before |·| (the operator's correction)
                assert relative_error(reduced[layer], reduction(full[layer])) < 1e-5, (formulation, reduce)


def test_rows_are_the_rows_of_the_full_maps_in_both_directions():
    model = make_vim()
    x = pixels()
    rows = [8, 0, -1, 3, 3, 12]
    for reduce in (None, "mean", "abs_mean"):
        full = mc.implicit_attention(model, x, reduce=reduce)
        some = mc.implicit_attention(model, x, reduce=reduce, rows=rows)
        index = [r % LENGTH for r in rows]
        for layer in full:
            expected = full[layer][:, :, index] if reduce is None else full[layer][:, index]
            assert relative_error(some[layer], expected) < 1e-6


def test_batched_maps_and_attributions_equal_one_image_at_a_time():
    model = make_vim()
    x = pixels(batch=3)
    batched = mc.implicit_attention(model, x)
    relevance = mc.MambaAttribution(model).attribute(x, target=[0, 3, 1])
    for b in range(3):
        alone = mc.implicit_attention(model, x[b:b + 1])
        for layer in batched:
            assert relative_error(batched[layer][b:b + 1], alone[layer]) < 1e-5
        single = mc.MambaAttribution(model).attribute(x[b:b + 1], target=[0, 3, 1][b])
        assert relative_error(relevance[b:b + 1], single) < 1e-5


# -- pixel attributions ----------------------------------------------------------------------------------------------
def test_patch_values_go_to_the_pixels_as_the_papers_upsample():
    layout = TokenLayout(grid=(4, 4), cls_index=8, img_size=(32, 32), patch_size=(8, 8), stride=8)
    relevance = torch.randn(2, LENGTH, dtype=torch.float64)
    grid = torch.cat([relevance[:, :8], relevance[:, 9:]], 1).reshape(2, 1, 4, 4)
    expected = F.interpolate(grid, scale_factor=8, mode="bilinear", align_corners=False)
    assert relative_error(layout.to_pixels(relevance), expected) < 1e-12
    # overlapping patches (stride 4 < patch 7): each value sits at its patch's centre pixel 4 i + 3, and pixels
    # between two centres are linear between the two values
    overlapping = TokenLayout(grid=(7, 7), cls_index=None, img_size=(31, 31), patch_size=(7, 7), stride=4)
    values = torch.randn(1, 49, dtype=torch.float64)
    image = overlapping.to_pixels(values)[0, 0]
    grid = values.reshape(7, 7)
    assert torch.allclose(image[3::4, 3::4], grid)
    assert torch.allclose(image[4::4, 3::4][:6], 0.75 * grid[:-1] + 0.25 * grid[1:])


@pytest.mark.parametrize("cls_position", ["middle", "first", "last", None])
def test_rollout_is_the_cls_row_of_the_maps_rollout_in_pixels(cls_position):
    model = make_vim(cls_position=cls_position)
    x = pixels()
    maps = mc.implicit_attention(model, x)
    layout = model.token_layout()
    length = layout.length  # 16 patches (+ the CLS token)
    product = torch.eye(length).expand(2, -1, -1)
    for layer in sorted(maps):
        step = torch.eye(length) + maps[layer].clamp(min=0)
        product = (step / step.sum(-1, keepdim=True)) @ product
    # a CLS head reads its row; a mean-pooling head (no CLS token) the mean of the rows
    row = product[:, layout.cls_index] if cls_position is not None else product.mean(1)
    got = mc.MambaRollout(model).attribute(x)
    assert got.shape == (2, 1, 32, 32)
    assert relative_error(got, layout.to_pixels(row)) < 1e-5


def test_captum_conventions_on_pixels():
    model = make_vim()
    x = pixels()
    attribution = mc.MambaAttribution(model)
    logits = model(x)
    assert torch.equal(attribution.attribute(x), attribution.attribute(x, target=logits.argmax(-1)))
    assert attribution.attribute((x,), target=2)[0].shape == (2, 1, 32, 32)
    with pytest.raises(IndexError, match="5 classes"):
        attribution.attribute(x, target=5)
    # the class matters: a different target gives a different map
    assert not torch.allclose(attribution.attribute(x, target=0), attribution.attribute(x, target=4))


def test_the_official_recipes_read_the_cls_row_of_both_directions():
    """HMA and UIA splice the forward scan's CLS row (tokens before it) and the backward scan's (tokens after it);
    the CLS row of α_f + J α_b J is that splice off the diagonal, which the official recipes drop."""
    model = make_vim()
    x = pixels(batch=1)
    per_channel = mc.implicit_attention(model, x, reduce=None, rows=[8])  # (1, C, 1, L)
    operators, _, _ = mc.build_operators(model, x)
    for layer, op in operators.items():
        forward_row = op.forward.maps(None, [8])[..., :8]
        backward_row = op.backward.maps(None, [LENGTH - 1 - 8]).flip(-1)[..., 9:]
        assert relative_error(per_channel[layer][..., :8], forward_row) < 1e-6
        assert relative_error(per_channel[layer][..., 9:], backward_row) < 1e-6
    for method in (mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution):
        for formulation in ("hidden", "unified"):
            relevance = method(model).attribute(x, recipe="official", formulation=formulation)
            assert relevance.shape == (1, 1, 32, 32) and bool((relevance >= 0).all())


def test_visualize_image_attr_takes_the_output():
    import matplotlib

    matplotlib.use("Agg")
    from captum.attr import visualization

    model = make_vim()
    x = pixels(batch=1)
    relevance = mc.MambaAttribution(model).attribute(x, target=1)
    figure, _ = visualization.visualize_image_attr(relevance[0].permute(1, 2, 0).numpy(), to_display(x),
                                                   method="blended_heat_map", sign="absolute_value",
                                                   use_pyplot=False)
    assert figure is not None


def test_preprocess_gives_the_models_input(tmp_path):
    from PIL import Image

    image = Image.fromarray((torch.rand(40, 60, 3) * 255).byte().numpy())
    path = tmp_path / "image.png"
    image.save(path)
    x = preprocess(path, img_size=32)
    assert x.shape == (1, 3, 32, 32) and x.dtype == torch.float32
    assert to_display(x).shape == (32, 32, 3)
    assert mc.MambaRollout(make_vim()).attribute(x).shape == (1, 1, 32, 32)
    with pytest.raises(ValueError, match="not an image"):
        preprocess(tmp_path.joinpath("x.png").write_text("text") and tmp_path / "x.png")


# -- refusals and state ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, error, message", [
    (lambda m: mc.implicit_attention(m, pixels(), torch.ones(2, LENGTH)), ValueError, "no padding"),
    (lambda m: mc.implicit_attention(m, torch.randn(2, 3, 28, 28)), ValueError, "takes 32×32"),
    (lambda m: mc.implicit_attention(m, torch.randn(2, 1, 32, 32)), ValueError, "1 channels"),
    (lambda m: mc.implicit_attention(m, torch.randn(3, 32, 32)), ValueError, "pixel_values\\[None\\]"),
    (lambda m: mc.implicit_attention(m, pixels(dtype=torch.float64)), TypeError, "pixel_values.to"),
    (lambda m: mc.implicit_attention(m, torch.zeros(2, 3, 32, 32, dtype=torch.long)), TypeError, "pixel values"),
    (lambda m: mc.MambaRollout(m).attribute(pixels(), position=3), ValueError, "CLS token"),
    (lambda m: mc.MambaAttribution(m).attribute(pixels(), attention_mask=torch.ones(2, LENGTH)), ValueError,
     "no padding"),
    (lambda m: mc.MambaAttribution(m).attribute_generation(pixels()), TypeError, "image model"),
    (lambda m: mc.implicit_attention(m, pixels(), formulaton="hidden"), TypeError, "formulation"),
])
def test_bad_image_inputs_are_refused(call, error, message):
    model = make_vim()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=message):
        call(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_official_codes_mixer_is_pointed_to_load_vim():
    class Mamba(torch.nn.Module):  # the official code's mixer (mamba-ssm fork) as far as the library looks
        def __init__(self):
            super().__init__()
            self.A_log = torch.nn.Parameter(torch.zeros(2, 2))
            self.bimamba_type = "v2"

    model = make_vim()
    model.layers[1].mixer = Mamba()
    with pytest.raises(TypeError, match="load_vim"):
        mc.implicit_attention(model, pixels())


def test_a_mean_pooling_model_refuses_the_official_recipe():
    model = make_vim(cls_position=None)
    with pytest.raises(ValueError, match="no CLS token"):
        mc.MambaAttribution(model).attribute(pixels(), recipe="official")


def test_attribution_leaves_the_model_as_it_was():
    model = make_vim().train()
    parameters = {k: v.clone() for k, v in model.state_dict().items()}
    mc.MambaAttribution(model).attribute(pixels(), target=1, gradient_rule="residual")
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(parameters[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_tiny_config_is_what_the_docstring_says():
    assert VIM["img_size"] == 32 and VIM["patch_size"] == 8 and make_vim().token_layout().length == LENGTH


@pytest.mark.parametrize("dtype, bound", [(torch.float16, 1e-2), (torch.bfloat16, 5e-2)])
def test_half_precision_vims_are_explained(dtype, bound):
    """The scan's float32 D skip must not promote the mixer output (mamba-ssm returns the input's dtype); the
    engine's own check holds the maps to the dtype's guarantee (docs/robustness.md). Measured against the float32
    model: 1.7e-3 (float16), 1.4e-2 (bfloat16)."""
    x = pixels()
    full = mc.implicit_attention(make_vim(), x)
    half = mc.implicit_attention(make_vim(dtype=dtype), x.to(dtype))
    for layer in full:
        assert half[layer].dtype == torch.float32
        assert relative_error(half[layer], full[layer]) < bound
    relevance = mc.MambaAttribution(make_vim(dtype=dtype)).attribute(x.to(dtype), target=1)
    assert relevance.dtype == dtype and bool(torch.isfinite(relevance).all())


# -- review findings: checkpoints of other sizes, forward_func on pixels, explain_images ---------------------------
def test_a_model_not_trained_at_224_needs_its_image_size():
    state = make_vim().state_dict()  # 4×4 grid of 8-pixel patches: at 224 it would only fit with gaps (stride 72)
    with pytest.raises(ValueError, match="pass img_size="):
        load_vim(state)
    assert load_vim(state, img_size=32).patch_embed.stride == 8


@pytest.mark.parametrize("options", [dict(img_size=36, stride=8), dict(img_size=(32, 48)),
                                     dict(img_size=(24, 40), stride=4, cls_position=None)])
def test_any_vision_mamba_round_trips_through_load_vim(options):
    model = make_vim(**options)
    loaded = load_vim(model.state_dict(), img_size=options["img_size"],
                      **{k: v for k, v in options.items() if k != "img_size"})
    height, width = (options["img_size"],) * 2 if isinstance(options["img_size"], int) else options["img_size"]
    x = torch.randn(1, 3, height, width)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded.patch_embed.grid_size == model.patch_embed.grid_size


def test_load_vim_keeps_the_stored_dtype():
    state = {k: v.half() for k, v in make_vim().state_dict().items()}
    assert next(load_vim(state, img_size=32).parameters()).dtype == torch.float16
    assert next(load_vim(state, img_size=32, dtype=torch.float32).parameters()).dtype == torch.float32


def test_a_forward_func_that_resizes_pixels_is_refused():
    model = make_vim()
    upsample = lambda x: model(F.interpolate(x, size=(32, 32)))  # noqa: E731
    with pytest.raises(ValueError, match="resizes or reshapes"):
        mc.MambaAttribution(model, forward_func=upsample).attribute(torch.randn(1, 3, 16, 16), target=0)
    normalising = lambda x: model((x - 0.5) / 0.25)  # noqa: E731 (the same pixels, normalised: explained)
    for method in (mc.MambaRollout, mc.MambaAttribution):  # no images: refused as without a forward_func
        with pytest.raises(ValueError, match=r"the pixel values hold no images \(batch size 0\)"):
            method(model, forward_func=normalising).attribute(pixels()[:0], target=0)
    assert mc.MambaRollout(model, forward_func=normalising).attribute(pixels()).shape == (2, 1, 32, 32)


def test_explain_images_takes_batches_and_refuses_a_headless_model():
    from mamba_captum.explain import UsageError
    from mamba_captum.vision.explain import explain_images

    model = make_vim()
    assert len(explain_images(model, [pixels(batch=3)], methods="rollout")) == 3
    headless = load_vim({k: v for k, v in model.state_dict().items() if not k.startswith("head.")}, img_size=32)
    with pytest.raises(UsageError, match="no classifier head"):
        explain_images(headless, [pixels(batch=1)])


def test_preprocess_follows_torchvisions_resize_and_centre_crop(tmp_path):
    """torchvision's Resize truncates the longer side (int(256 · 640 / 427) = 383) and CenterCrop rounds the
    offsets: a 640×427 image is resized to 383×256 and cropped at left round(79.5) = 80, top round(16) = 16."""
    from PIL import Image

    row = torch.arange(640, dtype=torch.float32)[None, :, None].expand(427, 640, 3)
    Image.fromarray((row / 640 * 255).byte().numpy()).save(tmp_path / "wide.png")
    resized = Image.open(tmp_path / "wide.png").convert("RGB").resize((383, 256), Image.BICUBIC)
    expected = torch.from_numpy(numpy.asarray(resized.crop((80, 16, 304, 240)), dtype=numpy.float32) / 255.0)
    got = preprocess(tmp_path / "wide.png")[0] * torch.tensor([0.229, 0.224, 0.225])[:, None, None] \
        + torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    assert torch.allclose(got.permute(1, 2, 0), expected, atol=1e-6)
    assert preprocess(tmp_path / "wide.png", img_size=(32, 48)).shape == (1, 3, 32, 48)


# -- property-based: random Vim configs (the property suite's profiles, tests/test_properties.py) -------------------
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_properties import PROFILE, heavy_twin  # noqa: E402


@st.composite
def vims(draw):
    """A random tiny Vim: odd widths, state sizes, conv widths, expansions, patch / stride / image sizes (square or
    not, overlapping patches, leftover pixels), CLS anywhere or mean pooling, float32 or float64."""
    patch = draw(st.integers(2, 5))
    stride = draw(st.integers(max(1, patch - 2), patch))
    height, width = (patch + stride * draw(st.integers(0, 3)) + draw(st.integers(0, stride - 1)) for _ in range(2))
    options = dict(depth=draw(st.integers(1, 3)), embed_dim=draw(st.integers(2, 9)), d_state=draw(st.integers(1, 4)),
                   d_conv=draw(st.integers(1, 5)), expand=draw(st.sampled_from([1, 2])), patch_size=patch,
                   stride=stride, img_size=(height, width), num_classes=draw(st.integers(1, 4)),
                   cls_position=draw(st.sampled_from(["middle", "first", "last", None])))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return make_vim(seed=draw(st.integers(0, 2**16)), dtype=dtype, **options), dtype


@PROFILE
@given(data=st.data())
def test_random_vims_satisfy_the_identities(data):
    model, dtype = data.draw(vims(), label="model")
    layout = model.token_layout()
    batch = data.draw(st.integers(1, 3), label="batch")
    x = torch.randn(batch, 3, *layout.img_size, generator=torch.Generator().manual_seed(data.draw(
        st.integers(0, 2**16), label="pixels")), dtype=dtype)
    tolerance = 3e-5 if dtype == torch.float32 else 1e-10
    # 1. y = H x with the test's own hooks (conv biases and D skips zeroed)
    bare = without_untokened_parts(copy.deepcopy(model))
    with recorded_mixers(bare) as records, torch.no_grad():
        bare(x)
    maps = mc.implicit_attention(bare, x, reduce=None)
    for layer, record in enumerate(records):
        got = torch.einsum("bcij,bjc->bic", maps[layer].double(), record["x"].double())
        assert relative_error(got, record["y"]) <= tolerance and record["y"].abs().max() > 0
    # 2. reductions, 3. rows=, 4. batched = one by one
    formulation = data.draw(st.sampled_from(["unified", "hidden"]), label="formulation")
    full = mc.implicit_attention(model, x, formulation=formulation, reduce=None)
    rows = data.draw(st.lists(st.integers(-layout.length, layout.length - 1), min_size=1, max_size=4), label="rows")
    for reduce, reduction in (("mean", lambda t: t.mean(1)), ("abs_mean", lambda t: t.abs().mean(1))):
        reduced = mc.implicit_attention(model, x, formulation=formulation, reduce=reduce)
        some = mc.implicit_attention(model, x, formulation=formulation, reduce=reduce, rows=rows)
        for layer in full:
            assert relative_error(reduced[layer], reduction(full[layer])) <= tolerance
            assert relative_error(some[layer], reduced[layer][:, [r % layout.length for r in rows]]) <= tolerance
    alone = mc.implicit_attention(model, x[-1:], formulation=formulation, reduce=None)
    for layer in full:
        assert relative_error(full[layer][-1:], alone[layer]) <= tolerance


test_random_vims_satisfy_the_identities_with_more_examples = heavy_twin(test_random_vims_satisfy_the_identities)
