"""MambaOut (mamba_captum.vision.modeling_mambaout) and its adapter (mamba_captum.families.mambaout).

- timm's key names and shapes for mambaout_femto, listed here from timm's code (timm/models/mambaout.py), against the
  model's state dict; the *_rw options' keys;
- the forward against a float64 transcription of the math written below (taps looped by hand, no module called);
- load_mambaout: round trips (.pth, .safetensors, wrapped, the original repository's names), variant detection for
  every registered model, and the errors;
- the operator of each GatedConvBlock: y = H v against this file's own forward hooks (unified and hidden), the
  readout giving the block's output, a 3 × 3 grid written out by hand;
- the library's entry points on a tiny model: maps per block at its stage's L, rollout and attribution (B, 1, H, W),
  batched == single; a GatedConvBlock of another module (timm's, by attribute names) explained the same.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mamba_captum as mc
from mamba_captum.families.registry import load_adapter
from mamba_captum.vision.modeling_mambaout import (VARIANTS, MambaOut, detect_mambaout_config, load_mambaout,
                                                   mambaout_femto, variant_name)
import mamba_captum.vision.modeling_mambaout as modeling

ADAPTER = load_adapter("mambaout")  # checked against the adapter contract on load


# ---------------------------------------------------------------------------------------------------------------
# (a) timm's key names and shapes

def femto_keys_from_timm() -> dict[str, tuple[int, ...]]:
    """mambaout_femto (depths 3-3-9-3, dims 48-96-192-288, 1000 classes) as timm names its tensors: Stem (conv1 to
    dims[0] / 2, norm1, conv2, norm2), per stage > 0 a Downsample (conv, then norm of the new width), per block norm,
    fc1 (dim -> 2 · int(8/3 · dim)), a depthwise 7 × 7 conv over the dim conv channels, fc2, and MlpHead (norm,
    pre_logits.fc to 4 · 288, pre_logits.norm, fc)."""
    keys = {
        "stem.conv1.weight": (24, 3, 3, 3), "stem.conv1.bias": (24,),
        "stem.norm1.weight": (24,), "stem.norm1.bias": (24,),
        "stem.conv2.weight": (48, 24, 3, 3), "stem.conv2.bias": (48,),
        "stem.norm2.weight": (48,), "stem.norm2.bias": (48,),
    }
    downsample = {
        1: {"conv.weight": (96, 48, 3, 3), "conv.bias": (96,), "norm.weight": (96,), "norm.bias": (96,)},
        2: {"conv.weight": (192, 96, 3, 3), "conv.bias": (192,), "norm.weight": (192,), "norm.bias": (192,)},
        3: {"conv.weight": (288, 192, 3, 3), "conv.bias": (288,), "norm.weight": (288,), "norm.bias": (288,)},
    }
    block = {  # stage -> one block's tensors
        0: {"norm.weight": (48,), "norm.bias": (48,), "fc1.weight": (256, 48), "fc1.bias": (256,),
            "conv.weight": (48, 1, 7, 7), "conv.bias": (48,), "fc2.weight": (48, 128), "fc2.bias": (48,)},
        1: {"norm.weight": (96,), "norm.bias": (96,), "fc1.weight": (512, 96), "fc1.bias": (512,),
            "conv.weight": (96, 1, 7, 7), "conv.bias": (96,), "fc2.weight": (96, 256), "fc2.bias": (96,)},
        2: {"norm.weight": (192,), "norm.bias": (192,), "fc1.weight": (1024, 192), "fc1.bias": (1024,),
            "conv.weight": (192, 1, 7, 7), "conv.bias": (192,), "fc2.weight": (192, 512), "fc2.bias": (192,)},
        3: {"norm.weight": (288,), "norm.bias": (288,), "fc1.weight": (1536, 288), "fc1.bias": (1536,),
            "conv.weight": (288, 1, 7, 7), "conv.bias": (288,), "fc2.weight": (288, 768), "fc2.bias": (288,)},
    }
    for stage, depth in enumerate((3, 3, 9, 3)):
        for name, shape in downsample.get(stage, {}).items():
            keys[f"stages.{stage}.downsample.{name}"] = shape
        for j in range(depth):
            for name, shape in block[stage].items():
                keys[f"stages.{stage}.blocks.{j}.{name}"] = shape
    keys.update({
        "head.norm.weight": (288,), "head.norm.bias": (288,),
        "head.pre_logits.fc.weight": (1152, 288), "head.pre_logits.fc.bias": (1152,),
        "head.pre_logits.norm.weight": (1152,), "head.pre_logits.norm.bias": (1152,),
        "head.fc.weight": (1000, 1152), "head.fc.bias": (1000,),
    })
    return keys


def test_the_femto_state_dict_is_timms_key_for_key():
    with torch.device("meta"):
        model = mambaout_femto()
    own = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert own == femto_keys_from_timm()
    assert len(own) == 172
    # timm's parameter count for mambaout_femto: 7.3 M
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 7.3


def test_the_rw_options_name_their_tensors_as_timm():
    """``*_rw``: no stem.norm1, DownsampleNormFirst (norm of the old width, before the conv), ls.gamma per block,
    and ClNormMlpClassifierHead (no pre_logits.norm)."""
    with torch.device("meta"):
        model = modeling.mambaout_small_rw()
    own = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert "stem.norm1.weight" not in own and "head.pre_logits.norm.weight" not in own
    assert own["stages.1.downsample.norm.weight"] == (96,) and own["stages.1.downsample.conv.weight"] == (192, 96, 3, 3)
    assert own["stages.2.blocks.26.ls.gamma"] == (384,)
    assert own["head.pre_logits.fc.weight"] == (2304, 576) and own["head.fc.weight"] == (1000, 2304)
    assert list(own)[list(own).index("stages.1.downsample.norm.weight") + 2] == "stages.1.downsample.conv.weight"
    with torch.device("meta"):  # conv ratio 1.25: int(1.25 · 128) = 160 conv channels of int(3 · 128) = 384
        short = modeling.mambaout_base_short_rw()
    assert tuple(short.state_dict()["stages.0.blocks.0.conv.weight"].shape) == (160, 1, 7, 7)
    assert tuple(short.stages[0].blocks[0].split_indices) == (384, 224, 160)


# ---------------------------------------------------------------------------------------------------------------
# (b) the forward against a float64 transcription

def ref_conv2d(x, weight, bias, stride, padding, depthwise=False):
    """Cross-correlation over zero-padded (B, C, H, W), tap by tap: out[o, y, x] = Σ_c Σ_(a,b) w[o, c, a, b] ·
    xpad[c, y·s + a, x·s + b] + bias[o] (depthwise: c = o, w[o, 0, a, b])."""
    batch, channels, height, width = x.shape
    kernel = weight.shape[-1]
    padded = x.new_zeros(batch, channels, height + 2 * padding, width + 2 * padding)
    padded[:, :, padding:padding + height, padding:padding + width] = x
    out_h, out_w = (height + 2 * padding - kernel) // stride + 1, (width + 2 * padding - kernel) // stride + 1
    out = x.new_zeros(batch, weight.shape[0], out_h, out_w)
    for a in range(kernel):
        for b in range(kernel):
            window = padded[:, :, a:a + stride * (out_h - 1) + 1:stride, b:b + stride * (out_w - 1) + 1:stride]
            if depthwise:
                out += weight[:, 0, a, b][None, :, None, None] * window
            else:
                out += torch.einsum("oc,bcyx->boyx", weight[:, :, a, b], window)
    return out + bias[None, :, None, None]


def ref_layer_norm(x, weight, bias, eps=1e-6):
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + eps) * weight + bias


def ref_gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def ref_silu(x):
    return x / (1 + torch.exp(-x))


def ref_block(p, prefix, x, act, split):
    """x (B, H, W, C) -> x + gamma · (W2 (act(g) ⊙ cat(i, dwconv(c))) + b2)."""
    u = ref_layer_norm(x, p[prefix + "norm.weight"], p[prefix + "norm.bias"]) @ p[prefix + "fc1.weight"].T \
        + p[prefix + "fc1.bias"]
    hidden, plain, _ = split
    g, i, c = u[..., :hidden], u[..., hidden:hidden + plain], u[..., hidden + plain:]
    kernel = p[prefix + "conv.weight"].shape[-1]
    c = ref_conv2d(c.permute(0, 3, 1, 2), p[prefix + "conv.weight"], p[prefix + "conv.bias"], 1, kernel // 2,
                   depthwise=True).permute(0, 2, 3, 1)
    y = (act(g) * torch.cat([i, c], -1)) @ p[prefix + "fc2.weight"].T + p[prefix + "fc2.bias"]
    if prefix + "ls.gamma" in p:
        y = y * p[prefix + "ls.gamma"]
    return x + y


def ref_forward(p, pixels, depths, act, split_of, norm_first, rw_head):
    """The whole model from its state dict p, float64."""
    x = ref_conv2d(pixels, p["stem.conv1.weight"], p["stem.conv1.bias"], 2, 1)
    if "stem.norm1.weight" in p:
        x = ref_layer_norm(x.permute(0, 2, 3, 1), p["stem.norm1.weight"], p["stem.norm1.bias"]).permute(0, 3, 1, 2)
    x = ref_conv2d(act(x), p["stem.conv2.weight"], p["stem.conv2.bias"], 2, 1).permute(0, 2, 3, 1)
    x = ref_layer_norm(x, p["stem.norm2.weight"], p["stem.norm2.bias"])
    for stage, depth in enumerate(depths):
        d = f"stages.{stage}.downsample."
        if stage > 0 and norm_first:
            x = ref_layer_norm(x, p[d + "norm.weight"], p[d + "norm.bias"])
            x = ref_conv2d(x.permute(0, 3, 1, 2), p[d + "conv.weight"], p[d + "conv.bias"], 2, 1).permute(0, 2, 3, 1)
        elif stage > 0:
            x = ref_conv2d(x.permute(0, 3, 1, 2), p[d + "conv.weight"], p[d + "conv.bias"], 2, 1).permute(0, 2, 3, 1)
            x = ref_layer_norm(x, p[d + "norm.weight"], p[d + "norm.bias"])
        for j in range(depth):
            x = ref_block(p, f"stages.{stage}.blocks.{j}.", x, act, split_of(stage))
    pooled = ref_layer_norm(x.mean((1, 2)), p["head.norm.weight"], p["head.norm.bias"])
    hidden = ref_gelu(pooled @ p["head.pre_logits.fc.weight"].T + p["head.pre_logits.fc.bias"])
    if not rw_head:
        hidden = ref_layer_norm(hidden, p["head.pre_logits.norm.weight"], p["head.pre_logits.norm.bias"])
    return hidden @ p["head.fc.weight"].T + p["head.fc.bias"]


def randomised(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn at random (norm scales around 1, nonzero biases and conv biases)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            centre = 1.0 if ("norm" in name and name.endswith("weight")) else 0.0
            parameter.copy_(centre + 0.3 * noise)
    return model


SMALL = dict(depths=(2, 1, 2), dims=(6, 10, 14), kernel_size=7, img_size=(36, 28), num_classes=5)
SMALL_RW = dict(depths=(1, 2), dims=(8, 12), kernel_size=5, img_size=(24, 20), num_classes=3, stem_mid_norm=False,
                downsample="conv_nf", ls_init_value=0.5, head_fn="norm_mlp", act_layer="silu", conv_ratio=0.5,
                expansion_ratio=3.0)


@pytest.mark.parametrize("options", [SMALL, SMALL_RW], ids=["released", "rw"])
def test_the_forward_is_the_math_in_float64(options):
    model = randomised(MambaOut(**options).double().eval(), seed=1)
    pixels = torch.randn(2, 3, *options["img_size"], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expansion, ratio = options.get("expansion_ratio", 8 / 3), options.get("conv_ratio", 1.0)

    def split_of(stage):
        dim = options["dims"][stage]
        hidden, conv = int(expansion * dim), int(ratio * dim)
        return hidden, hidden - conv, conv

    act = ref_silu if options.get("act_layer") == "silu" else ref_gelu
    expected = ref_forward(dict(model.state_dict()), pixels, options["depths"], act, split_of,
                           options.get("downsample") == "conv_nf", options.get("head_fn") == "norm_mlp")
    with torch.no_grad():
        logits = model(pixels)
    assert logits.shape == (2, options["num_classes"])
    assert (logits - expected).abs().max().item() <= 1e-10
    # the layout: the stem's two stride-2 convs, then one per stage (⌈n / 2⌉ each)
    layout = model.token_layout()
    grids = [stage.grid for stage in layout.stages]
    with torch.no_grad():
        x = model.stem(pixels)
        seen = []
        for stage in model.stages:
            x = stage(x)
            seen.append(tuple(x.shape[1:3]))
    assert grids == seen
    assert [stage.downsample for stage in layout.stages] == [None] + [(3, 2, 1)] * (len(grids) - 1)
    assert [stage.blocks for stage in layout.stages] == list(options["depths"])
    blocks = model.stage_blocks()
    assert len(blocks) == sum(options["depths"]) and blocks[-1] is model.stages[-1].blocks[-1]
    assert set(model.state_dict()) == set(dict(model.named_parameters()))  # stage_blocks() registers nothing


# ---------------------------------------------------------------------------------------------------------------
# (c) load_mambaout

def tiny_state(seed=3, **options):
    return dict(randomised(MambaOut(**{**SMALL, **options}), seed).state_dict())


def to_original_names(state: dict) -> dict:
    """timm's names back to the original repository's (downsample_layers.0 = the stem, downsample_layers.i, the
    blocks as stages.i.j, norm, head.fc1 / head.norm / head.fc2)."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if key.startswith("stem."):
            key = "downsample_layers.0." + key[len("stem."):]
        elif key.startswith("stages.") and parts[2] == "downsample":
            key = f"downsample_layers.{parts[1]}." + ".".join(parts[3:])
        elif key.startswith("stages.") and parts[2] == "blocks":
            key = f"stages.{parts[1]}.{parts[3]}." + ".".join(parts[4:])
        elif key.startswith("head.norm."):
            key = "norm." + key[len("head.norm."):]
        else:
            key = (key.replace("head.pre_logits.fc.", "head.fc1.").replace("head.pre_logits.norm.", "head.norm.")
                   .replace("head.fc.", "head.fc2."))
        out[key] = value
    return out


def test_load_round_trips(tmp_path):
    from safetensors.torch import save_file

    state = tiny_state()
    pixels = torch.randn(1, 3, 36, 28, generator=torch.Generator().manual_seed(4))
    reference = MambaOut(**SMALL).eval()
    reference.load_state_dict(state)
    with torch.no_grad():
        expected = reference(pixels)
    torch.save({"model": state}, tmp_path / "wrapped.pth")
    torch.save(state, tmp_path / "plain.pth")
    save_file(state, str(tmp_path / "model.safetensors"))
    sources = [state, {"state_dict": state}, tmp_path / "wrapped.pth", str(tmp_path / "plain.pth"),
               tmp_path / "model.safetensors", to_original_names(state),
               {f"module.{key}": value for key, value in state.items()}]
    for source in sources:
        model = load_mambaout(source, img_size=(36, 28))
        assert not model.training and model.variant is None and model.img_size == (36, 28)
        with torch.no_grad():
            assert torch.equal(model(pixels), expected)
    original = to_original_names(state)
    assert len(original) == len(state) and "downsample_layers.0.conv1.weight" in original
    half = load_mambaout(state, img_size=(36, 28), dtype=torch.float64)
    assert half.stem.conv1.weight.dtype == torch.float64


def test_every_registered_model_is_detected():
    for name in VARIANTS:
        with torch.device("meta"):
            model = getattr(modeling, name)()
        config = detect_mambaout_config(model.state_dict())
        assert variant_name(config) == name, name
        with torch.device("meta"):
            again = MambaOut(**{**config, "act_layer": VARIANTS[name].get("act_layer", "gelu")})
        # the detected ratios rebuild every stage's widths (Base: int(8/3 · 512) = 1365, not 2 · 682)
        assert {k: tuple(v.shape) for k, v in again.state_dict().items()} == \
            {k: tuple(v.shape) for k, v in model.state_dict().items()}, name
        assert [tuple(b.split_indices) for b in again.stage_blocks()] == \
            [tuple(b.split_indices) for b in model.stage_blocks()]
    # the activation of the SiLU models comes with their name (the weights do not tell it)
    with torch.device("meta"):
        wide = modeling.mambaout_base_wide_rw()
    assert isinstance(wide.stages[0].blocks[0].act, nn.SiLU)
    assert isinstance(mambaout_femto(num_classes=2, depths=(1,), dims=(8,)).stem.act, nn.GELU)


def test_a_released_shape_is_named_and_loads():
    model = mambaout_femto(num_classes=4)
    loaded = load_mambaout(model.state_dict())
    assert loaded.variant == "mambaout_femto" and loaded.num_classes == 4 and loaded.crop_pct == 1.0
    assert loaded.token_layout().stages[0].grid == (56, 56) and loaded.token_layout().stages[-1].grid == (7, 7)


def test_load_errors_name_the_problem(tmp_path):
    state = tiny_state()
    missing = {k: v for k, v in state.items() if k != "stages.0.blocks.1.conv.bias"}
    with pytest.raises(ValueError, match=r"missing keys \(1\): stages\.0\.blocks\.1\.conv\.bias"):
        load_mambaout(missing)
    shaped = dict(state)
    shaped["stages.2.blocks.1.ls.gamma"] = torch.ones(14)  # no LayerScale in this model: an unexpected key
    shaped["head.fc.bias"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): stages\.2\.blocks\.1\.ls\.gamma.*"
                                         r"shapes that differ \(1\): head\.fc\.bias \(7,\) \(model: \(5,\)\)"):
        load_mambaout(shaped)
    integer = dict(state)
    integer["stem.conv1.bias"] = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"not floating point: stem\.conv1\.bias \(int64\)"):
        load_mambaout(integer)
    with pytest.raises(ValueError, match="not a MambaOut checkpoint"):
        load_mambaout({"layers.0.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="holds no state dict"):
        load_mambaout({"model": {"a": 1}})
    with pytest.raises(ValueError, match="floating-point dtype"):
        load_mambaout(state, dtype=torch.int32)
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        load_mambaout(tmp_path / "absent.pth")
    torch.save({"model": state, "args": SimpleNamespace(lr=1)}, tmp_path / "pickled.pth")
    with pytest.raises(ValueError, match="weights-only PyTorch checkpoint.*weights_only=False"):
        load_mambaout(tmp_path / "pickled.pth")
    (tmp_path / "broken.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_mambaout(tmp_path / "broken.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# (d) the operator of GatedConvBlock

TINY = dict(depths=(2, 1), dims=(6, 10), kernel_size=5, conv_ratio=0.5, ls_init_value=0.3, img_size=(20, 12),
            num_classes=4)


def tiny_model(seed=5, **options):
    return randomised(MambaOut(**{**TINY, **options}).double().eval(), seed)


def recorded_blocks(model, pixels):
    """Per block: its input x, its output, and fc1's output u (this file's own forward hooks)."""
    records, handles = [], []
    for block in model.stage_blocks():
        record = {}
        handles.append(block.register_forward_hook(
            lambda m, args, out, record=record: record.update(x=args[0].detach(), out=out.detach())))
        handles.append(block.fc1.register_forward_hook(
            lambda m, args, out, record=record: record.update(u=out.detach())))
        records.append((block, record))
    try:
        with torch.no_grad():
            model(pixels)
    finally:
        for handle in handles:
            handle.remove()
    return records


def call_of(block, hidden):
    return SimpleNamespace(located=SimpleNamespace(module=block), hidden_states=hidden, attention_mask=None,
                           options={})


@pytest.mark.parametrize("formulation", ["unified", "hidden"])
def test_y_equals_H_x_per_block(formulation):
    model = tiny_model()
    pixels = torch.randn(2, 3, 20, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    layout = model.token_layout()
    for number, (block, record) in enumerate(recorded_blocks(model, pixels)):
        x, out, u = record["x"], record["out"], record["u"]
        batch, rows, cols, _ = x.shape
        assert rows * cols == layout.stages[layout.stage_of_block(number)].length
        hidden, plain, conv = block.split_indices
        gate = ref_gelu(u[..., :hidden]).reshape(batch, rows * cols, -1)
        v = u[..., hidden:].reshape(batch, rows * cols, -1)  # cat(i, c), the conv's input on c
        operator, rebuilt = ADAPTER.rebuild(call_of(block, x), formulation, frozenset(mc.families.COMPONENTS),
                                            torch.float64)
        assert (rebuilt - out).abs().max().item() <= 1e-12
        H = operator.maps(reduce=None)  # (B, n, L, L)
        assert H.shape == (batch, plain + conv, rows * cols, rows * cols)
        y = torch.einsum("bdij,bjd->bid", H, v)
        assert (y - operator.output[..., 0]).abs().max().item() <= 1e-12
        assert (operator.readout(y[..., None]) - out).abs().max().item() <= 1e-5
        # this file's own readout: the conv bias (on c only) after H, then fc2, LayerScale and the shortcut
        bias = torch.cat([torch.zeros(plain, dtype=torch.float64), block.conv.bias.detach()])
        mixed = gate * (y + bias) if formulation == "hidden" else y + gate * bias
        branch = (mixed @ block.fc2.weight.detach().T + block.fc2.bias.detach()) * block.ls.gamma.detach()
        assert (x + branch.reshape(x.shape) - out).abs().max().item() <= 1e-5
        # the identity channels read their own token only, with the gate (unified) as the weight
        eye = torch.eye(rows * cols, dtype=torch.float64)
        expected_plain = eye if formulation == "hidden" else gate[:, :, :plain].permute(0, 2, 1)[..., None] * eye
        assert torch.allclose(H[:, :plain], expected_plain.expand(batch, plain, -1, -1), rtol=0, atol=1e-14)


def test_a_3x3_grid_by_hand():
    """dim 1: int(8/3) = 2 hidden channels, one identity (i) and one conv channel (c); kernel 3 with taps 1..9
    row-major. Token t = 3r + s; row t of the band reads (r + a − 1, s + b − 1) with w[a, b]."""
    block = modeling.GatedConvBlock(1, kernel_size=3).double().eval()
    assert tuple(block.split_indices) == (2, 1, 1)
    with torch.no_grad():
        block.conv.weight.copy_(torch.arange(1.0, 10.0, dtype=torch.float64).reshape(1, 1, 3, 3))
        block.conv.bias.fill_(0.25)
    band = torch.tensor([
        [5, 6, 0, 8, 9, 0, 0, 0, 0],
        [4, 5, 6, 7, 8, 9, 0, 0, 0],
        [0, 4, 5, 0, 7, 8, 0, 0, 0],
        [2, 3, 0, 5, 6, 0, 8, 9, 0],
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [0, 1, 2, 0, 4, 5, 0, 7, 8],
        [0, 0, 0, 2, 3, 0, 5, 6, 0],
        [0, 0, 0, 1, 2, 3, 4, 5, 6],
        [0, 0, 0, 0, 1, 2, 0, 4, 5]], dtype=torch.float64)
    x = torch.randn(1, 3, 3, 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out = block(x)
    u = block.fc1(block.norm(x)).detach()
    gate = ref_gelu(u[..., :2]).reshape(9, 2)
    hidden, _ = ADAPTER.rebuild(call_of(block, x), "hidden", frozenset(mc.families.COMPONENTS), torch.float64)
    maps = hidden.maps(reduce=None)[0]
    assert torch.equal(maps[0], torch.eye(9, dtype=torch.float64)) and torch.equal(maps[1], band)
    unified, rebuilt = ADAPTER.rebuild(call_of(block, x), "unified", frozenset(mc.families.COMPONENTS),
                                       torch.float64)
    maps = unified.maps(reduce=None)[0]
    assert torch.allclose(maps[0], torch.diag(gate[:, 0]), rtol=0, atol=1e-15)
    assert torch.allclose(maps[1], gate[:, 1:2] * band, rtol=0, atol=1e-14)
    assert (rebuilt - out).abs().max().item() <= 1e-14
    # components: the gate off leaves the band; the conv off leaves diag(gate)
    no_gate, _ = ADAPTER.rebuild(call_of(block, x), "unified", frozenset({"conv"}), torch.float64)
    assert torch.equal(no_gate.maps(reduce=None)[0, 1], band)
    no_conv, _ = ADAPTER.rebuild(call_of(block, x), "unified", frozenset({"gate"}), torch.float64)
    assert torch.allclose(no_conv.maps(reduce=None)[0, 1], torch.diag(gate[:, 1]), rtol=0, atol=1e-15)


def test_the_block_refuses_what_the_band_cannot_describe():
    block = modeling.GatedConvBlock(4, kernel_size=3).eval()
    x = torch.randn(1, 3, 3, 4)
    block.conv.padding = (0, 0)
    with pytest.raises(TypeError, match="not a depthwise, stride-1, 'same' zero-padded conv"):
        ADAPTER.rebuild(call_of(block, x), "unified", frozenset(mc.families.COMPONENTS), torch.float64)
    with pytest.raises(TypeError, match=r"channel-last tokens \(B, H, W, C\)"):
        ADAPTER.rebuild(call_of(block, x.reshape(1, 9, 4)), "unified", frozenset(), torch.float64)
    other = nn.Module()
    with pytest.raises(TypeError, match="not timm's MambaOut block"):
        ADAPTER.rebuild(call_of(other, x), "unified", frozenset(), torch.float64)
    dropping = modeling.GatedConvBlock(4, kernel_size=3).train()
    dropping.drop_path.drop_prob = 0.1  # timm's DropPath(0.1)
    with pytest.raises(ValueError, match="drops its branch at random"):
        ADAPTER.rebuild(call_of(dropping, x), "unified", frozenset(), torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# (e) the library's entry points


def test_maps_per_block_at_each_stage():
    model = tiny_model()
    pixels = torch.randn(2, 3, 20, 12, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    layout = model.token_layout()
    records = recorded_blocks(model, pixels)
    for formulation in ("unified", "hidden"):
        maps = mc.implicit_attention(model, pixels, formulation=formulation)
        assert sorted(maps) == list(range(layout.num_blocks))
        for number, (block, record) in enumerate(records):
            length = layout.stages[layout.stage_of_block(number)].length
            assert maps[number].shape == (2, length, length)
            operator, _ = ADAPTER.rebuild(call_of(block, record["x"]), formulation,
                                          frozenset(mc.families.COMPONENTS), torch.float64)
            assert torch.allclose(maps[number], operator.maps(reduce=None).mean(1), rtol=0, atol=1e-12)


def test_rollout_and_attribution_give_pixels_batched_as_single():
    model = tiny_model()
    pixels = torch.randn(2, 3, 20, 12, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for method in (mc.MambaRollout, mc.MambaAttribution):
        batched = method(model).attribute(pixels, target=1)
        assert batched.shape == (2, 1, 20, 12) and bool(torch.isfinite(batched).all())
        assert batched.abs().sum() > 0
        for index in range(2):
            single = method(model).attribute(pixels[index:index + 1], target=1)
            assert torch.allclose(single, batched[index:index + 1], rtol=0, atol=1e-10), method.__name__


class LayerScaleInPlace(nn.Module):
    """timm's LayerScale with ``inplace=True`` (x.mul_(gamma))."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x.mul_(self.gamma)


class GatedConvBlock(nn.Module):
    """Another module's GatedConvBlock with timm's attribute names, built from torch's own layers (the adapter
    reads attributes, not this library's classes)."""

    def __init__(self, source: modeling.GatedConvBlock):
        super().__init__()
        dim = source.fc2.out_features
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, source.fc1.out_features)
        self.act = nn.GELU()
        self.split_indices = tuple(source.split_indices)
        channels = source.conv.in_channels
        kernel = source.conv.kernel_size[0]
        self.conv = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels)
        self.fc2 = nn.Linear(source.fc2.in_features, dim)
        self.ls = LayerScaleInPlace(dim)
        self.drop_path = nn.Identity()
        self.to(source.fc1.weight.dtype)
        self.load_state_dict(source.state_dict())

    def forward(self, x):
        g, i, c = torch.split(self.fc1(self.norm(x)), self.split_indices, dim=-1)
        c = self.conv(c.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return x + self.drop_path(self.ls(self.fc2(self.act(g) * torch.cat((i, c), dim=-1))))


def test_a_gated_conv_block_of_another_module_is_explained_alike():
    model = tiny_model()
    pixels = torch.randn(1, 3, 20, 12, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    expected = mc.implicit_attention(model, pixels)
    with torch.no_grad():
        logits = model(pixels)
    model.stages[0].blocks[1] = GatedConvBlock(model.stages[0].blocks[1]).eval()
    with torch.no_grad():
        assert torch.allclose(model(pixels), logits, rtol=0, atol=1e-12)
    maps = mc.implicit_attention(model, pixels)
    assert sorted(maps) == sorted(expected)
    for key in expected:
        assert torch.allclose(maps[key], expected[key], rtol=0, atol=1e-12), key
