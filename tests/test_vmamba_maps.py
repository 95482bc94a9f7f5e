"""VMamba's SS2D operator (mamba_captum.families.vmamba, mamba_captum.operators.permuted): y = H x against the layer's
own activations, the hidden maps against impulses through each scan, the engine on the multi-stage model, batching."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import mamba_captum as mc
from mamba_captum.families import vmamba as adapter
from mamba_captum.families.registry import adapter_for
from mamba_captum.vision import vmamba_tiny

ALL = frozenset({"s6", "gate", "act", "conv", "norm"})
NOZ = dict(dims=16, depths=(1, 1, 2, 1), img_size=32, num_classes=5, ssm_d_state=2)
GATED = dict(NOZ, ssm_ratio=2.0, forward_type="v0", mlp_ratio=0.0, norm_layer="ln", downsample_version="v1",
             patchembed_version="v1", ssm_conv_bias=True)


def model_of(config, seed=0):
    torch.manual_seed(seed)
    model = vmamba_tiny(**config).double().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def recorded(model, pixels, stage=0):
    """The first SS2D of ``stage``: its input, and what the test's own hooks saw inside it (conv input and output,
    out_norm input, in_proj output)."""
    mixer = model.layers[stage].blocks[0].op
    seen = {}
    hooks = [mixer.register_forward_pre_hook(lambda m, args: seen.__setitem__("hidden", args[0])),
             mixer.in_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("projected", o)),
             mixer.conv2d.register_forward_hook(lambda m, i, o: seen.update(x=i[0], pre=o)),
             mixer.out_norm.register_forward_hook(lambda m, i, o: seen.__setitem__("y", i[0]))]
    with torch.no_grad():
        model(pixels)
    for hook in hooks:
        hook.remove()
    return mixer, seen


def tokens(t, channel_first=True):
    """(B, C, H, W) or (B, H, W, C) -> (B, H·W, C) row-major."""
    return t.flatten(2).transpose(1, 2) if channel_first else t.flatten(1, 2)


def rebuilt(mixer, hidden, formulation, components=ALL):
    call = SimpleNamespace(located=SimpleNamespace(module=mixer, name="op"), hidden_states=hidden,
                           attention_mask=None)
    with torch.no_grad():
        return adapter.rebuild(call, formulation, components, torch.float64)


def pixels_of(batch=2, seed=3):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_registry_sends_ss2d_here():
    assert adapter_for("SS2D").module is adapter and adapter_for("SS2D").NONCAUSAL


@pytest.mark.parametrize("config", [NOZ, GATED], ids=["v05_noz", "v0_gated"])
@pytest.mark.parametrize("stage", [0, 2])
def test_unified_and_hidden_give_the_layer_output(config, stage):
    model = model_of(config)
    with torch.no_grad():  # the conv bias' share comes from no token: without it y = H x exactly
        for block in model.stage_blocks():
            if block.op.conv2d.bias is not None:
                block.op.conv2d.bias.zero_()
    mixer, seen = recorded(model, pixels_of(), stage)
    first = mixer.channel_first
    x, pre, y = tokens(seen["x"]), tokens(seen["pre"]), tokens(seen["y"], first)  # conv in/out are channel-first
    u = F.silu(pre)
    skip = mixer.Ds.view(4, -1).sum(0) * u
    std = torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + mixer.out_norm.eps)
    nu = mixer.out_norm.weight / std
    gate = F.silu(tokens(seen["projected"], first).chunk(2, dim=-1)[1]) if mixer.gated else 1.0

    operator, output = rebuilt(mixer, seen["hidden"], "unified")
    with torch.no_grad():
        assert (output - mixer(seen["hidden"])).abs().max().item() <= 1e-12
    per_channel = operator.maps(None)  # (B, C, L, L)
    Hx = torch.einsum("bcij,bjc->bic", per_channel, x)
    assert (Hx - gate * nu * (y - skip)).abs().max().item() <= 1e-5 * max(1.0, y.abs().max().item())
    assert (operator.readout(operator.output) - output).abs().max().item() <= 1e-12

    operator, _ = rebuilt(mixer, seen["hidden"], "hidden")
    hidden = torch.einsum("bcij,bjc->bic", operator.maps(None), u)
    assert (hidden - (y - skip)).abs().max().item() <= 1e-5 * max(1.0, y.abs().max().item())


def scan_impulses(mixer, u, k, grid):
    """α_k per channel (B, C, L, L) in token order, from one-hot impulses through scan k (its Δ, B, C fixed at the real
    input u (B, L, C)): the test's own recurrence, token by token in scan order k."""
    rows, cols = grid
    order = list(range(rows * cols))
    if k in (1, 3):  # column-major
        order = [r * cols + c for c in range(cols) for r in range(rows)]
    if k in (2, 3):
        order = order[::-1]
    batch, length, channels = u.shape
    R, N = mixer.dt_rank, mixer.d_state
    proj = u @ mixer.x_proj_weight[k].t()
    dt, B, C = proj[..., :R], proj[..., R:R + N], proj[..., R + N:]
    delta = F.softplus(dt @ mixer.dt_projs_weight[k].t() + mixer.dt_projs_bias[k])  # (B, L, C)
    A = -torch.exp(mixer.A_logs.view(4, channels, N)[k])
    maps = torch.zeros(batch, channels, length, length, dtype=u.dtype)
    for source in range(length):  # an impulse at token `source`, every channel
        state = torch.zeros(batch, channels, N, dtype=u.dtype)
        for token in order:
            impulse = 1.0 if token == source else 0.0
            decay = torch.exp(delta[:, token, :, None] * A)
            state = decay * state + delta[:, token, :, None] * B[:, token, None, :] * impulse
            maps[:, :, token, source] = (state * C[:, token, None, :]).sum(-1)
    return maps


def test_hidden_maps_are_the_impulse_responses_of_the_four_scans():
    model = model_of(NOZ)
    mixer, seen = recorded(model, pixels_of(), stage=1)  # a 4 × 4 grid
    u = tokens(F.silu(seen["pre"]))
    operator, _ = rebuilt(mixer, seen["hidden"], "hidden")
    with torch.no_grad():
        expected = sum(scan_impulses(mixer, u, k, seen["pre"].shape[-2:]) for k in range(4))
    per_channel = operator.maps(None)
    assert (per_channel - expected).abs().max().item() <= 1e-12
    assert (operator.maps("mean") - expected.mean(1)).abs().max().item() <= 1e-12
    assert (operator.maps("abs_mean") - expected.abs().mean(1)).abs().max().item() <= 1e-12
    rows = torch.tensor([0, 5, 15])
    assert (operator.maps("sum", rows) - expected.sum(1)[:, rows]).abs().max().item() <= 1e-12
    # non-causal: every token reaches every other (the four scans between them cover the grid both ways)
    assert bool((expected.abs().sum(1) > 0).all())


def test_implicit_attention_gives_each_blocks_maps_over_its_stage():
    model = model_of(NOZ).float()
    pixels = pixels_of().float()
    layout = model.token_layout()
    lengths = [layout.stages[layout.stage_of_block(b)].length for b in range(layout.num_blocks)]
    assert lengths == [64, 16, 4, 4, 1]
    for formulation in ("unified", "hidden"):
        maps = mc.implicit_attention(model, pixels, formulation=formulation)
        assert sorted(maps) == list(range(5))
        assert [tuple(maps[b].shape) for b in range(5)] == [(2, n, n) for n in lengths]
        assert all(bool(torch.isfinite(m).all()) for m in maps.values())
    single = mc.implicit_attention(model, pixels[1:])
    batched = mc.implicit_attention(model, pixels)
    for block in range(5):
        assert (batched[block][1:] - single[block]).abs().max().item() <= 1e-5 * batched[block].abs().max().item()


def test_the_gated_channel_last_model_runs_through_the_engine():
    model = model_of(GATED).float()
    maps = mc.implicit_attention(model, pixels_of(1).float(), reduce="abs_mean")
    assert [tuple(m.shape) for m in maps.values()] == [(1, 64, 64), (1, 16, 16), (1, 4, 4), (1, 4, 4), (1, 1, 1)]
    assert all(bool((m >= 0).all()) for m in maps.values())


def test_a_non_square_grid_passes_the_engines_own_checks():
    # the fast path lays each scan's lines with one inactive token between them: a grid whose rows and columns
    # differ exercises both line lengths; the engine checks y = H x and the maps' rows against the layer itself
    torch.manual_seed(3)
    model = vmamba_tiny(dims=8, depths=(1, 1, 1, 1), img_size=(24, 40), num_classes=3, ssm_d_state=2).double().eval()
    pixels = torch.randn(2, 3, 24, 40, dtype=torch.float64)
    maps = mc.implicit_attention(model, pixels)
    assert tuple(maps[0].shape) == (2, 60, 60)
    single = mc.implicit_attention(model, pixels[1:])
    assert torch.allclose(single[0][0], maps[0][1], atol=1e-12)
    relevance = mc.MambaAttribution(model).attribute(pixels, target=1)
    assert relevance.shape == (2, 1, 24, 40) and bool(torch.isfinite(relevance).all())
