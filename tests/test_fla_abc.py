"""flash-linear-attention's ABC (``ABCAttention``, model type ``abc``): the torch ``chunk_abc`` of fla_on_cpu against
fla's own ``naive_recurrent_abc`` run in float64 (outputs, final slot memories, gradients; across a chunk boundary),
and the adapter (mamba_captum.families.fla_abc).

ABC does not unpad a masked batch (it zeroes the pads' values only, so the generic tests/test_fla_families.py, which
reads packed hooks on a left-padded batch, does not apply): here the unified operator reproduces o_proj's input
(H x against the test's own hooks, right padding), the hidden maps equal the impulse response of fla's naive op on
the recorded op inputs, right-padded batches equal single examples, left padding is refused, a CPU training step
runs, and the variants of the layer (short convs, no norm, no output gate, the input gate, no rotary) rebuild.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from conftest import relative_error
from fla_models import (VOCAB, OpRecorder, assert_a_cpu_training_step_matches_eval, assert_batch_equals_single_examples,
                        common_config, fla_mixers, fla_models, one_hot_values, run_hooked, scale_up_mixer_weights)
from test_engine import assert_untouched, model_state
from test_kernel_delta_rule_states import Float64
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from mamba_captum.fla_cpu import checks
from mamba_captum.fla_cpu.ops_abc import chunk_abc

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fla.layers import ABCAttention
    from fla.ops.abc.naive import naive_recurrent_abc


def _randn(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def naive_abc(q, k, v, s, initial_state=None, output_final_state=False):
    """fla's ``naive_recurrent_abc`` in float64 (its float32 casts kept float64), in the op's (B, T, H, ·) layout."""
    head_first = lambda x: x.transpose(1, 2)  # noqa: E731
    with Float64():
        o, state = naive_recurrent_abc(head_first(q), head_first(k), head_first(v), head_first(s),
                                       initial_state=initial_state, output_final_state=output_final_state)
    return head_first(o), state


def abc_inputs(length, seed=0):
    """q, k (B, T, H, K), v (B, T, H, V), s (B, T, H, M) with logits spread over ±6, and an initial pair, float64."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = _randn(g, 2, length, 2, 4), _randn(g, 2, length, 2, 4), _randn(g, 2, length, 2, 3)
    s = 3.0 * _randn(g, 2, length, 2, 5)
    state = (_randn(g, 2, 2, 4, 5), _randn(g, 2, 2, 5, 3))
    return q, k, v, s, state


@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_abc_equals_fla_naive_with_final_states_and_gradients(with_state):
    """70 tokens: two chunks of the kernels. Gradients of a random projection of the output and both final memories
    with respect to q, k, v, s and the initial memories."""
    q, k, v, s, state = abc_inputs(70)
    g = torch.Generator().manual_seed(1)
    weights = (_randn(g, *v.shape), _randn(g, 2, 2, 4, 5), _randn(g, 2, 2, 5, 3))
    results = []
    for op in (chunk_abc, naive_abc):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, s, *state)]
        o, (key_memory, value_memory) = op(*inputs[:4], initial_state=tuple(inputs[4:]) if with_state else None,
                                           output_final_state=True)
        loss = sum((out * w).sum() for out, w in zip((o, key_memory, value_memory), weights))
        grads = torch.autograd.grad(loss, inputs if with_state else inputs[:4])
        results.append((o, key_memory, value_memory, *grads))
    ours, reference = results
    assert ours[0].dtype == torch.float64 and ours[1].dtype == torch.float64
    for got, expected in zip(ours, reference):
        assert relative_error(got, expected) <= 1e-12


def test_chunk_abc_low_precision_computes_in_float32_and_returns_the_value_dtype():
    q, k, v, s, state = abc_inputs(20)
    expected, _ = naive_abc(q, k, v, s, initial_state=state)
    o, final = chunk_abc(*(t.float() for t in (q, k, v, s)), initial_state=tuple(t.float() for t in state))
    assert o.dtype == torch.float32 and final is None
    assert relative_error(o, expected) <= 1e-5
    o, _ = chunk_abc(*(t.bfloat16() for t in (q, k, v, s)))
    assert o.dtype == torch.bfloat16 and relative_error(o, naive_abc(q, k, v, s)[0]) <= 3e-2


def test_the_swap_check_probe_accepts_chunk_abc_and_the_layer_calls_it():
    key = "fla.ops.abc.chunk.chunk_abc"
    assert checks.probe_difference(key, chunk_abc) <= checks.TOLERANCE
    import fla.layers.abc as layer_module
    q, k, v, s, _ = abc_inputs(9)
    with mc.fla_on_cpu():
        o, _ = layer_module.chunk_abc(q, k, v, s)  # fla's name, the torch version on CPU tensors
    assert relative_error(o, naive_abc(q, k, v, s)[0]) <= 1e-12


# -- the adapter -------------------------------------------------------------------------------------------------------
def replaced_layer(**options):
    """A replacement of each block's ABCAttention with ``options`` (ABCConfig does not pass them to the layer)."""
    def build(config, layer_idx):
        return ABCAttention(hidden_size=config.hidden_size, num_heads=config.num_heads, num_slots=config.num_slots,
                            norm_eps=config.norm_eps, layer_idx=layer_idx, **options)
    return build


# name -> (the config's tiny kwargs, a replacement layer builder or None)
MODELS = {
    "abc": (common_config(num_heads=2, num_slots=4), None),
    "abc_conv": (common_config(num_heads=2, num_slots=4, use_short_conv=True, conv_size=4), None),
    "abc_no_norm_input_gate": (common_config(num_heads=2, num_slots=4),
                               replaced_layer(use_norm=False, use_input_gate=True, use_rope=False)),
    "abc_norm_only": (common_config(num_heads=2, num_slots=3), replaced_layer(use_output_gate=False)),
}


def make_model(name, dtype=torch.float64, seed=0, **overrides):
    """The tiny ABC model ``name`` (eval mode), its layers' 2-D weights redrawn larger (fla's init gives tiny
    gates)."""
    kwargs, replacement = MODELS[name]
    config = fla_models.ABCConfig(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if replacement is not None:
        for index, layer in enumerate(model.model.layers):
            layer.attn = replacement(config, index)
    return scale_up_mixer_weights(model.to(dtype).eval(), seed)


def right_padded_batch(length=12, pads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    ids[0, length - pads:], mask[0, length - pads:] = 0, 0
    return ids, mask


def records_of(model, ids, mask):
    """(x: v_proj's output before fla masks it in place, o_proj's input) of each mixer, by the test's hooks."""
    records, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.v_proj.register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=out.detach().clone())))
        handles.append(mixer.o_proj.register_forward_pre_hook(
            lambda mod, args, mixer=mixer: records.setdefault(mixer, {}).update(out_in=args[0].detach())))
    run_hooked(model, ids, mask, handles)
    return records


@pytest.mark.parametrize("name,dtype", [("abc", torch.float64), ("abc", torch.float32), ("abc_conv", torch.float64),
                                        ("abc_conv", torch.float32), ("abc_no_norm_input_gate", torch.float64),
                                        ("abc_norm_only", torch.float64)])
def test_unified_identity_out_proj_input_equals_H_x(name, dtype):
    model = make_model(name, dtype)
    ids, mask = right_padded_batch()
    before = model_state(model)
    operators = list(mc.build_operators(model, ids, mask, formulation="unified")[0].values())
    records = records_of(model, ids, mask)
    mixers = fla_mixers(model)
    assert len(operators) == len(mixers) == 2
    real = mask.bool()
    for mixer, op in zip(mixers, operators):
        x, expected = records[mixer]["x"].double(), records[mixer]["out_in"].double()
        H = op.maps(reduce=None).double()  # (B, C, L, L), pad rows and columns zero
        got = torch.einsum("bcis,bsc->bic", H, x)
        assert relative_error(got[real], expected[real]) <= (1e-5 if dtype == torch.float64 else 3e-5), name
        assert expected.abs().max() > 1e-3
    assert_untouched(model, before)


def abc_impulse(kwargs):
    """α (B, H, T, T) of fla's ABC op from its recorded inputs: fla's naive op on one-hot values, zero state."""
    q, k, s = (kwargs[name].double() for name in ("q", "k", "s"))
    batch, length, heads, _ = q.shape
    return naive_abc(q, k, one_hot_values(batch, length, heads), s)[0].permute(0, 2, 1, 3)


@pytest.mark.parametrize("name", ["abc", "abc_conv"])
def test_hidden_maps_equal_the_naive_op_impulse_response(name):
    model = make_model(name)
    ids = right_padded_batch(length=10)[0]
    with mc.fla_on_cpu(), OpRecorder(model, ("chunk_abc",)) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators = list(mc.build_operators(model, ids, None, formulation="hidden")[0].values())
    assert len(recorder.calls) == len(operators) == 2
    for op, (_, kwargs, out) in zip(operators, recorder.calls):
        alpha = op.maps(reduce=None)  # (B, H, L, L): one map per head
        assert relative_error(alpha, abc_impulse(kwargs)) <= 1e-9, name
        got = torch.einsum("bhts,bshp->bthp", alpha, kwargs["v"].double())
        assert relative_error(got, out.double()) <= 1e-9


@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_right_padded_batch_equals_single_examples_and_left_padding_is_refused(formulation):
    model = make_model("abc_conv")
    ids, mask = right_padded_batch()
    assert_batch_equals_single_examples(model, ids, mask, formulation=formulation)
    left = mask.flip(1)
    with pytest.raises(ValueError, match="ABCAttention.*left padding"):
        mc.implicit_attention(model, ids, attention_mask=left, formulation=formulation)


def test_a_cpu_training_step_runs_and_matches_eval():
    model = make_model("abc", num_hidden_layers=1)
    assert_a_cpu_training_step_matches_eval(model, right_padded_batch(length=10)[0], 1e-12)


def test_refusals_name_what_is_not_supported():
    model = make_model("abc_conv", num_hidden_layers=1)
    conv = fla_mixers(model)[0].v_conv1d
    conv.bias = torch.nn.Parameter(torch.ones(conv.weight.shape[0], dtype=torch.float64))
    ids, mask = right_padded_batch(length=8)
    with pytest.raises(NotImplementedError, match="value conv has a bias"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")
    mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")  # the bias is a token's own input
    model = make_model("abc_conv", num_hidden_layers=1)
    fla_mixers(model)[0].use_input_gate = True
    with pytest.raises(NotImplementedError, match="use_input_gate"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")
    mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")
