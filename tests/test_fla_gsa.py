"""flash-linear-attention's gated slot attention (GSA): the torch versions of ``chunk_gsa`` / ``fused_recurrent_gsa``
(:mod:`mamba_captum.fla_cpu.ops_gsa`) against fla's own ``naive_recurrent_gsa`` run in float64 (outputs, both final
states, gradients, shared key heads, packed sequences), and the ``GatedSlotAttention`` adapter, whose o_proj runs
inside fla's fused ``rms_norm_linear`` (so the generic o_proj-hook tests cannot read it): readout(H x) equals the
layer's output, the hidden maps equal an impulse reference through fla's naive op on the recorded op inputs, batches
equal single examples, and a CPU training step runs through the ops.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla_models import (OpRecorder, _fla_naive_float64, assert_batch_equals_single_examples, common_config,
                        fla_mixers, fla_models, one_hot_values, padded_batch, run_hooked, scale_up_mixer_weights)
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from mamba_captum.fla_cpu import ops_gsa

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import fla.ops.gsa as fla_gsa  # its ops read at call time: fla_on_cpu() swaps the names fla's modules hold
    from fla.ops.gsa.naive import naive_recurrent_gsa


def _randn(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def gsa_inputs(seed=0, batch=2, length=9, query_heads=2, key_heads=2, key_dim=4, value_dim=3, slots=5):
    """float64 (q, k, v, s, g, (Hk0, Hv0)) in fla's layout; g = logsigmoid of a normal, ≤ 0."""
    g = torch.Generator().manual_seed(seed)
    q = _randn(g, batch, length, query_heads, key_dim)
    k, v = _randn(g, batch, length, key_heads, key_dim), _randn(g, batch, length, key_heads, value_dim)
    s, gate = _randn(g, batch, length, key_heads, slots), F.logsigmoid(_randn(g, batch, length, key_heads, slots))
    state = (_randn(g, batch, key_heads, key_dim, slots), _randn(g, batch, key_heads, slots, value_dim))
    return q, k, v, s, gate, state


def naive(q, k, v, s, g, scale, state, output_final_state=True):
    """fla's ``naive_recurrent_gsa`` in float64."""
    return _fla_naive_float64(naive_recurrent_gsa, q, k, v, s, g, scale=scale, initial_state=state,
                              output_final_state=output_final_state)


# -- the ops -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["chunk_gsa", "fused_recurrent_gsa"])
def test_gsa_ops_equal_fla_naive_reference_with_states_and_gradients(op):
    q, k, v, s, g, (hk0, hv0) = gsa_inputs()
    weights = _randn(torch.Generator().manual_seed(9), *v.shape)
    ours = [t.clone().requires_grad_(True) for t in (q, k, v, s, g, hk0, hv0)]
    theirs = [t.clone().requires_grad_(True) for t in (q, k, v, s, g, hk0, hv0)]
    with mc.fla_on_cpu():
        o, (hk, hv) = getattr(fla_gsa, op)(*ours[:5], scale=0.7, initial_state=tuple(ours[5:]), output_final_state=True)
    o_ref, (hk_ref, hv_ref) = naive(*theirs[:5], 0.7, tuple(theirs[5:]))
    assert o.dtype == torch.float64
    for got, want in ((o, o_ref), (hk, hk_ref), (hv, hv_ref)):
        assert relative_error(got, want) <= 1e-12
    ((o * weights).sum() + hk.sum() + hv.square().sum()).backward()
    ((o_ref * weights).sum() + hk_ref.sum() + hv_ref.square().sum()).backward()
    for got, want in zip(ours, theirs):
        assert relative_error(got.grad, want.grad) <= 1e-11


def test_gsa_without_gates_normalises_the_slots_as_abc():
    """g=None: the slot logits through fla's additive gate (its decay in float32, as fla's op keeps it)."""
    q, k, v, s, _, _ = gsa_inputs(seed=1)
    with mc.fla_on_cpu():
        o, (hk, hv) = fla_gsa.chunk_gsa(q, k, v, s, output_final_state=True)
    o_ref, (hk_ref, hv_ref) = naive(q, k, v, s, None, None, None)
    for got, want in ((o, o_ref), (hk, hk_ref), (hv, hv_ref)):
        assert relative_error(got, want) <= 1e-6  # float32 gates: 1e-7, not float64's 1e-15
        assert relative_error(got, want) > 0


def test_gsa_shared_key_heads_equal_the_reference():
    """Four query heads on two key heads (fla's GQA): keys, values, slots and gates repeated per query head."""
    q, k, v, s, g, state = gsa_inputs(seed=2, query_heads=4, key_heads=2)
    for op in ("chunk_gsa", "fused_recurrent_gsa"):
        with mc.fla_on_cpu():
            o, (hk, hv) = getattr(fla_gsa, op)(q, k, v, s, g, initial_state=state, output_final_state=True)
        o_ref, (hk_ref, hv_ref) = naive(q, k, v, s, g, None, state)
        assert hk.shape == state[0].shape and hv.shape == state[1].shape
        for got, want in ((o, o_ref), (hk, hk_ref), (hv, hv_ref)):
            assert relative_error(got, want) <= 1e-12


def test_gsa_packed_sequences_equal_each_sequence():
    q, k, v, s, g, (hk0, hv0) = gsa_inputs(seed=3, batch=3, length=7)
    lengths, cu_seqlens = [7, 0, 5], torch.tensor([0, 7, 7, 12])
    pack = lambda t: torch.cat([t[0, :7], t[2, :5]])[None]  # noqa: E731  (sequence 1 is empty)
    with mc.fla_on_cpu():
        o, (hk, hv) = fla_gsa.chunk_gsa(*(pack(t) for t in (q, k, v, s, g)), initial_state=(hk0, hv0),
                                output_final_state=True, cu_seqlens=cu_seqlens)
    start = 0
    for n, length in enumerate(lengths):
        part = slice(n, n + 1)
        if length:
            o_ref, (hk_ref, hv_ref) = naive(*(t[part, :length] for t in (q, k, v, s, g)), None,
                                            (hk0[part], hv0[part]))
            assert relative_error(o[:, start:start + length], o_ref) <= 1e-12
        else:  # an empty sequence keeps its initial states
            hk_ref, hv_ref = hk0[part], hv0[part]
        assert relative_error(hk[part], hk_ref) <= 1e-12 and relative_error(hv[part], hv_ref) <= 1e-12
        start += length


def test_gsa_refusals_name_the_argument():
    q, k, v, s, g, _ = gsa_inputs(length=4)
    with mc.fla_on_cpu(), pytest.raises(NotImplementedError, match="reverse"):
        fla_gsa.fused_recurrent_gsa(q, k, v, s, g, reverse=True)
    with pytest.raises(NotImplementedError, match="unknown_option"):
        ops_gsa.chunk_gsa(q, k, v, s, g, unknown_option=1)
    with pytest.raises(ValueError, match="power of 2"):
        ops_gsa.chunk_gsa(q, k, v, s, g, chunk_size=12)


# -- the adapter -------------------------------------------------------------------------------------------------------
# name -> tiny GSAConfig kwargs (its misspelled ``exapnd_k`` / ``exapnd_v`` left at 1: key and value widths = hidden)
MODELS = {
    "gsa": common_config(num_heads=2, num_slots=6),
    "gsa_conv": common_config(num_heads=2, num_slots=6, use_short_conv=True, conv_size=4),
    "gsa_gqa_relu": common_config(num_heads=4, num_kv_heads=2, num_slots=4, feature_map="relu"),
    "gsa_gqa_conv_t2r": common_config(num_heads=4, num_kv_heads=2, num_slots=4, feature_map="t2r",
                                      use_short_conv=True, conv_size=3),
}
OPS = ("chunk_gsa", "fused_recurrent_gsa")


def make_model(name, dtype=torch.float64, seed=0, **overrides):
    """The tiny model ``name`` of :data:`MODELS` (eval mode), its layers' 2-D weights redrawn larger."""
    config = fla_models.GSAConfig(**{**MODELS[name], **overrides})
    torch.manual_seed(seed)
    return scale_up_mixer_weights(AutoModelForCausalLM.from_config(config).to(dtype).eval(), seed)


def records_of(model, ids, mask):
    """(x: v_proj's output (B, L, C) with the pads' rows zero, the mixer's output (B, L, D)) of each mixer, by hooks."""
    records, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.v_proj.register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=out.detach().clone())))
        handles.append(mixer.register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(out=out[0].detach())))
    run_hooked(model, ids, mask, handles)
    real = mask.bool()
    for record in records.values():  # fla unpacked the batch: the hook saw the real tokens packed
        x = record["x"].double().reshape(-1, record["x"].shape[-1])
        record["x"] = torch.zeros(*ids.shape, x.shape[-1], dtype=torch.float64).index_put_((real,), x)
    return records


@pytest.mark.parametrize("name,dtype", [(name, torch.float64) for name in MODELS]
                         + [("gsa", torch.float32), ("gsa_conv", torch.float32)])
def test_unified_readout_of_H_x_equals_the_layer_output(name, dtype):
    model = make_model(name, dtype)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    operators = list(mc.build_operators(model, ids, mask, formulation="unified")[0].values())
    records = records_of(model, ids, mask)
    real = mask.bool()
    for mixer, op in zip(fla_mixers(model), operators):
        x = records[mixer]["x"]
        groups = mixer.num_kv_groups  # values shared by query heads: H reads each head's copy
        x = x.reshape(*x.shape[:2], -1, mixer.head_v_dim).repeat_interleave(groups, dim=2).flatten(2)
        H = op.maps(reduce=None).double()  # (B, C, L, L)
        got = op.readout(torch.einsum("bcis,bsc->bic", H, x).reshape(op.output.shape))
        expected = records[mixer]["out"].double()
        assert relative_error(got[real], expected[real]) <= (1e-10 if dtype == torch.float64 else 3e-5), name
    assert_untouched(model, before)


def gsa_impulse(kwargs):
    """α (B, H, T, T) of fla's GSA op from its recorded inputs: ``naive_recurrent_gsa`` in float64 on one-hot values
    (the output for v = e_s is column s), zero state."""
    q, k, s, g = (kwargs[name].double() for name in ("q", "k", "s", "g"))
    batch, length, heads, _ = k.shape
    out, _ = naive(q, k, one_hot_values(batch, length, heads), s, g, kwargs["scale"], None, False)
    return out.permute(0, 2, 1, 3)


@pytest.mark.parametrize("name", ["gsa_conv", "gsa_gqa_relu"])
def test_hidden_maps_equal_the_impulse_reference(name):
    model = make_model(name)
    ids = padded_batch(length=10)[0]
    with mc.fla_on_cpu(), OpRecorder(model, OPS) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators = list(mc.build_operators(model, ids, None, formulation="hidden")[0].values())
    assert len(recorder.calls) == len(operators) == 2
    for op, (_, kwargs, out) in zip(operators, recorder.calls):
        alpha = op.maps(reduce=None)  # (B, H, L, L)
        assert relative_error(alpha, gsa_impulse(kwargs)) <= 1e-10, name
        got = torch.einsum("bhts,bshp->bthp", alpha, kwargs["v"].double())
        assert relative_error(got, out.double()) <= 1e-10


@pytest.mark.parametrize("name,left", [("gsa_conv", True), ("gsa_conv", False), ("gsa_gqa_conv_t2r", True)])
@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_batch_equals_single_examples_and_padding_equals_none(name, left, formulation):
    model = make_model(name)
    assert_batch_equals_single_examples(model, *padded_batch(length=12, left=left), formulation=formulation)


def test_a_cpu_training_step_runs_the_chunked_op():
    """With more than 64 tokens the layer takes ``chunk_gsa`` (fla's mode switch); a training step gives every mixer
    weight a finite, non-zero gradient."""
    model = make_model("gsa_conv", num_hidden_layers=1)
    ids = torch.randint(3, 64, (1, 70), generator=torch.Generator().manual_seed(0))
    model.train()
    with mc.fla_on_cpu(), OpRecorder(model, OPS) as recorder:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    assert [name for name, _, _ in recorder.calls] == ["chunk_gsa"]
    grads = [p.grad for m in fla_mixers(model) for p in m.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(float(g.abs().sum()) > 0 for g in grads)


def test_a_value_conv_bias_is_refused_for_unified_only():
    """Biased convs: unified is refused (affine in the values); hidden is exact, the pads' biased keys and values
    zeroed (fla drops the pads, which then write nothing into the states)."""
    model = make_model("gsa_conv", num_hidden_layers=1)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = getattr(fla_mixers(model)[0], name)
        conv.bias = torch.nn.Parameter(torch.ones(conv.weight.shape[0], dtype=torch.float64))
    ids, mask = padded_batch(length=10)
    with pytest.raises(NotImplementedError, match="value conv has a bias"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")
    maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")  # the bias: a token's own
    assert len(maps) == 1 and all(torch.isfinite(m).all() for m in maps.values())


# -- Raven: the same ops with routed slots -----------------------------------------------------------------------------
RAVEN_MODELS = {
    # Mamba-2 decays, σ router (top 3 of 6 renormalised), one fused RMS norm over the width
    "raven": common_config(num_heads=2, num_slots=6, topk=3),
    # GLA decays per slot, softmax router, the fused gated norm per head
    "raven_gla_gate": common_config(num_heads=2, num_slots=6, topk=3, decay_type="GLA", router_score="softmax",
                                    use_output_gate=True),
    # shared key heads, rotary q / k, relu feature map, an MLP router with a routing bias, unfused nn.RMSNorm
    "raven_gqa_rope": common_config(num_heads=4, num_kv_heads=2, num_slots=4, topk=2, use_rope=True,
                                    feature_map="relu", router_type="mlp", bias_rmm=True, fuse_norm=False),
    "raven_unfused_gate": common_config(num_heads=2, num_slots=6, topk=2, fuse_norm=False, use_output_gate=True),
}


def make_raven(name, dtype=torch.float64, seed=0, gate_fn=None, **overrides):
    """The tiny Raven model ``name`` of :data:`RAVEN_MODELS` (eval mode), its layers' 2-D weights redrawn larger
    (and the routing bias drawn, so that it changes the top k); ``gate_fn``: each layer rebuilt with that activation
    (the model's own MLP takes swish only)."""
    config = fla_models.RavenConfig(**{**RAVEN_MODELS[name], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if gate_fn is not None:
        from fla.layers import Raven
        for index, layer in enumerate(model.model.layers):
            layer.attn = Raven(hidden_size=config.hidden_size, num_heads=config.num_heads,
                               num_slots=config.num_slots, topk=config.topk, gate_fn=gate_fn, layer_idx=index)
    model = scale_up_mixer_weights(model.to(dtype).eval(), seed)
    with torch.no_grad():
        for mixer in fla_mixers(model):
            if mixer.bias_rmm:
                mixer.r_bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("name,dtype", [(name, torch.float64) for name in RAVEN_MODELS]
                         + [("raven", torch.float32), ("raven_gla_gate", torch.float32)])
def test_raven_unified_readout_of_H_x_equals_the_layer_output(name, dtype):
    model = make_raven(name, dtype)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    operators = list(mc.build_operators(model, ids, mask, formulation="unified")[0].values())
    records = records_of(model, ids, mask)
    real = mask.bool()
    for mixer, op in zip(fla_mixers(model), operators):
        x = records[mixer]["x"]
        x = x.reshape(*x.shape[:2], -1, mixer.head_v_dim).repeat_interleave(mixer.num_kv_groups, dim=2).flatten(2)
        H = op.maps(reduce=None).double()  # (B, C, L, L)
        got = op.readout(torch.einsum("bcis,bsc->bic", H, x).reshape(op.output.shape))
        expected = records[mixer]["out"].double()
        assert relative_error(got[real], expected[real]) <= (1e-10 if dtype == torch.float64 else 3e-5), name
    assert_untouched(model, before)


@pytest.mark.parametrize("name", ["raven", "raven_gqa_rope"])
def test_raven_hidden_maps_equal_the_impulse_reference(name):
    model = make_raven(name)
    ids = padded_batch(length=10)[0]
    with mc.fla_on_cpu(), OpRecorder(model, OPS) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators = list(mc.build_operators(model, ids, None, formulation="hidden")[0].values())
    assert len(recorder.calls) == len(operators) == 2
    for op, (_, kwargs, out) in zip(operators, recorder.calls):
        routed_off = (kwargs["s"] == 0).double().mean()  # slots off the top k: no write, no decay
        assert 0 < routed_off < 1
        alpha = op.maps(reduce=None)
        assert relative_error(alpha, gsa_impulse(kwargs)) <= 1e-10, name
        got = torch.einsum("bhts,bshp->bthp", alpha, kwargs["v"].double())
        assert relative_error(got, out.double()) <= 1e-10


@pytest.mark.parametrize("name,left", [("raven", True), ("raven", False), ("raven_gqa_rope", True)])
@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_raven_batch_equals_single_examples_and_padding_equals_none(name, left, formulation):
    model = make_raven(name)
    assert_batch_equals_single_examples(model, *padded_batch(length=12, left=left), formulation=formulation)


def test_raven_value_activations_relu_exact_and_sigmoid_hidden_only():
    """relu's gain is the step x > 0 (unified exact); sigmoid is no gain times its input: unified refused by name,
    hidden exact."""
    ids, mask = padded_batch(length=10)
    model = make_raven("raven", num_hidden_layers=1, gate_fn="relu")
    for formulation in ("hidden", "unified"):
        maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
        assert len(maps) == 1 and all(torch.isfinite(m).all() for m in maps.values())
    model = make_raven("raven", num_hidden_layers=1, gate_fn="sigmoid")
    with pytest.raises(NotImplementedError, match="gate_fn 'SigmoidFunction'"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")
    maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")
    assert len(maps) == 1 and all(torch.isfinite(m).all() for m in maps.values())


def test_raven_cpu_training_step_runs_and_gumbel_routing_is_refused():
    """A training step (Gumbel noise in the routing, the chunked op past 64 tokens) gives every mixer weight a
    finite gradient; explaining the model in training mode is refused by name (its routing is random)."""
    model = make_raven("raven_gla_gate", num_hidden_layers=1)
    ids = torch.randint(3, 64, (1, 70), generator=torch.Generator().manual_seed(0))
    model.train()
    with mc.fla_on_cpu(), OpRecorder(model, OPS) as recorder:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    assert [name for name, _, _ in recorder.calls] == ["chunk_gsa"]
    grads = [p.grad for m in fla_mixers(model) for p in m.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    with pytest.raises(NotImplementedError, match="add_gumbel_noise"):
        mc.implicit_attention(model, ids[:, :10])
