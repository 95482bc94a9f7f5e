"""flash-linear-attention's Rodimus (mamba_captum.families.fla_rodimus), run on CPU through fla_on_cpu(): the unified
operator reproduces the layer (H x against the test's own hooks on up_proj and down_proj, the conv bias's share added
by the readout), the hidden maps equal an impulse through fla's own naive GLA op, batches equal single examples,
pads equal none, a CPU training step runs, and Rodimus+ (sliding-window softmax attention) is refused by name.

Rodimus' output projection is ``down_proj`` (not ``o_proj``), so the generic tests of tests/test_fla_families.py cannot
hook it: these are their equivalents."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla_models import (OpRecorder, assert_a_cpu_training_step_matches_eval, assert_batch_equals_single_examples,
                        fla_mixers, fla_models, gla_impulse, padded_batch, run_hooked, scale_up_mixer_weights)
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc

# fla's RodimusBlock asserts a residual from layer 1 on whenever residual_in_fp32 (its default) is set, which only
# the model's block_residual_in_fp32 passes on: the two are set together
TINY = dict(block_type="rodimus", vocab_size=64, hidden_size=32, num_hidden_layers=2, expand_ratio=8,
            block_residual_in_fp32=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, fuse_cross_entropy=False)
VARIANTS = {
    "rodimus": {},  # a SiLU short conv with a bias (fla's block always builds one), sx cast to float32
    "rodimus_noconv": dict(use_short_conv=False),  # the parallel path r ⊙ x: a diagonal
    "rodimus_fp64_residual": dict(residual_in_fp32=False, block_residual_in_fp32=False),
}
GLA_OPS = ("chunk_gla", "fused_recurrent_gla")


def make_model(name, dtype=torch.float64, seed=0, conv_bias=True, **overrides):
    """The tiny Rodimus model ``name`` (eval mode), its mixers' 2-D weights redrawn larger (fla's init gives tiny
    gates) and the short convs' biases (fla's init: zeros) drawn from N(0, 0.5²); ``conv_bias=False`` drops those
    biases (the unified operator is then linear)."""
    config = fla_models.RodimusConfig(**{**TINY, **VARIANTS[name], **overrides})
    torch.manual_seed(seed)
    model = scale_up_mixer_weights(AutoModelForCausalLM.from_config(config).to(dtype).eval(), seed)
    generator = torch.Generator().manual_seed(seed)
    for mixer in fla_mixers(model):
        if mixer.use_short_conv and not conv_bias:
            mixer.short_conv.bias = None
        elif mixer.use_short_conv:
            with torch.no_grad():
                mixer.short_conv.bias.normal_(0.0, 0.5, generator=generator)
    return model


def hooked(model, ids, mask):
    """Per mixer: x (up_proj's output), u (down_proj's input), out (the mixer's output), as (B, L, ·) float64 with
    zeros at the pads (fla unpads a masked batch: the hooks see the real tokens packed)."""
    records, handles = {}, []
    for mixer in fla_mixers(model):
        def put(key, value, mixer=mixer):
            records.setdefault(mixer, {})[key] = value.detach().double()

        handles += [mixer.up_proj.register_forward_hook(lambda m, a, out, put=put: put("x", out)),
                    mixer.down_proj.register_forward_pre_hook(lambda m, a, put=put: put("u", a[0])),
                    mixer.register_forward_hook(lambda m, a, out, put=put: put("out", out[0]))]
    run_hooked(model, ids, mask, handles)
    real = mask.bool()
    for record in records.values():
        for key, value in record.items():
            if value.shape[:2] != ids.shape:
                record[key] = torch.zeros(*ids.shape, value.shape[-1], dtype=torch.float64).index_put_(
                    (real,), value.reshape(-1, value.shape[-1]))
    return [records[mixer] for mixer in fla_mixers(model)]


def unified_operators(model, ids, mask):
    return list(mc.build_operators(model, ids, mask, formulation="unified")[0].values())


@pytest.mark.parametrize("name,dtype", [(name, torch.float64) for name in VARIANTS]
                         + [("rodimus", torch.float32), ("rodimus_noconv", torch.float32)])
def test_unified_readout_of_H_x_equals_the_layer_output(name, dtype):
    """H x plus the conv bias's share (the readout) is down_proj's output; without a conv H x is down_proj's input."""
    model = make_model(name, dtype)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    operators = unified_operators(model, ids, mask)
    records = hooked(model, ids, mask)
    assert len(operators) == len(records) == 2
    tolerance = 1e-6 if dtype == torch.float64 else 3e-5
    real = mask.bool()
    for record, op in zip(records, operators):
        H = op.maps(reduce=None).double()  # (B, C, L, L)
        assert H.shape[1] == record["x"].shape[-1]
        Hx = torch.einsum("bcis,bsc->bic", H, record["x"])
        got = op.readout(Hx.reshape(op.output.shape))
        assert relative_error(got[real], record["out"][real]) <= tolerance, name
        if name == "rodimus_noconv":  # no bias: linear, H x is down_proj's input itself
            assert relative_error(Hx[real], record["u"][real]) <= tolerance
    assert_untouched(model, before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_without_the_conv_bias_down_proj_input_is_H_x(dtype):
    """The parallel SiLU-conv path is a band of H: with the conv's bias gone, y = H x exactly."""
    model = make_model("rodimus", dtype, conv_bias=False)
    ids, mask = padded_batch(length=12)
    for record, op in zip(hooked(model, ids, mask), unified_operators(model, ids, mask)):
        Hx = torch.einsum("bcis,bsc->bic", op.maps(reduce=None).double(), record["x"])
        assert relative_error(Hx, record["u"]) <= (1e-5 if dtype == torch.float64 else 3e-5)
        assert record["u"].abs().max() > 1e-3


def test_the_conv_bias_share_is_what_separates_down_proj_input_from_H_x():
    """With the bias, down_proj's input minus H x is ν silu(z) r σ(pre) b, built here from hooks: ν silu(z) is the
    gated norm's output over its input, pre the conv's pre-activation (its SiLU checked against the hooked conv)."""
    model = make_model("rodimus_fp64_residual")
    ids, mask = padded_batch(length=12)
    seen, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.short_conv.register_forward_hook(
            lambda m, a, out, mixer=mixer: seen.setdefault(mixer, {}).update(sx=out[0].detach())))
        handles.append(mixer.activation_norm.register_forward_hook(
            lambda m, a, out, mixer=mixer: seen.setdefault(mixer, {}).update(o=a[0].detach(), u=out.detach())))
    records = hooked(model, ids, mask)
    run_hooked(model, ids, mask, handles)
    real = mask.bool()
    for mixer, record, op in zip(fla_mixers(model), records, unified_operators(model, ids, mask)):
        Hx = torch.einsum("bcis,bsc->bic", op.maps(reduce=None).double(), record["x"])[real]
        o, u, sx = (seen[mixer][key].double().reshape(-1, mixer.d_inner) for key in ("o", "u", "sx"))
        pre = F.conv1d(record["x"].transpose(1, 2), mixer.short_conv.weight.double(),
                                         mixer.short_conv.bias.double(), padding=3, groups=mixer.d_inner)
        pre = pre[..., :ids.shape[1]].transpose(1, 2)[real]
        assert relative_error(F.silu(pre), sx) <= 1e-12  # the hooks' conv is this conv
        share = u / o * mixer.residual_weight.double() * torch.sigmoid(pre) * mixer.short_conv.bias.double()
        assert relative_error(u - Hx, share) <= 1e-9
        assert share.abs().max() > 1e-3


def test_hidden_maps_equal_the_naive_gla_impulse_response():
    """α is fla's GLA on its recorded q, k, g (fla's naive op on one-hot values); α v is the op's output, and the
    readout (the parallel path, the gate, the norm, down_proj) turns it into the mixer's output."""
    model = make_model("rodimus")
    ids = padded_batch(length=10)[0]
    with mc.fla_on_cpu(), OpRecorder(model, GLA_OPS) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators = list(mc.build_operators(model, ids, None, formulation="hidden")[0].values())
    records = hooked(model, ids, torch.ones_like(ids))
    assert len(recorder.calls) == len(operators) == 2
    for op, (_, kwargs, out), record in zip(operators, recorder.calls, records):
        alpha = op.maps(reduce=None)  # (B, 1, L, L): one head
        assert alpha.shape == (2, 1, 10, 10)
        assert relative_error(alpha, gla_impulse(kwargs)) <= 1e-6
        got = torch.einsum("bhts,bshp->bthp", alpha, kwargs["v"].double())
        assert relative_error(got, out.double()) <= 1e-6
        assert relative_error(op.readout(got), record["out"]) <= 1e-6


@pytest.mark.parametrize("name,left", [("rodimus", True), ("rodimus", False), ("rodimus_noconv", True)])
@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_batch_equals_single_examples_and_padding_equals_none(name, left, formulation):
    model = make_model(name, num_hidden_layers=1)
    assert_batch_equals_single_examples(model, *padded_batch(length=10, left=left), formulation=formulation)


def test_a_cpu_training_step_runs_and_every_mixer_weight_gets_a_gradient():
    model = make_model("rodimus", torch.float32, num_hidden_layers=1)
    assert_a_cpu_training_step_matches_eval(model, padded_batch(length=10)[0], 1e-6)


def test_components_switch_the_parallel_path_and_the_core():
    """Without the core (s6 off) H is σ(i) on the diagonal plus the band; without the conv the band is diagonal."""
    model = make_model("rodimus", num_hidden_layers=1)
    ids = padded_batch(length=8)[0]
    full = mc.implicit_attention(model, ids, formulation="unified", reduce=None)[0]  # (B, C, L, L)
    no_core = mc.implicit_attention(model, ids, formulation="unified", reduce=None, components={"s6": False})[0]
    band_only = no_core.clone()
    band_only.diagonal(dim1=-2, dim2=-1).zero_()
    assert torch.equal(torch.triu(no_core, diagonal=1), torch.zeros_like(no_core))
    assert torch.equal(torch.tril(no_core, diagonal=-4), torch.zeros_like(no_core))  # 4 taps: a band of width 4
    assert band_only.abs().max() > 1e-3 and (full - no_core).abs().max() > 1e-3
    no_conv = mc.implicit_attention(model, ids, formulation="unified", reduce=None,
                                    components={"s6": False, "conv": False})[0]
    assert torch.equal(no_conv, torch.diag_embed(no_conv.diagonal(dim1=-2, dim2=-1)))
    # every weight off but the input gate: H_c = diag(σ(i_c)) + diag(r_c), σ(i) from the hooked up_proj output
    bare = mc.implicit_attention(model, ids, formulation="unified", reduce=None, components={"s6": False, "conv": False,
                                 "act": False, "gate": False, "norm": False})[0]
    mixer = fla_mixers(model)[0]
    x = hooked(model, ids, torch.ones_like(ids))[0]["x"]
    low_rank, expand, _ = mixer.i_gate_proj
    with torch.no_grad():
        gate = torch.sigmoid(F.linear(F.linear(x, low_rank.weight), expand.weight, expand.bias))
        expected = gate + mixer.residual_weight  # (B, L, C)
    assert relative_error(bare, torch.diag_embed(expected.transpose(1, 2))) <= 1e-12


def test_rodimus_plus_sliding_window_attention_is_refused_by_name():
    """fla's default block adds SlidingWindowSharedKeyAttention (softmax, flash-attn only): refused, never skipped."""
    model = AutoModelForCausalLM.from_config(fla_models.RodimusConfig(
        **{**TINY, "block_type": "rodimus_plus", "num_hidden_layers": 1}, ska_attn=dict(num_heads=2, window_size=4)))
    with pytest.raises(TypeError, match="SlidingWindowSharedKeyAttention.*softmax attention"):
        mc.implicit_attention(model.double().eval(), padded_batch(length=6)[0])
