"""EfficientViM (timm's efficientvim_m*): the state dict against timm's key names and shapes, the forward against a
float64 transcription of the math, the loader, the adapters' operators (y = H x for HSMSSD and the depthwise convs,
both formulations), and the library's methods on a tiny model (maps per block, pixel attributions, batched == single).
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import mamba_captum as mc
from mamba_captum.families import efficientvim as adapter
from mamba_captum.vision import EfficientViM, efficientvim_m1, efficientvim_m4, load_efficientvim
from mamba_captum.vision.modeling_efficientvim import ConvLayer2d

TINY = dict(num_classes=5, embed_dim=(16, 24, 32), depths=(1, 2, 1), state_dim=(4, 3, 2), img_size=64)


# --- timm's keys, written out from timm/models/efficientvim.py (timm 1.0.31) -------------------------------------

def _bn(prefix, channels):
    return {f"{prefix}.weight": (channels,), f"{prefix}.bias": (channels,), f"{prefix}.running_mean": (channels,),
            f"{prefix}.running_var": (channels,), f"{prefix}.num_batches_tracked": ()}


def _timm_block(p, dim, states):
    """EfficientViMBlock(dim, mlp_ratio=4, ssd_expand=1, state_dim=states)."""
    return {
        f"{p}.mixer.BCdt_proj.conv.weight": (3 * states, dim, 1),       # ConvLayer1d(dim, 3N, 1), no norm
        f"{p}.mixer.dw.conv.weight": (3 * states, 1, 3, 3),             # ConvLayer2d(3N, 3N, 3, groups=3N), no norm
        f"{p}.mixer.hz_proj.conv.weight": (2 * dim, dim, 1),
        f"{p}.mixer.out_proj.conv.weight": (dim, dim, 1),
        f"{p}.mixer.A": (states,), f"{p}.mixer.D": (1,),
        f"{p}.norm.weight": (dim,), f"{p}.norm.bias": (dim,),           # LayerNorm2d
        f"{p}.dwconv1.conv.weight": (dim, 1, 3, 3), **_bn(f"{p}.dwconv1.norm", dim),
        f"{p}.dwconv2.conv.weight": (dim, 1, 3, 3), **_bn(f"{p}.dwconv2.norm", dim),
        f"{p}.ffn.fc1.conv.weight": (4 * dim, dim, 1, 1), **_bn(f"{p}.ffn.fc1.norm", 4 * dim),
        f"{p}.ffn.fc2.conv.weight": (dim, 4 * dim, 1, 1), **_bn(f"{p}.ffn.fc2.norm", dim),
        f"{p}.alpha": (4, dim),
    }


def _timm_patch_merging(p, dim_in, dim_out):
    hidden = 4 * dim_out
    reduced = hidden // 4  # SqueezeExcite(hidden, 0.25): make_divisible(hidden / 4, 8), a multiple of 8 here
    return {
        f"{p}.conv.0.conv.weight": (hidden, dim_in, 1, 1), **_bn(f"{p}.conv.0.norm", hidden),
        f"{p}.conv.1.conv.weight": (hidden, 1, 3, 3), **_bn(f"{p}.conv.1.norm", hidden),
        f"{p}.conv.2.fc1.weight": (reduced, hidden, 1, 1), f"{p}.conv.2.fc1.bias": (reduced,),
        f"{p}.conv.2.fc2.weight": (hidden, reduced, 1, 1), f"{p}.conv.2.fc2.bias": (hidden,),
        f"{p}.conv.3.conv.weight": (dim_out, hidden, 1, 1), **_bn(f"{p}.conv.3.norm", dim_out),
        f"{p}.dwconv1.conv.weight": (dim_in, 1, 3, 3), **_bn(f"{p}.dwconv1.norm", dim_in),
        f"{p}.dwconv2.conv.weight": (dim_out, 1, 3, 3), **_bn(f"{p}.dwconv2.norm", dim_out),
    }


TIMM_M1 = {  # efficientvim_m1: embed (128, 192, 320), depths (2, 2, 2), states (49, 25, 9), 1000 classes
    "patch_embed.conv.0.conv.weight": (16, 3, 3, 3), **_bn("patch_embed.conv.0.norm", 16),
    "patch_embed.conv.1.conv.weight": (32, 16, 3, 3), **_bn("patch_embed.conv.1.norm", 32),
    "patch_embed.conv.2.conv.weight": (64, 32, 3, 3), **_bn("patch_embed.conv.2.norm", 64),
    "patch_embed.conv.3.conv.weight": (128, 64, 3, 3), **_bn("patch_embed.conv.3.norm", 128),
    **_timm_block("stages.0.blocks.0", 128, 49), **_timm_block("stages.0.blocks.1", 128, 49),
    **_timm_patch_merging("stages.0.downsample", 128, 192),
    **_timm_block("stages.1.blocks.0", 192, 25), **_timm_block("stages.1.blocks.1", 192, 25),
    **_timm_patch_merging("stages.1.downsample", 192, 320),
    **_timm_block("stages.2.blocks.0", 320, 9), **_timm_block("stages.2.blocks.1", 320, 9),
    "weights": (4,),
    "norm.0.weight": (128,), "norm.0.bias": (128,), "norm.1.weight": (192,), "norm.1.bias": (192,),
    "norm.2.weight": (320,), "norm.2.bias": (320,), "norm.3.weight": (320,), "norm.3.bias": (320,),
    "heads.0.weight": (1000, 128), "heads.0.bias": (1000,), "heads.1.weight": (1000, 192), "heads.1.bias": (1000,),
    "heads.2.weight": (1000, 320), "heads.2.bias": (1000,), "heads.3.weight": (1000, 320), "heads.3.bias": (1000,),
}


def test_state_dict_has_timms_keys_and_shapes_for_m1():
    state = efficientvim_m1().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == TIMM_M1
    params = sum(v.numel() for k, v in state.items() if not k.endswith(("running_mean", "running_var",
                                                                       "num_batches_tracked")))
    assert round(params / 1e6, 1) == 6.7  # timm's docstring: "EfficientViM-M1: 6.7M params"


# --- a tiny random model and a float64 transcription of timm's forward -------------------------------------------

def tiny_model(dtype=torch.float64, seed=0, **overrides):
    """Random weights everywhere (BatchNorm statistics, LayerScale gates and A included), eval mode."""
    torch.manual_seed(seed)
    model = EfficientViM(**{**TINY, **overrides})
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("running_var"):
                tensor.uniform_(0.5, 2.0)
            elif name.endswith("alpha"):
                tensor.normal_(0, 1.0)
            elif tensor.is_floating_point():
                tensor.normal_(0, 0.4 if tensor.dim() > 1 else 0.3)
    return model.to(dtype).eval()


def reference_forward(state, pixels, embed_dim, depths, state_dim, in_chans=3):
    """timm's EfficientViM.forward in eval mode, from the weights alone (float64)."""
    s = {k: v.double() for k, v in state.items()}

    def bn(x, p):
        shape = (1, -1) + (1,) * (x.dim() - 2)
        scale = s[p + ".weight"] / torch.sqrt(s[p + ".running_var"] + 1e-5)
        return (x - s[p + ".running_mean"].view(shape)) * scale.view(shape) + s[p + ".bias"].view(shape)

    def conv_bn(x, p, stride=1, padding=0, groups=1, relu=False):
        y = bn(F.conv2d(x, s[p + ".conv.weight"], stride=stride, padding=padding, groups=groups), p + ".norm")
        return y.clamp(min=0) if relu else y

    def channel_norm(x, p):  # LayerNorm over dim 1 of (B, C, ...)
        mean = x.mean(1, keepdim=True)
        var = ((x - mean) ** 2).mean(1, keepdim=True)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - mean) / torch.sqrt(var + 1e-5) * s[p + ".weight"].view(shape) + s[p + ".bias"].view(shape)

    def hsmssd(x, p, n_state):
        bsz, dim, rows, cols = x.shape
        length = rows * cols
        tokens = x.reshape(bsz, dim, length)
        proj = torch.einsum("oc,bcl->bol", s[p + ".BCdt_proj.conv.weight"][:, :, 0], tokens)
        gates = F.conv2d(proj.reshape(bsz, -1, rows, cols), s[p + ".dw.conv.weight"], padding=1,
                         groups=3 * n_state).reshape(bsz, 3 * n_state, length)
        b, c, dt = gates[:, :n_state], gates[:, n_state:2 * n_state], gates[:, 2 * n_state:]
        logits = dt + s[p + ".A"][None, :, None]
        a = torch.exp(logits - logits.amax(-1, keepdim=True))
        a = a / a.sum(-1, keepdim=True)
        h = torch.einsum("bcl,bnl->bcn", tokens, a * b)
        hz = torch.einsum("oc,bcn->bon", s[p + ".hz_proj.conv.weight"][:, :, 0], h)
        h1, z = hz[:, :dim], hz[:, dim:]
        g = h1 * (z * torch.sigmoid(z)) + h1 * s[p + ".D"]
        h = torch.einsum("oc,bcn->bon", s[p + ".out_proj.conv.weight"][:, :, 0], g)
        return torch.einsum("bcn,bnl->bcl", h, c).reshape(bsz, dim, rows, cols), h

    x = pixels.double()
    for i in range(4):
        x = conv_bn(x, f"patch_embed.conv.{i}", stride=2, padding=1, relu=i < 3)
    hidden_states = []
    for stage, depth in enumerate(depths):
        dim = embed_dim[stage]
        for j in range(depth):
            p = f"stages.{stage}.blocks.{j}"
            gate = torch.sigmoid(s[p + ".alpha"])[:, None, :, None, None]  # (4, 1, C, 1, 1)
            x = x + gate[0] * (conv_bn(x, p + ".dwconv1", padding=1, groups=dim) - x)
            y, h = hsmssd(channel_norm(x, p + ".norm"), p + ".mixer", state_dim[stage])
            x = x + gate[1] * (y - x)
            x = x + gate[2] * (conv_bn(x, p + ".dwconv2", padding=1, groups=dim) - x)
            ffn = conv_bn(conv_bn(x, p + ".ffn.fc1", relu=True), p + ".ffn.fc2")
            x = x + gate[3] * (ffn - x)
        hidden_states.append(h)
        if stage < len(depths) - 1:
            p = f"stages.{stage}.downsample"
            x = x + conv_bn(x, p + ".dwconv1", padding=1, groups=dim)
            t = conv_bn(x, p + ".conv.0", relu=True)
            t = conv_bn(t, p + ".conv.1", stride=2, padding=1, groups=t.shape[1], relu=True)
            squeeze = t.mean((2, 3))
            squeeze = (squeeze @ s[p + ".conv.2.fc1.weight"][:, :, 0, 0].T + s[p + ".conv.2.fc1.bias"]).clamp(min=0)
            squeeze = squeeze @ s[p + ".conv.2.fc2.weight"][:, :, 0, 0].T + s[p + ".conv.2.fc2.bias"]
            t = t * torch.sigmoid(squeeze)[:, :, None, None]
            x = conv_bn(t, p + ".conv.3")
            x = x + conv_bn(x, p + ".dwconv2", padding=1, groups=x.shape[1])
    pooled = [channel_norm(h, f"norm.{k}").mean(-1) for k, h in enumerate(hidden_states)]
    pooled.append(channel_norm(x, f"norm.{len(depths)}").flatten(2).mean(-1))
    weights = torch.softmax(s["weights"], 0)
    return sum(weights[k] * (pooled[k] @ s[f"heads.{k}.weight"].T + s[f"heads.{k}.bias"]) for k in range(len(pooled)))


def test_forward_matches_a_float64_transcription_of_timms_math():
    model = tiny_model()
    pixels = torch.randn(2, 3, 64, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = reference_forward(model.state_dict(), pixels, TINY["embed_dim"], TINY["depths"], TINY["state_dim"])
    assert (model(pixels) - expected).abs().max() <= 1e-10
    assert expected.abs().max() > 1e-2  # not a trivially small output


def test_layout_and_blocks():
    model = tiny_model()
    layout = model.token_layout()
    assert [stage.grid for stage in layout.stages] == [(4, 4), (2, 2), (1, 1)]
    assert [stage.blocks for stage in layout.stages] == [1, 2, 1]
    assert [stage.downsample for stage in layout.stages] == [None, (3, 2, 1), (3, 2, 1)]
    assert list(model.stage_blocks()) == [b for s in model.stages for b in s.blocks]
    assert [s.grid for s in efficientvim_m1().token_layout().stages] == [(14, 14), (7, 7), (4, 4)]
    # the grids are the real ones: each stage's map has its layout's grid
    grids = []
    hooks = [b.register_forward_hook(lambda m, a, o: grids.append(tuple(o[0].shape[2:]))) for b in model.stage_blocks()]
    model(torch.zeros(1, 3, 64, 64, dtype=torch.float64))
    for hook in hooks:
        hook.remove()
    assert grids == [(4, 4), (2, 2), (2, 2), (1, 1)]


# --- the loader ------------------------------------------------------------------------------------------------------

def _same_function(a, b, pixels):
    with torch.no_grad():
        return torch.equal(a(pixels), b(pixels))


def test_loader_round_trips(tmp_path):
    model = tiny_model(dtype=torch.float32)
    pixels = torch.randn(1, 3, 64, 64)
    state = model.state_dict()
    loaded = load_efficientvim(state, img_size=64)
    assert _same_function(model, loaded, pixels) and loaded.variant is None and not loaded.training
    assert loaded.token_layout() == model.token_layout()
    torch.save({"model_ema": state, "model": tiny_model(torch.float32, seed=3).state_dict()}, tmp_path / "c.pth")
    assert _same_function(model, load_efficientvim(tmp_path / "c.pth", img_size=64), pixels)  # EMA preferred
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    assert _same_function(model, load_efficientvim(tmp_path / "model.safetensors", img_size=64), pixels)
    assert _same_function(model, load_efficientvim(model, img_size=64), pixels)  # a model object: its state dict
    # official checkpoints store the LayerNorms' parameters broadcast-shaped
    broadcast = {k: (v.reshape(1, -1, 1, 1) if k.endswith("blocks.0.norm.weight") else v) for k, v in state.items()}
    assert _same_function(model, load_efficientvim(broadcast, img_size=64), pixels)
    assert load_efficientvim(state, dtype=torch.float64).weights.dtype == torch.float64


def test_loader_detects_timms_variants():
    m1 = load_efficientvim(efficientvim_m1().state_dict())
    assert m1.variant == "efficientvim_m1" and m1.img_size == (224, 224)
    m4 = load_efficientvim(efficientvim_m4(num_classes=10).state_dict())
    assert m4.variant == "efficientvim_m4" and m4.img_size == (256, 256) and m4.num_classes == 10
    assert [s.grid for s in m4.token_layout().stages] == [(16, 16), (8, 8), (4, 4)]


def test_loader_distilled_heads():
    model = tiny_model(dtype=torch.float32, distilled=True)
    pixels = torch.randn(1, 3, 64, 64)
    loaded = load_efficientvim(model.state_dict())
    assert hasattr(loaded, "heads_dist") and _same_function(model, loaded, pixels)
    with torch.no_grad():
        single = model._fuse([t.mean(-1) for t in model.forward_features(pixels)], model.heads, model.weights)
        assert torch.equal(load_efficientvim(model.state_dict(), distilled=False)(pixels), single)


def test_loader_errors(tmp_path):
    state = tiny_model(dtype=torch.float32).state_dict()
    with pytest.raises(ValueError, match=r"missing keys \(1\): stages.0.blocks.0.mixer.D"):
        load_efficientvim({k: v for k, v in state.items() if k != "stages.0.blocks.0.mixer.D"})
    bad = dict(state, **{"stages.1.blocks.0.mixer.A": torch.zeros(3)})
    bad["stages.1.blocks.1.mixer.A"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"shapes that differ \(1\): stages.1.blocks.1.mixer.A \(7,\) "
                                         r"\(model: \(3,\)\)"):
        load_efficientvim(bad)
    with pytest.raises(ValueError, match="unexpected keys.*extra.weight"):
        load_efficientvim(dict(state, **{"extra.weight": torch.zeros(1)}))
    with pytest.raises(ValueError, match="reparameterised"):
        load_efficientvim(dict(state, **{"stages.0.blocks.0.dwconv1.conv.bias": torch.zeros(16)}))
    with pytest.raises(ValueError, match="not an EfficientViM checkpoint"):
        load_efficientvim({"layers.0.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="not floating point"):
        load_efficientvim(dict(state, **{"stages.0.blocks.0.mixer.D": torch.ones(1, dtype=torch.int64)}))
    with pytest.raises(FileNotFoundError):
        load_efficientvim(tmp_path / "none.pth")
    torch.save({"model": state, "args": SimpleNamespace(lr=1)}, tmp_path / "pickled.pth")
    with pytest.raises(ValueError, match="weights-only"):
        load_efficientvim(tmp_path / "pickled.pth")
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        load_efficientvim(tmp_path / "broken.safetensors")
    with pytest.raises(ValueError, match="holds no state dict"):
        load_efficientvim({"model": {"a": 1}})
    fused_model = tiny_model(dtype=torch.float32)
    fused_model.stage_blocks()[0].fused = True  # what timm's reparameterize_model sets
    with pytest.raises(ValueError, match="reparameterised"):
        load_efficientvim(fused_model)


# --- the adapters: y = H x --------------------------------------------------------------------------------------------

def recorded_calls(model, pixels):
    """(module, input, output) of every HSMSSD and claimed depthwise conv of the blocks, by forward hooks."""
    calls, hooks = [], []
    for block in model.stage_blocks():
        for module in (block.dwconv1, block.mixer, block.dwconv2):
            hooks.append(module.register_forward_hook(
                lambda m, args, out: calls.append((m, args[0], out[0] if isinstance(out, tuple) else out))))
    with torch.no_grad():
        model(pixels)
    for hook in hooks:
        hook.remove()
    return calls


def apply_maps(per_channel, values):
    """Σ_j H_c[i, j] values_c[j]: per_channel (B, C, L, L), values (B, L, H, P) with C = H·P -> (B, L, H, P)."""
    flat = values.flatten(2)
    return torch.einsum("bcij,bjc->bic", per_channel.to(flat.dtype), flat).reshape(values.shape)


@pytest.mark.parametrize("formulation", ["unified", "hidden"])
def test_operators_reproduce_each_mixer(formulation):
    model = tiny_model()
    pixels = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    calls = recorded_calls(model, pixels)
    assert len(calls) == 12
    for module, inputs, real in calls:
        call = SimpleNamespace(located=SimpleNamespace(module=module), hidden_states=inputs, attention_mask=None)
        operator, rebuilt = adapter.rebuild(call, formulation, frozenset(mc.families.COMPONENTS), torch.float64)
        assert rebuilt.shape == real.shape and (rebuilt - real).abs().max() <= 1e-10
        # y = readout(H x): the maps per channel applied to the values give the operator's output
        if formulation == "unified" or type(module).__name__ == "ConvLayer2d":
            per_channel = operator.maps(reduce=None)
        else:  # hidden HSMSSD: one core per state over all C channels of x
            per_channel = operator.maps(reduce=None).repeat_interleave(operator.head_dim, dim=1)
        out = apply_maps(per_channel, operator.values)
        assert (out - operator.output).abs().max() <= 1e-5 * max(1.0, operator.output.abs().max())
        assert (operator.readout(out) - real).abs().max() <= 1e-5 * max(1.0, real.abs().max())
        tokens = inputs.flatten(2).transpose(1, 2)  # (B, L, C), row-major over the grid
        if formulation == "hidden":  # the hidden operators act on the mixer's input itself
            assert torch.equal(operator.values[:, :, 0], tokens) if operator.head_dim > 1 else \
                torch.equal(operator.values[..., 0], tokens)


def test_hsmssd_hidden_core_is_c_times_softmax_b():
    model = tiny_model()
    pixels = torch.randn(1, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    module, inputs, _ = next(c for c in recorded_calls(model, pixels) if type(c[0]).__name__ == "HSMSSD")
    call = SimpleNamespace(located=SimpleNamespace(module=module), hidden_states=inputs, attention_mask=None)
    operator, _ = adapter.rebuild(call, "hidden", frozenset(mc.families.COMPONENTS), torch.float64)
    # by hand: the gates through BCdt_proj and the depthwise dw conv, then c[n, i] · softmax_j(dt + A)[n, j] b[n, j]
    tokens = inputs.flatten(2)
    gates = F.conv2d(torch.einsum("oc,bcl->bol", module.BCdt_proj.conv.weight[:, :, 0], tokens).reshape(1, -1, 4, 4),
                     module.dw.conv.weight, padding=1, groups=module.dw.conv.groups).flatten(2)
    b, c, dt = gates.split(module.state_dim, 1)
    expected = torch.einsum("bni,bnj->bij", c, torch.softmax(dt + module.A[None, :, None], -1) * b) / module.state_dim
    assert (operator.maps("mean") - expected).abs().max() <= 1e-12


def test_claims_and_refusals():
    model = tiny_model()
    block = model.stage_blocks()[0]
    assert adapter.claims(block.dwconv1) and adapter.claims(block.mixer)
    assert not adapter.claims(block.ffn.fc1) and not adapter.claims(block.ffn.fc2)  # 1×1: no token mixing
    merging = model.stages[0].downsample
    assert not adapter.claims(merging.conv[1])  # stride 2
    assert not adapter.claims(model.patch_embed.conv[0])
    inputs = torch.randn(1, 16, 4, 4, dtype=torch.float64)
    call = SimpleNamespace(located=SimpleNamespace(module=block.dwconv1), hidden_states=inputs, attention_mask=None)
    block.dwconv1.norm.train()
    with pytest.raises(ValueError, match="batch statistics"):
        adapter.rebuild(call, "unified", frozenset(mc.families.COMPONENTS), torch.float64)
    fused = ConvLayer2d(16, 16, 3, padding=1, groups=16, norm=None, act_layer=None).double()
    fused.conv.bias = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))  # what timm's fuse() leaves
    call.located.module = fused
    with pytest.raises(TypeError, match="reparameterised"):
        adapter.rebuild(call, "unified", frozenset(mc.families.COMPONENTS), torch.float64)


# --- the library's methods on a tiny model ---------------------------------------------------------------------------

def test_maps_and_attributions_batched_equal_single():
    model = tiny_model()
    pixels = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    maps = mc.implicit_attention(model, pixels)
    assert sorted(map(str, maps)) == sorted(
        [str(i) for i in range(4)] + [f"{i}.{part}" for i in range(4) for part in ("mixer", "dwconv2")])
    assert [maps[i].shape[-1] for i in range(4)] == [16, 4, 4, 1]  # each block's stage grid
    single = mc.implicit_attention(model, pixels[1:])
    for key in maps:
        assert (maps[key][1:] - single[key]).abs().max() <= 1e-10
    explainer = mc.MambaAttribution(model)
    attributions = explainer.attribute(pixels, target=1)
    assert attributions.shape == (2, 1, 64, 64) and torch.isfinite(attributions).all()
    assert (attributions[1:] - explainer.attribute(pixels[1:], target=1)).abs().max() <= 1e-8
    assert attributions.abs().amax() > 0
