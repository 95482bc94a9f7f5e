"""implicit_attention's contract: shapes, dtypes, edge lengths, errors, kernel paths, no side effects."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from test_identities import ScanRecorder, liven, padded_batch
from tiny_models import CONFIGS, MAMBA1, VOCAB, make_model
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import mamba_captum as mc


def model_state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()})


def assert_untouched(model, before):
    params, grads, modes = before
    after = model.state_dict()
    assert after.keys() == params.keys() and all(torch.equal(after[k], params[k]) for k in params)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert {n: m.training for n, m in model.named_modules()} == modes
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._forward_hooks_with_kwargs and not module._forward_pre_hooks_with_kwargs
    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_shapes_keys_and_no_side_effects(family):
    model = make_model(family)
    before = model_state(model)
    ids, mask = padded_batch()
    maps = mc.implicit_attention(model, ids, mask)
    assert maps and all(m.shape == (2, 12, 12) and m.dtype == torch.float32 for m in maps.values())
    assert all(torch.all(m[0, :3] == 0) and torch.all(m[0, :, :3] == 0) for m in maps.values())  # pads
    assert all(torch.all(m.triu(1) == 0) for m in maps.values())  # causal
    rows = mc.implicit_attention(model, ids, mask, rows=[-1], layers=[-1])
    assert list(rows) == [list(maps)[-1]] and next(iter(rows.values())).shape == (2, 1, 12)
    assert_untouched(model, before)


def test_layer_keys_follow_the_architecture():
    keys = {family: list(mc.implicit_attention(make_model(family), torch.randint(3, VOCAB, (1, 5))))
            for family in ("jamba", "zamba2", "nemotron_h")}
    assert keys["jamba"] == [0, 1, 2, 3]  # layer 2 is attention
    assert keys["zamba2"] == [0, "1.shared_attention", 1, 2]
    assert keys["nemotron_h"] == [0, 2, 3]  # layer 1 is an MLP block: no token mixing


def test_per_channel_shapes():
    ids = torch.randint(3, VOCAB, (2, 7))
    mamba = make_model("mamba")
    assert mc.implicit_attention(mamba, ids, reduce=None)[0].shape == (2, 64, 7, 7)  # d_inner
    mamba2 = make_model("mamba2")
    assert mc.implicit_attention(mamba2, ids, reduce=None, formulation="hidden")[0].shape == (2, 4, 7, 7)  # heads
    assert mc.implicit_attention(mamba2, ids, reduce=None)[0].shape == (2, 64, 7, 7)
    assert mc.implicit_attention(mamba2, ids, reduce=None, rows=[1, 2])[0].shape == (2, 64, 2, 7)
    jamba = make_model("jamba")
    assert mc.implicit_attention(jamba, ids, reduce=None, layers=[2])[2].shape == (2, 4, 7, 7)  # attention heads


@pytest.mark.parametrize("family,length,overrides", [
    ("mamba", 1, {}), ("jamba", 1, {}), ("mamba2", 1, {}), ("bamba", 1, {}),
    ("mamba2", 13, {}), ("zamba2", 19, {}), ("granitemoehybrid", 13, {}),
    ("mamba2", 12, {"time_step_limit": (0.05, 0.5)}),
])
def test_edge_lengths_and_dt_limit_hidden_identity(family, length, overrides):
    model = liven(make_model(family, **overrides))
    ids = torch.randint(3, VOCAB, (2, length))
    with ScanRecorder(family) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    maps = mc.implicit_attention(model, ids, formulation="hidden", reduce=None)
    ssm_maps = [maps[k] for k in maps if k in _ssm_layer_keys(model)]
    assert len(ssm_maps) == len(recorder.calls)
    for alpha, (args, _, pure) in zip(ssm_maps, recorder.calls):
        if family in MAMBA1:
            got = torch.einsum("bcij,bcj->bci", alpha.double(), args[0].double())
        else:
            got = torch.einsum("bhij,bjhp->bihp", alpha.double(), args[0].double())
        assert relative_error(got, pure) <= 1e-5
    if "time_step_limit" in overrides:
        operators, _, _ = mc.build_operators(model, ids, formulation="hidden")
        assert all(0.05 <= op.delta.min() and op.delta.max() <= 0.5 for op in operators.values())


def _ssm_layer_keys(model):
    names = set(mc.SUPPORTED_MIXERS)
    layers = mc.families.decoder_layers(model)
    return [i for i, layer in enumerate(layers) if any(type(m).__name__ in names for m in layer.modules())]


def test_float64_model_gives_float64_maps_and_matches_float32():
    ids, mask = padded_batch()
    maps64 = mc.implicit_attention(make_model("mamba2").double(), ids, mask)
    maps32 = mc.implicit_attention(make_model("mamba2"), ids, mask)
    assert all(m.dtype == torch.float64 for m in maps64.values())
    assert all(relative_error(maps32[k], maps64[k]) < 1e-5 for k in maps64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["mamba", "bamba"])
def test_half_precision_models_give_float32_maps(family, dtype):
    ids, mask = padded_batch()
    maps = mc.implicit_attention(make_model(family, dtype=dtype), ids, mask)
    reference = mc.implicit_attention(make_model(family), ids, mask)
    for key, value in maps.items():
        assert value.dtype == torch.float32 and torch.isfinite(value).all()
        assert relative_error(value, reference[key]) < 0.1  # same model up to half-precision weights


def test_unsupported_mixer_is_a_type_error_naming_it():
    import transformers as tf

    class UnknownShortConv(torch.nn.Module):  # a token mixer of a future transformers
        def forward(self, hidden_states, **kwargs):
            return hidden_states

    config = tf.Lfm2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, layer_types=["conv", "full_attention"])
    model = tf.Lfm2ForCausalLM(config).eval()
    model.model.layers[0].conv = UnknownShortConv()
    with pytest.raises(TypeError, match=r"UnknownShortConv \(model type 'lfm2'\).*Supported mixers: .*MambaMixer.*"
                                        r"RwkvSelfAttention"):
        mc.implicit_attention(model, torch.randint(0, VOCAB, (1, 4)))
    with pytest.raises(TypeError, match="no decoder-layer list"):
        mc.implicit_attention(torch.nn.Linear(3, 3), torch.zeros(1, 3))


def test_bad_arguments_are_clear_errors():
    model, ids = make_model("mamba"), torch.randint(3, VOCAB, (1, 5))
    with pytest.raises(ValueError, match="formulation"):
        mc.implicit_attention(model, ids, formulation="full")
    with pytest.raises(ValueError, match="reduce"):
        mc.implicit_attention(model, ids, reduce="max")
    with pytest.raises(ValueError, match="unknown component"):
        mc.implicit_attention(model, ids, components=["gates"])
    with pytest.raises(ValueError, match="unified"):
        mc.implicit_attention(model, ids, formulation="hidden", components=["s6"])
    with pytest.raises(IndexError, match="out of range"):
        mc.implicit_attention(model, ids, rows=[5])
    with pytest.raises(IndexError, match="2 decoder layers"):
        mc.implicit_attention(model, ids, layers=[2])


def test_hooks_removed_when_the_forward_raises():
    model = make_model("jamba")
    failing = model.model.layers[2].register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    before = model_state(model)
    with pytest.raises(RuntimeError, match="boom"):
        mc.implicit_attention(model, torch.randint(3, VOCAB, (1, 4)))  # the forward raises inside layer 2
    failing.remove()
    assert_untouched(model, before)
    with pytest.raises(ValueError, match=r"token id 69, outside the model's vocabulary \(0..63\)"):
        mc.implicit_attention(model, torch.full((1, 4), VOCAB + 5))


def test_mismatch_raises_naming_the_layer():
    model = make_model("mamba2")
    mixer = model.backbone.layers[1].mixer
    real_forward = mixer.forward
    mixer.forward = lambda *args, **kwargs: real_forward(*args, **kwargs) * 1.01  # a variant the adapter does not know
    before = model_state(model)
    with pytest.raises(mc.ReconstructionError, match=r"layer 1 \(1.mixer, Mamba2Mixer\).*relative"):
        mc.implicit_attention(model, torch.randint(3, VOCAB, (1, 6)))
    del mixer.forward
    assert_untouched(model, before)


@pytest.mark.parametrize("components,changed", [(("s6", "gate", "act", "norm"), True), (None, False)])
def test_components_switch_parts_off(components, changed):
    model, ids = liven(make_model("mamba2")), torch.randint(3, VOCAB, (2, 9))
    full = mc.implicit_attention(model, ids)
    ablated = mc.implicit_attention(model, ids, components=components)
    assert (not torch.allclose(full[0], ablated[0])) == changed
    no_s6 = mc.implicit_attention(model, ids, components={"s6": False}, reduce=None)[0]
    band = torch.ones(9, 9).tril().triu(-3)  # without S6 only the conv band (K = 4) is left
    assert torch.all(no_s6 * (1 - band) == 0) and torch.any(no_s6 != 0)


# --- the fused training kernels, simulated on CPU with torch code that calls no submodule ------------------

def fused_mamba1(module):
    scan = module.mamba_selective_scan  # HF's torch scan

    def mamba_inner(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                    out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, delta_softplus=True,
                    b_rms_weight=None, c_rms_weight=None, dt_rms_weight=None, b_c_dt_rms_eps=1e-6, **kwargs):
        length, kernel = xz.shape[-1], conv1d_weight.shape[-1]
        x, z = xz.chunk(2, dim=1)  # like mamba_ssm: no pad mask after the conv
        x = F.silu(F.conv1d(x, conv1d_weight, conv1d_bias, padding=kernel - 1, groups=x.shape[1])[..., :length])
        rank, state = delta_proj_weight.shape[1], A.shape[1]
        dt, B, C = torch.split(F.linear(x.transpose(1, 2), x_proj_weight), [rank, state, state], dim=-1)
        delta = F.linear(dt, delta_proj_weight)
        if dt_rms_weight is not None:  # as mamba-ssm: the dt norm acts on the D_in-wide projection
            rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + b_c_dt_rms_eps) * w
            delta, B, C = rms(delta, dt_rms_weight), rms(B, b_rms_weight), rms(C, c_rms_weight)
        delta = delta.transpose(1, 2)
        y = scan(x, delta, A, B.transpose(1, 2), C.transpose(1, 2), D=D, z=z, delta_bias=delta_bias,
                 delta_softplus=True)
        return F.linear(y.transpose(1, 2), out_proj_weight, out_proj_bias)

    return "mamba_inner_fn", mamba_inner


def fused_mamba2(module):
    scan = module.mamba2_chunk_scan  # HF's torch chunked scan

    def split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                   initial_states=None, dt_limit=(0.0, float("inf")), return_final_states=False,
                                   activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                                   outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True, **kwargs):
        batch, length, _ = zxbcdt.shape
        d_inner, heads, conv_dim = outproj_weight.shape[1], dt_bias.shape[0], conv1d_weight.shape[0]
        state = (conv_dim - d_inner) // (2 * ngroups)
        z, xbc, dt = zxbcdt.split([d_inner, conv_dim, heads], dim=-1)
        xbc = F.silu(F.conv1d(xbc.transpose(1, 2), conv1d_weight.unsqueeze(1), conv1d_bias,
                              padding=conv1d_weight.shape[-1] - 1, groups=conv_dim)[..., :length]).transpose(1, 2)
        x, B, C = xbc.split([d_inner, ngroups * state, ngroups * state], dim=-1)
        y = scan(x.reshape(batch, length, heads, headdim), dt, A, B.reshape(batch, length, ngroups, state),
                 C.reshape(batch, length, ngroups, state), chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
                 dt_limit=dt_limit).reshape(batch, length, d_inner)
        y = y * F.silu(z)  # norm_before_gate=False: gate first
        if rmsnorm_weight is not None:
            grouped = y.reshape(batch, length, ngroups, -1)
            y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + rmsnorm_eps)).reshape_as(y)
            y = y * rmsnorm_weight
        return F.linear(y, outproj_weight, outproj_bias)

    return "mamba2_split_conv1d_scan_combined", split_conv1d_scan_combined


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "mamba2", "bamba", "zamba2", "nemotron_h",
                                    "falcon_h1", "granitemoehybrid"])
def test_fused_training_path_gives_the_same_maps(family, monkeypatch):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name, fused = (fused_mamba1 if family in MAMBA1 else fused_mamba2)(module)
    calls = []
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or fused(*a, **k))
    model = liven(make_model(family))
    ids = torch.randint(3, VOCAB, (2, 10))
    expected = {f: mc.implicit_attention(model, ids, formulation=f) for f in ("unified", "hidden")}
    if family == "falcon_mamba":  # its fused kernel normalises dt after dt_proj: a different model (see adapter)
        expected = {f: mc.implicit_attention(model.train(), ids, formulation=f) for f in expected}
        model.eval()
    else:
        assert not calls
    model.train()
    before = model_state(model)
    for formulation, reference in expected.items():
        got = mc.implicit_attention(model, ids, formulation=formulation)
        assert got.keys() == reference.keys()
        assert all(relative_error(got[k], reference[k]) < 1e-5 for k in got), formulation
    assert calls  # the fused path really ran
    ids, mask = padded_batch(10)  # with padding the fused kernels differ from eval; the operator follows them
    mc.implicit_attention(model, ids, mask)
    assert_untouched(model, before)
    assert model.training


def test_no_grad_state_and_grad_mode_preserved():
    model = make_model("mamba")
    with torch.enable_grad():
        mc.implicit_attention(model, torch.randint(3, VOCAB, (1, 4)))
        assert torch.is_grad_enabled()


def test_banded_maps_without_s6_equal_the_toeplitz_operator_and_reduce_exactly():
    from mamba_captum.operators import banded_maps

    row, col, taps = torch.randn(2, 7, 5), torch.randn(2, 7, 5), torch.randn(5, 4)
    toeplitz = torch.zeros(5, 7, 7)  # M_c[t, s] = w_c[K-1-(t-s)]
    for t in range(7):
        for s in range(max(0, t - 3), t + 1):
            toeplitz[:, t, s] = taps[:, 3 - (t - s)]
    full = banded_maps(row, col, taps, reduce=None)
    assert torch.allclose(full, (row * col).transpose(1, 2)[..., None] * toeplitz)
    for reduce, fn in (("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1)),
                       ("abs_mean", lambda t: t.abs().mean(1))):
        assert torch.allclose(banded_maps(row, col, taps, reduce=reduce), fn(full), atol=1e-6)
        assert torch.allclose(banded_maps(row, col, taps, torch.tensor([6, 0]), reduce), fn(full)[:, [6, 0]],
                              atol=1e-6)
