"""flash-linear-attention 0.6.0's Cyclic Flow Attention on CPU (mamba_captum.fla_cpu.ops_cyfa,
mamba_captum.families.fla_cyfa).

The op swaps ``chunk_cyfa`` / ``fused_recurrent_cyfa`` equal fla's own ``naive_recurrent_cyfa`` run in float64
(outputs, final states, the gradients of every input and of the initial state; packed sequences equal the sequences
one by one and fla's packed reference). The layer projects q, k and v with one fused ``F.linear`` (its ``v_proj``
forward never runs), so the generic tests of tests/test_fla_families.py cannot hook its values: they are written here
from the layer's input instead. The unified operator reproduces o_proj's input (y = H x), the hidden maps equal the
impulse response of fla's naive op on the recorded op inputs, batches equal single examples (left padding equals
none), a value conv with a bias is exact (hidden) or refused (unified), and a model trains on CPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla_models import (OpRecorder, common_config, fla_mixers, fla_models, padded_batch, run_hooked,
                        scale_up_mixer_weights)
from test_engine import assert_untouched, model_state
from test_kernel_delta_rule_states import Float64
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from fla.ops.cyfa.naive import naive_recurrent_cyfa
from fla.ops.cyfa.utils import _readout_basis
from mamba_captum.fla_cpu import ops_cyfa

EXACT = 1e-12
OPS = (ops_cyfa.chunk_cyfa, ops_cyfa.fused_recurrent_cyfa)
CONFIGS = {
    "conv": dict(num_heads=2, head_dim=16, num_slots=8),
    # no convs, values twice as wide as keys, 6 slots
    "no_conv": dict(num_heads=2, head_dim=8, expand_v=2.0, num_slots=6, use_short_conv=False),
}


def naive_float64(**kwargs):
    """fla's ``naive_recurrent_cyfa`` in float64: its float32 casts (Float64) and its float32 constants (the default
    dtype) made float64 while it runs, its cached float32 Fourier basis rebuilt before and after."""
    previous = torch.get_default_dtype()
    _readout_basis.cache_clear()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64():
            return naive_recurrent_cyfa(**kwargs)
    finally:
        torch.set_default_dtype(previous)
        _readout_basis.cache_clear()


def op_inputs(batch=2, length=9, heads=2, dim=4, value_dim=3, slots=6, seed=0):
    """float64 keyword arguments of a CyFA op with an initial state (clock far from 0: the phase reduction matters)."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=randn(batch, length, heads, dim), k=randn(batch, length, heads, dim),
                v=randn(batch, length, heads, value_dim), g=-0.6 * rand(batch, length, heads),
                delta=2.3 * rand(batch, length, heads), beta=rand(batch, length, heads),
                readout=randn(heads, slots - 1, slots - 1), q_norm_weight=1 + 0.2 * randn(dim),
                k_norm_weight=1 + 0.2 * randn(dim), q_norm_eps=1e-5, k_norm_eps=1e-5, scale=0.7,
                initial_state=(randn(batch, heads, dim, slots), randn(batch, heads, slots, value_dim),
                               5 * randn(batch, heads)),
                output_final_state=True)


def loss_of(out, state):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return (out * weight).sum() + 0.3 * state[0].sum() + 0.1 * state[1].square().sum() + 0.2 * state[2].sum()


# -- the op swaps ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
def test_ops_equal_fla_naive_outputs_states_and_gradients(op):
    inputs = op_inputs()
    leaves = {name: t.clone().requires_grad_() for name, t in inputs.items() if isinstance(t, torch.Tensor)}
    state = tuple(s.clone().requires_grad_() for s in inputs["initial_state"])
    args = {**inputs, **leaves, "initial_state": state}
    expected, expected_state = naive_float64(**args)
    assert expected.dtype == torch.float64 and all(s.dtype == torch.float64 for s in expected_state)
    got, got_state = op(**args)
    assert relative_error(got, expected) <= EXACT
    for mine, theirs in zip(got_state, expected_state, strict=True):
        assert relative_error(mine, theirs) <= EXACT
    wrt = [*leaves.values(), *state]
    expected_grads = torch.autograd.grad(loss_of(expected, expected_state), wrt)
    got_grads = torch.autograd.grad(loss_of(got, got_state), wrt)
    for name, mine, theirs in zip([*leaves, "Hk0", "Hv0", "λ0"], got_grads, expected_grads, strict=True):
        assert theirs.abs().max() > 1e-3, name
        assert relative_error(mine, theirs) <= 1e-11, name


def test_packed_sequences_equal_each_sequence_and_fla_packed_reference():
    inputs = op_inputs(batch=3, length=7, seed=1)
    bounds = [0, 4, 11, 21]
    pieces = [op_inputs(batch=1, length=end - start, seed=2 + n) for n, (start, end) in
              enumerate(zip(bounds[:-1], bounds[1:]))]
    packed = dict(inputs)
    for name in ("q", "k", "v", "g", "delta", "beta"):
        packed[name] = torch.cat([piece[name] for piece in pieces], dim=1)
    cu_seqlens = torch.tensor(bounds)
    out, state = ops_cyfa.chunk_cyfa(**packed, cu_seqlens=cu_seqlens)
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        single = {**packed, **{name: packed[name][:, start:end] for name in ("q", "k", "v", "g", "delta", "beta")},
                  "initial_state": tuple(s[n:n + 1] for s in inputs["initial_state"])}
        out_n, state_n = ops_cyfa.fused_recurrent_cyfa(**single)
        assert relative_error(out[:, start:end], out_n) <= EXACT
        for mine, theirs in zip(state, state_n, strict=True):
            assert relative_error(mine[n:n + 1], theirs) <= EXACT
    expected, expected_state = naive_float64(**packed, cu_seqlens=cu_seqlens)
    assert relative_error(out, expected) <= EXACT
    for mine, theirs in zip(state, expected_state, strict=True):
        assert relative_error(mine, theirs) <= EXACT


def test_float32_ops_follow_fla_float32_reference_and_refuse_what_fla_refuses():
    inputs = {name: (t.float() if isinstance(t, torch.Tensor) else t) for name, t in op_inputs().items()}
    inputs["initial_state"] = tuple(s.float() for s in op_inputs()["initial_state"])
    out, state = ops_cyfa.chunk_cyfa(**inputs)
    expected, expected_state = naive_recurrent_cyfa(**inputs)
    assert out.dtype == torch.float32 and state[0].dtype == torch.float32
    assert relative_error(out, expected) <= 1e-5
    with pytest.raises(ValueError, match="checkpoint_level"):
        ops_cyfa.chunk_cyfa(**inputs, checkpoint_level=2)
    with pytest.raises(ValueError, match="batch size 1"):
        ops_cyfa.chunk_cyfa(**inputs, cu_seqlens=torch.tensor([0, 9]))


# -- the layer ---------------------------------------------------------------------------------------------------------
def make_model(dtype=torch.float64, seed=0, **config):
    """A tiny CyFA model (2 layers, width 32) in eval mode, its mixers' 2-D weights redrawn from N(0, 0.4²)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(fla_models.CyclicFlowAttentionConfig(**common_config(**config)))
    return scale_up_mixer_weights(model.to(dtype).eval(), seed)


def value_and_output_records(model, ids, mask):
    """Per mixer: x = v_proj's output (B, L, V·H) from the layer's input (the layer projects q, k, v in one fused
    ``F.linear``, so v_proj's own forward never runs), and o_proj's input scattered back to (B, L, V·H)."""
    records, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.register_forward_pre_hook(
            lambda mod, args, kwargs, mixer=mixer: records.setdefault(mixer, {}).update(h=kwargs["hidden_states"]),
            with_kwargs=True))
        handles.append(mixer.o_proj.register_forward_pre_hook(
            lambda mod, args, mixer=mixer: records.setdefault(mixer, {}).update(out_in=args[0].detach())))
    run_hooked(model, ids, mask, handles)
    real = mask.bool()
    found = []
    for mixer in fla_mixers(model):
        h = records[mixer]["h"].double() * mask[:, :, None]
        x = F.linear(h, mixer.v_proj.weight.double())
        expected = torch.zeros_like(x)
        expected[real] = records[mixer]["out_in"].double().reshape(-1, x.shape[-1])
        found.append((x, expected))
    return found


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unified_identity_out_proj_input_equals_H_x(config, dtype):
    model = make_model(dtype, **CONFIGS[config])
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    operators, _, _ = mc.build_operators(model, ids, mask, formulation="unified")
    records = value_and_output_records(model, ids, mask)
    assert len(operators) == len(records) == 2
    for op, (x, expected) in zip(operators.values(), records):
        H = op.maps(reduce=None).double()  # (B, C, L, L)
        got = torch.einsum("bcis,bsc->bic", H, x)
        assert expected.abs().max() > 1e-3
        # float64: the layer's β, δ, g are float32 (see the batch test): a rebuild's last-bit difference in a
        # projection (the padded batch against fla's packed one) can move one of them by a float32 step
        assert relative_error(got, expected) <= (1e-6 if dtype == torch.float64 else 3e-5)
    assert_untouched(model, before)


def impulse(kwargs):
    """α (B, H, T, T) of a recorded CyFA op call: fla's naive op in float64 on one-hot values, zero state."""
    names = ("q", "k", "g", "delta", "beta", "readout", "q_norm_weight", "k_norm_weight")
    t = {name: kwargs[name].double() for name in names}
    batch, length, heads, _ = t["q"].shape
    eye = torch.eye(length, dtype=torch.float64)[None, :, None, :].expand(batch, length, heads, length)
    out, _ = naive_float64(**t, v=eye.contiguous(), q_norm_eps=kwargs["q_norm_eps"],
                           k_norm_eps=kwargs["k_norm_eps"], scale=kwargs["scale"])
    return out.permute(0, 2, 1, 3)


@pytest.mark.parametrize("config", CONFIGS)
def test_hidden_maps_equal_the_naive_op_impulse_response(config):
    model = make_model(**CONFIGS[config])
    ids = padded_batch(length=10)[0]
    with mc.fla_on_cpu(), OpRecorder(model, ("chunk_cyfa", "fused_recurrent_cyfa")) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators, _, _ = mc.build_operators(model, ids, None, formulation="hidden")
    assert [name for name, _, _ in recorder.calls] == ["fused_recurrent_cyfa"] * 2
    for op, (_, kwargs, out) in zip(operators.values(), recorder.calls):
        alpha = op.maps(reduce=None)  # (B, H, L, L)
        assert relative_error(alpha, impulse(kwargs)) <= 1e-10
        got = torch.einsum("bhts,bshp->bthp", alpha, kwargs["v"].double())
        assert relative_error(got, out) <= 1e-10


@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_batch_equals_single_examples_and_left_padding_equals_none(formulation):
    """fla's layer computes β, δ and g in float32 whatever the model's dtype: a last-bit difference of a float64
    projection (a batched product against a single one) can round one of them to the next float32, so batch and single
    agree to float32's rounding of the gates (about 1e-7 of a map), not to float64's."""
    model = make_model(**CONFIGS["conv"])
    ids, mask = padded_batch(length=12)
    batched = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        single = mc.implicit_attention(model, ids[b:b + 1, real], formulation=formulation)
        for key in batched:
            scale = single[key].abs().max()
            assert scale > 1e-3
            torch.testing.assert_close(batched[key][b][real][:, real].double(), single[key][0].double(),
                                       rtol=0, atol=1e-6 * scale.item())


def test_a_value_conv_bias_is_exact_under_padding_for_hidden_and_refused_for_unified():
    model = make_model(**CONFIGS["conv"], conv_bias=True)
    with torch.no_grad():
        for mixer in fla_mixers(model):
            for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
                conv.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3))
    ids, mask = padded_batch(length=12)
    batched = mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")
    real = mask[0].bool()
    single = mc.implicit_attention(model, ids[:1, real], formulation="hidden")
    for key in batched:
        torch.testing.assert_close(batched[key][0][real][:, real], single[key][0], rtol=0,
                                   atol=1e-6 * single[key].abs().max().item())
    with pytest.raises(NotImplementedError, match="bias"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")


def test_training_step_on_cpu_and_maps_of_both_formulations():
    model = make_model(torch.float32, **CONFIGS["conv"]).train()
    ids, mask = padded_batch(length=12)
    with mc.fla_on_cpu():
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
    assert torch.isfinite(loss)
    for mixer in fla_mixers(model):
        for parameter in (mixer.readout, mixer.A_log, mixer.d_proj.weight, mixer.v_proj.weight, mixer.q_norm.weight):
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all()
            assert parameter.grad.abs().max() > 0
    model.eval()
    for formulation in ("hidden", "unified"):
        maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
        assert len(maps) == 2
        for layer_map in maps.values():
            assert layer_map.shape == (2, 12, 12) and torch.isfinite(layer_map).all()
            assert (layer_map[0, :3] == 0).all() and (layer_map[0, :, :3] == 0).all()  # the pads
