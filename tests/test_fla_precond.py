"""flash-linear-attention 0.6.0's preconditioned delta rules on CPU (mamba_captum.fla_cpu.ops_precond;
mamba_captum.families.fla_precond_gated_deltanet, fla_precond_kda).

The op swaps equal fla's own torch references (``naive_recurrent_precond_gated_delta_rule`` with the kernels' L2
norm, eps inside the root; ``naive_recurrent_precond_kda`` on normalised q, k; ``naive_kda_gate`` /
``naive_kda_lowerbound_gate``; run in float64 through :class:`test_kernel_delta_rule_states.Float64`) with grouped
value heads, initial states and a learned per-head centre, in outputs, both final states and the gradients of every
input, float64; packed sequences equal the sequences one by one; arguments a torch version cannot honour are refused
by name. The layers: the preconditioner matters (their maps are not those of the plain rule); a training step runs
on CPU with the chunked ops (its loss the eval forward's, a gradient on every mixer parameter) and the maps of both
formulations are causal and zero at the pads.
"""
from __future__ import annotations

import pytest
import torch
from conftest import relative_error
from fla_models import (_kernel_normalised_naive, assert_trains_on_cpu_and_explains_both_formulations, fla_mixers,
                        make_fla_model, padded_batch)
from test_fla_delta_family import randn, tiny_model
from test_kernel_delta_rule_states import Float64

import fla.ops.precond_gated_delta_rule.naive as precond_gdn_naive
import mamba_captum as mc
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.precond_kda.naive import naive_recurrent_precond_kda
from mamba_captum.fla_cpu import ops_precond

EXACT = 1e-12  # float64 against float64, relative to the largest entry
B, T, H, HV, K, V = 2, 11, 2, 4, 5, 3


def gdn_inputs(seed=0, length=T):
    """float64 inputs of the preconditioned gated delta rule: raw q, k (normalised in the kernel), β, β^atk in (0, 1),
    log decays in (−1, 0], an ATK initial state > 0, a centre per key head."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=randn(B, length, H, K, seed=seed + 1), k=randn(B, length, H, K, seed=seed + 2),
                v=randn(B, length, HV, V, seed=seed + 3), g=-rand(B, length, HV), g_atk=-rand(B, length, H),
                beta=rand(B, length, HV), beta_atk=rand(B, length, H), initial_state=randn(B, HV, K, V, seed=seed + 4),
                initial_A_state=rand(B, H, K), log_atk_scale=0.5 * randn(H, seed=seed + 5))


def naive_gdn(**inputs):
    """fla's naive_recurrent_precond_gated_delta_rule in float64, with the kernels' L2 norm."""
    with Float64(), _kernel_normalised_naive(precond_gdn_naive):
        return precond_gdn_naive.naive_recurrent_precond_gated_delta_rule(**inputs, output_final_state=True)


def results_and_gradients(function, inputs: dict, seed=99):
    """(o, S_T, A_T, d(⟨o, P⟩ + ⟨S_T, Q⟩ + ⟨A_T, R⟩) / d each input) of ``function(**inputs) -> (o, S_T, A_T)``."""
    leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    results = function(**leaves)
    loss = sum((x * randn(*x.shape, seed=seed + i)).sum() for i, x in enumerate(results))
    return [*results, *torch.autograd.grad(loss, list(leaves.values()))]


def assert_all_equal(got, expected, names):
    assert len(got) == len(expected) == len(names)
    for name, actual, reference in zip(names, got, expected):
        assert actual.shape == reference.shape, name
        assert relative_error(actual, reference) <= EXACT, name
        assert reference.abs().max() > 1e-3, name  # every input matters


@pytest.mark.parametrize("op", ["chunk_precond_gated_delta_rule", "fused_recurrent_precond_gated_delta_rule"])
def test_precond_gated_delta_rule_ops_equal_fla_naive_reference(op):
    inputs = gdn_inputs(length=70)  # two chunks of the chunked kernels
    function = getattr(ops_precond, op)
    got = results_and_gradients(lambda **x: function(**x, output_final_state=True, use_qk_l2norm_in_kernel=True),
                                inputs)
    expected = results_and_gradients(naive_gdn, inputs)
    assert_all_equal(got, expected, ["o", "S_T", "A_T", *(f"d{name}" for name in inputs)])


def test_fused_recurrent_key_channel_decays_and_transposed_state_layout():
    inputs = gdn_inputs()
    reference = ops_precond.chunk_precond_gated_delta_rule(**inputs, output_final_state=True)
    # gk = g on every key channel, half of it given as g and half as gk (fla applies both)
    channel = inputs["g"][..., None].expand(B, T, HV, K)
    split = dict(inputs, g=inputs["g"] / 2, gk=channel / 2)
    for kwargs in (dict(inputs, g=None, gk=channel), split):
        o, state, a_state = ops_precond.fused_recurrent_precond_gated_delta_rule(**kwargs, output_final_state=True)
        for got, expected in zip((o, state, a_state), reference):
            assert relative_error(got, expected) <= EXACT
    transposed = dict(inputs, initial_state=inputs["initial_state"].transpose(-1, -2))
    o, state, _ = ops_precond.chunk_precond_gated_delta_rule(**transposed, output_final_state=True,
                                                             transpose_state_layout=True)
    assert relative_error(o, reference[0]) <= EXACT
    assert relative_error(state.transpose(-1, -2), reference[1]) <= EXACT


@pytest.mark.parametrize("op", ["chunk_precond_gated_delta_rule", "fused_recurrent_precond_gated_delta_rule",
                                "chunk_precond_kda", "fused_recurrent_precond_kda"])
def test_packed_sequences_equal_each_sequence(op):
    lengths = [4, 11]
    inputs = kda_inputs() if "kda" in op else gdn_inputs()
    states = {name: inputs.pop(name) for name in ("initial_state", "initial_A_state")}
    centre = inputs.pop("log_atk_scale")
    function = getattr(ops_precond, op)
    one_by_one = [function(**{n: x[b:b + 1, :lengths[b]] for n, x in inputs.items()},
                           **{n: s[b:b + 1] for n, s in states.items()}, log_atk_scale=centre,
                           output_final_state=True) for b in range(2)]
    packed = {n: torch.cat([x[b:b + 1, :lengths[b]] for b in range(2)], dim=1) for n, x in inputs.items()}
    cu_seqlens = torch.tensor([0, lengths[0], sum(lengths)])
    together = function(**packed, **states, log_atk_scale=centre, output_final_state=True, cu_seqlens=cu_seqlens)
    assert together[0].shape[1] == sum(lengths)
    assert relative_error(together[0], torch.cat([r[0] for r in one_by_one], dim=1)) <= EXACT
    for index in (1, 2):  # S_T, A_T
        assert relative_error(together[index], torch.cat([r[index] for r in one_by_one])) <= EXACT


def kda_inputs(seed=0, length=T):
    """float64 inputs of the preconditioned KDA rule (the ATK state per value head, decays per key channel), raw q, k
    with H key heads."""
    inputs = gdn_inputs(seed, length)
    gen = torch.Generator().manual_seed(seed + 7)
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(inputs, g=-rand(B, length, HV, K), g_atk=-rand(B, length, HV), beta_atk=rand(B, length, HV),
                initial_A_state=rand(B, HV, K), log_atk_scale=0.5 * randn(HV, seed=seed + 6))


def naive_kda(q, k, **inputs):
    """fla's naive_recurrent_precond_kda in float64 on q, k as the kernel uses them (normalised, key heads repeated:
    the reference has no grouped value heads)."""
    q, k = (l2(x).repeat_interleave(HV // H, dim=2) for x in (q, k))
    with Float64():
        return naive_recurrent_precond_kda(q, k, **inputs, output_final_state=True)


def l2(x):
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("op", ["chunk_precond_kda", "fused_recurrent_precond_kda"])
def test_precond_kda_ops_equal_fla_naive_reference(op):
    inputs = kda_inputs(length=70)
    function = getattr(ops_precond, op)
    repeat = (lambda x: x.repeat_interleave(HV // H, dim=2)) if op == "chunk_precond_kda" else (lambda x: x)
    # PrecondKDA's layer repeats q and k to the value heads before the chunked op; the fused op takes key heads
    got = results_and_gradients(lambda q, k, **x: function(repeat(q), repeat(k), **x, output_final_state=True),
                                inputs)
    expected = results_and_gradients(naive_kda, inputs)
    assert_all_equal(got, expected, ["o", "S_T", "A_T", *(f"d{name}" for name in inputs)])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_and_the_gate_in_the_kernel_equal_fla_references(lower_bound):
    raw, A_log, dt_bias = randn(B, T, HV, K, seed=11), randn(HV, seed=12), randn(HV * K, seed=13)
    with Float64():
        expected = (naive_kda_gate(raw, A_log, dt_bias) if lower_bound is None
                    else naive_kda_lowerbound_gate(raw, A_log, dt_bias, lower_bound))
    got = ops_precond.fused_kda_gate(raw, A_log, dt_bias, lower_bound, output_dtype=torch.float64)
    assert relative_error(got, expected) <= EXACT
    assert ops_precond.fused_kda_gate(raw.float(), A_log, dt_bias, lower_bound).dtype == torch.float32  # fla's default
    inputs = dict(kda_inputs(), q=randn(B, T, HV, K, seed=14), k=randn(B, T, HV, K, seed=15))
    reference = ops_precond.chunk_precond_kda(**dict(inputs, g=got), output_final_state=True)
    for op in ("chunk_precond_kda", "fused_recurrent_precond_kda"):
        results = getattr(ops_precond, op)(**dict(inputs, g=raw), A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                           use_gate_in_kernel=True, output_final_state=True)
        for result, expected_result in zip(results, reference):
            assert relative_error(result, expected_result) <= EXACT, op


def test_arguments_without_a_torch_version_are_refused_by_name():
    inputs = gdn_inputs()
    with pytest.raises(NotImplementedError, match="cp_context"):
        ops_precond.chunk_precond_gated_delta_rule(**inputs, cp_context=object())
    with pytest.raises(NotImplementedError, match="gv="):
        ops_precond.fused_recurrent_precond_gated_delta_rule(**inputs, gv=torch.zeros(B, T, HV, V))
    with pytest.raises(NotImplementedError, match="one per value channel"):
        ops_precond.fused_recurrent_precond_gated_delta_rule(**dict(inputs, beta=torch.rand(B, T, HV, V)))
    inputs = kda_inputs()
    with pytest.raises(NotImplementedError, match="return_intermediate_states"):
        ops_precond.chunk_precond_kda(**inputs, return_intermediate_states=True)
    with pytest.raises(NotImplementedError, match="cp_context"):
        ops_precond.chunk_precond_kda(**inputs, cp_context=object())


@pytest.mark.parametrize("name, attribute", [("precond_gated_deltanet", "squash_x"), ("precond_kda", "squash_x_val")])
def test_the_preconditioner_enters_the_maps(name, attribute):
    # the same layer with the squash range x = 1 (M = 1: the plain gated delta rule / KDA) gives other hidden maps
    model = make_fla_model(name, torch.float64)
    ids = padded_batch(length=10)[0]
    preconditioned = mc.implicit_attention(model, ids, formulation="hidden")
    for mixer in fla_mixers(model):
        setattr(mixer, attribute, 1.0)
    plain = mc.implicit_attention(model, ids, formulation="hidden")
    for layer in preconditioned:
        assert relative_error(plain[layer], preconditioned[layer]) > 1e-2


@pytest.mark.parametrize("config_class, kwargs", [
    ("PrecondGatedDeltaNetConfig", dict(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0)),
    ("PrecondKDAConfig", dict(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0)),
])
def test_training_step_on_cpu_and_maps_of_both_formulations(config_class, kwargs):
    assert_trains_on_cpu_and_explains_both_formulations(tiny_model(config_class, **kwargs))
