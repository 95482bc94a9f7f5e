"""VMamba (mamba_captum.vision.modeling_vmamba, checkpoints_vmamba): the official keys and shapes, the forward against
a token-by-token float64 transcription of the official math, the checkpoint loader and its errors, batching."""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from mamba_captum.vision import load_vmamba, vmamba_small, vmamba_tiny
from mamba_captum.vision.checkpoints_vmamba import VARIANTS, detect_config

# The official VMamba-T (vssm1_tiny_0230s: dims 96·2^i, depths 2-2-8-2, ssm_ratio 1, d_state 1, dt_rank ceil(d/16),
# v05_noz, v2 stem, v3 downsampling), as classification/models/vmamba.py names and shapes its parameters.
OFFICIAL_TINY = {
    "patch_embed.0.weight": (48, 3, 3, 3), "patch_embed.0.bias": (48,),
    "patch_embed.2.weight": (48,), "patch_embed.2.bias": (48,),
    "patch_embed.5.weight": (96, 48, 3, 3), "patch_embed.5.bias": (96,),
    "patch_embed.7.weight": (96,), "patch_embed.7.bias": (96,),
    # one block's SS2D, complete
    "layers.0.blocks.0.op.in_proj.weight": (96, 96),
    "layers.0.blocks.0.op.conv2d.weight": (96, 1, 3, 3),
    "layers.0.blocks.0.op.x_proj_weight": (4, 6 + 2 * 1, 96),
    "layers.0.blocks.0.op.dt_projs_weight": (4, 96, 6),
    "layers.0.blocks.0.op.dt_projs_bias": (4, 96),
    "layers.0.blocks.0.op.A_logs": (4 * 96, 1),
    "layers.0.blocks.0.op.Ds": (4 * 96,),
    "layers.0.blocks.0.op.out_norm.weight": (96,), "layers.0.blocks.0.op.out_norm.bias": (96,),
    "layers.0.blocks.0.op.out_proj.weight": (96, 96),
    "layers.0.blocks.0.norm.weight": (96,), "layers.0.blocks.0.norm2.bias": (96,),
    "layers.0.blocks.0.mlp.fc1.weight": (384, 96), "layers.0.blocks.0.mlp.fc2.weight": (96, 384),
    "layers.0.blocks.0.mlp.fc2.bias": (96,),
    "layers.0.downsample.1.weight": (192, 96, 3, 3), "layers.0.downsample.1.bias": (192,),
    "layers.0.downsample.3.weight": (192,), "layers.2.downsample.1.weight": (768, 384, 3, 3),
    "layers.2.blocks.7.op.x_proj_weight": (4, 24 + 2, 384),
    "layers.3.blocks.1.op.dt_projs_weight": (4, 768, 48),
    "layers.3.blocks.1.op.A_logs": (3072, 1),
    "classifier.norm.weight": (768,), "classifier.head.weight": (1000, 768), "classifier.head.bias": (1000,),
}
# stem 8 + 14 blocks × (norm 2 + SS2D 10 + norm2 2 + mlp 4) + 3 downsamplers × 4 + classifier 4
OFFICIAL_TINY_KEYS = 8 + 14 * 18 + 3 * 4 + 4
ABSENT = ("layers.0.blocks.0.op.conv2d.bias", "layers.3.downsample.1.weight", "pos_embed")

SMALL = dict(dims=16, depths=(1, 1, 2, 1), img_size=32, num_classes=7, ssm_d_state=2)
GATED = dict(dims=16, depths=(1, 1, 2, 1), img_size=32, num_classes=7, ssm_d_state=3, ssm_ratio=2.0,
             forward_type="v0", mlp_ratio=0.0, norm_layer="ln", downsample_version="v1", patchembed_version="v1",
             ssm_conv_bias=True)


def test_the_state_dict_has_the_official_keys_and_shapes():
    state = vmamba_tiny().state_dict()
    assert {key: tuple(state[key].shape) for key in OFFICIAL_TINY} == OFFICIAL_TINY
    assert len(state) == OFFICIAL_TINY_KEYS
    assert not any(key in state for key in ABSENT)


def test_the_released_sizes_are_detected_from_the_weights():
    assert sum(p.numel() for p in vmamba_tiny().parameters()) == pytest.approx(30.2e6, rel=0.01)  # README: 30M
    small = vmamba_small().state_dict()
    config = detect_config(small)
    assert (config["depths"], config["dims"], config["ssm_ratio"], config["forward_type"]) == \
        ((2, 2, 15, 2), [96, 192, 384, 768], 2, "v05_noz")
    assert VARIANTS["vssm_small_0229"]["depths"] == config["depths"]


def _randomized(model, seed=1):
    """Every parameter moved off its initial value (unit norms, zero biases, ones D would hide mistakes)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def small_model(config=SMALL, seed=0):
    torch.manual_seed(seed)
    return _randomized(vmamba_tiny(**config).double().eval(), seed + 1)


# ---------------------------------------------------------------------------------------------------------------
# The official forward, transcribed from classification/models/vmamba.py for float64 tensors, token by token in the
# scans. Channel-first throughout (the channel-last variants compute the same function).


def _ln(x, state, key, eps=1e-5):  # LayerNorm over the channels of (B, C, H, W)
    x = x.permute(0, 2, 3, 1)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return ((x - mean) / torch.sqrt(var + eps) * state[key + ".weight"] + state[key + ".bias"]).permute(0, 3, 1, 2)


def _pointwise(x, weight, bias=None):  # a linear map over the channels of (B, C, H, W)
    out = torch.einsum("oc,bchw->bohw", weight, x)
    return out if bias is None else out + bias[None, :, None, None]


def _ss2d_reference(h, state, p, gated):
    x = _pointwise(h, state[p + "in_proj.weight"])
    if gated:
        x, z = x.chunk(2, dim=1)
    x = F.conv2d(x, state[p + "conv2d.weight"], state.get(p + "conv2d.bias"), padding=1, groups=x.shape[1])
    u = x * torch.sigmoid(x)
    batch, d_inner, rows, cols = u.shape
    x_proj, dt_w, dt_b = state[p + "x_proj_weight"], state[p + "dt_projs_weight"], state[p + "dt_projs_bias"]
    rank = dt_w.shape[-1]
    n_state = (x_proj.shape[1] - rank) // 2
    A = -torch.exp(state[p + "A_logs"]).view(4, d_inner, n_state)
    Ds = state[p + "Ds"].view(4, d_inner)
    # the four orders: (row, col) of the t-th token of scan k
    row_major = [(r, c) for r in range(rows) for c in range(cols)]
    col_major = [(r, c) for c in range(cols) for r in range(rows)]
    orders = [row_major, col_major, row_major[::-1], col_major[::-1]]
    y = torch.zeros_like(u)
    for k, order in enumerate(orders):
        state_h = torch.zeros(batch, d_inner, n_state, dtype=u.dtype)
        for r, c in order:
            ut = u[:, :, r, c]  # (B, D)
            proj = ut @ x_proj[k].t()  # (B, R + 2N)
            dt, Bt, Ct = proj[:, :rank], proj[:, rank:rank + n_state], proj[:, rank + n_state:]
            delta = F.softplus(dt @ dt_w[k].t() + dt_b[k])  # (B, D)
            decay = torch.exp(delta[:, :, None] * A[k])
            state_h = decay * state_h + delta[:, :, None] * Bt[:, None, :] * ut[:, :, None]
            y[:, :, r, c] += (state_h * Ct[:, None, :]).sum(-1) + Ds[k] * ut
    y = _ln(y, state, p + "out_norm")
    if gated:
        y = y * (z * torch.sigmoid(z))
    return _pointwise(y, state[p + "out_proj.weight"])


def reference_forward(pixels, state, config):
    gated = config.get("forward_type", "v05_noz") == "v0"
    if config.get("patchembed_version", "v2") == "v2":
        x = F.conv2d(pixels, state["patch_embed.0.weight"], state["patch_embed.0.bias"], stride=2, padding=1)
        x = F.gelu(_ln(x, state, "patch_embed.2"))
        x = F.conv2d(x, state["patch_embed.5.weight"], state["patch_embed.5.bias"], stride=2, padding=1)
    else:
        x = F.conv2d(pixels, state["patch_embed.0.weight"], state["patch_embed.0.bias"], stride=4)
    x = _ln(x, state, "patch_embed.7" if "patch_embed.7.weight" in state else "patch_embed.2")
    depths = config["depths"]
    for i, depth in enumerate(depths):
        for j in range(depth):
            b = f"layers.{i}.blocks.{j}."
            x = x + _ss2d_reference(_ln(x, state, b + "norm"), state, b + "op.", gated)
            if b + "mlp.fc1.weight" in state:
                hidden = _pointwise(_ln(x, state, b + "norm2"), state[b + "mlp.fc1.weight"], state[b + "mlp.fc1.bias"])
                x = x + _pointwise(F.gelu(hidden), state[b + "mlp.fc2.weight"], state[b + "mlp.fc2.bias"])
        d = f"layers.{i}.downsample."
        if d + "1.weight" in state:  # v3: 3×3 stride-2 conv, padding 1, then the norm
            x = _ln(F.conv2d(x, state[d + "1.weight"], state[d + "1.bias"], stride=2, padding=1), state, d + "3")
        elif d + "reduction.weight" in state:  # PatchMerging2D
            x = torch.cat([x[..., 0::2, 0::2], x[..., 1::2, 0::2], x[..., 0::2, 1::2], x[..., 1::2, 1::2]], dim=1)
            x = _pointwise(_ln(x, state, d + "norm"), state[d + "reduction.weight"])
    pooled = _ln(x, state, "classifier.norm").mean((2, 3))
    return pooled @ state["classifier.head.weight"].t() + state["classifier.head.bias"]


@pytest.mark.parametrize("config", [SMALL, GATED], ids=["v05_noz", "v0_gated"])
def test_the_forward_is_the_official_math_token_by_token(config):
    model = small_model(config)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        logits = model(pixels)
    expected = reference_forward(pixels, {k: v.detach() for k, v in model.state_dict().items()}, config)
    assert logits.shape == (2, 7)
    assert (logits - expected).abs().max().item() <= 1e-10


def test_batched_is_single():
    model = small_model()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        batched = model(pixels)
        single = torch.cat([model(pixels[i:i + 1]) for i in range(3)])
    assert (batched - single).abs().max().item() <= 1e-12


def test_the_stages_and_blocks_follow_the_contract():
    model = vmamba_tiny()
    layout = model.token_layout()
    assert [stage.grid for stage in layout.stages] == [(56, 56), (28, 28), (14, 14), (7, 7)]
    assert [stage.blocks for stage in layout.stages] == [2, 2, 8, 2]
    assert [stage.downsample for stage in layout.stages] == [None, (3, 2, 1), (3, 2, 1), (3, 2, 1)]
    blocks = model.stage_blocks()
    assert len(blocks) == 14 and blocks[2] is model.layers[1].blocks[0]
    assert len(model.state_dict()) == OFFICIAL_TINY_KEYS  # the list is not registered on the model
    # the real grids, as the forward makes them
    seen = []
    small = vmamba_tiny(dims=8, depths=(1, 1, 1, 1), img_size=(64, 48))
    blocks = small.stage_blocks()
    hooks = [block.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape[-2:]))) for block in blocks]
    with torch.no_grad():
        small(torch.randn(1, 3, 64, 48))
    assert seen == [stage.grid for stage in small.token_layout().stages] == [(16, 12), (8, 6), (4, 3), (2, 2)]
    for hook in hooks:
        hook.remove()
    with pytest.raises(ValueError, match="64×48"):
        small(torch.randn(1, 3, 32, 32))


# ---------------------------------------------------------------------------------------------------------------
# the checkpoint loader


@pytest.fixture()
def fake_yacs(monkeypatch):
    """A ``yacs.config.CfgNode`` class to pickle into a file as the official training code does (its config)."""
    module = types.ModuleType("yacs.config")

    class CfgNode(dict):
        pass

    CfgNode.__module__, CfgNode.__qualname__ = "yacs.config", "CfgNode"
    module.CfgNode = CfgNode
    monkeypatch.setitem(sys.modules, "yacs", types.ModuleType("yacs"))
    monkeypatch.setitem(sys.modules, "yacs.config", module)
    return CfgNode


def test_load_vmamba_round_trips_an_official_file(tmp_path, fake_yacs):
    model = small_model().float()
    config = fake_yacs(MODEL=fake_yacs(TYPE="vssm"))
    config.frozen = True
    ema = {k: v + 1 for k, v in model.state_dict().items()}
    path = tmp_path / "ckpt_epoch_1.pth"
    torch.save({"model": model.state_dict(), "model_ema": ema, "config": config, "epoch": 1}, path)
    loaded = load_vmamba(path, img_size=32)
    assert not loaded.training and loaded.variant is None
    assert (loaded.depths, loaded.dims, loaded.layers[0].blocks[0].op.d_state) == ([1, 1, 2, 1], [16, 32, 64, 128], 2)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(pixels), model(pixels))
    with_ema = load_vmamba(path, img_size=32, weights="model_ema")
    assert torch.equal(with_ema.classifier.head.bias, ema["classifier.head.bias"])


def test_load_vmamba_takes_a_state_dict_and_the_older_key_names():
    model = small_model(GATED).float()
    state = model.state_dict()
    renamed = {("norm." + k[len("classifier.norm."):] if k.startswith("classifier.norm.") else
                k.replace(".blocks.0.op.", ".blocks.0.self_attention.")): v for k, v in state.items()}
    renamed = {"module." + k: v for k, v in renamed.items()}
    loaded = load_vmamba(renamed, img_size=32)
    assert loaded.layers[0].blocks[0].op.gated and loaded.downsample_version == "v1"
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(pixels), model(pixels))


def test_the_released_tiny_is_named():
    assert load_vmamba(vmamba_tiny().state_dict()).variant == "vssm1_tiny_0230s"


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("layers.1.blocks.0.op.Ds"), r"missing keys \(1\): layers\.1\.blocks\.0\.op\.Ds"),
    (lambda s: s.update({"layers.1.blocks.0.op.Ds": torch.zeros(5)}),
     r"shapes that differ \(1\): layers\.1\.blocks\.0\.op\.Ds \(5,\) \(model: \(128,\)\)"),
    (lambda s: s.update({"extra.weight": torch.zeros(2)}), r"unexpected keys \(1\): extra\.weight"),
    (lambda s: s.update({"layers.1.blocks.0.op.Ds": torch.zeros(128, dtype=torch.int64)}),
     r"layers\.1\.blocks\.0\.op\.Ds \(int64\)"),
])
def test_load_vmamba_names_what_does_not_fit(tmp_path, change, message):
    state = dict(small_model().float().state_dict())
    change(state)
    path = tmp_path / "bad.pth"
    torch.save({"model": state}, path)
    with pytest.raises(ValueError, match=message):
        load_vmamba(path, img_size=32)


def test_load_vmamba_refuses_a_file_that_runs_code(tmp_path):
    path = tmp_path / "code.pth"
    torch.save({"model": small_model().float().state_dict(), "hook": math.floor}, path)
    with pytest.raises(ValueError, match="weights-only"):
        load_vmamba(path)
    with pytest.raises(ValueError, match="no VMamba state dict"):
        load_vmamba({"model": {"a": 1}})


def test_training_json_beside_the_file_gives_size_and_names(tmp_path):
    import json

    model = small_model().float()
    torch.save({"model": model.state_dict()}, tmp_path / "model.pth")
    names = [f"class {i}" for i in range(7)]
    (tmp_path / "training.json").write_text(json.dumps({"config": {"img_size": 32}, "class_names": names,
                                                        "crop_pct": 1.0}))
    loaded = load_vmamba(tmp_path / "model.pth")
    assert (loaded.img_size, loaded.class_names, loaded.crop_pct) == ((32, 32), names, 1.0)
    (tmp_path / "training.json").write_text(json.dumps({"img_size": 32, "class_names": names[:3]}))
    with pytest.raises(ValueError, match="3 class_names for a model of 7 classes"):
        load_vmamba(tmp_path / "model.pth")
