"""flash-linear-attention 0.6.0's delta-rule family on CPU (mamba_captum.fla_cpu.ops, .ops_delta_family;
mamba_captum.families.fla_delta_net, fla_gated_deltanet, fla_kda, fla_comba, fla_gated_deltaproduct).

The op swaps equal fla's own torch references (``fla/ops/<op>/naive.py``, run in float64 through
:class:`test_kernel_delta_rule_states.Float64`) with the flags fla's layers pass (L2 norm, gate, β-sigmoid in the
kernel, V-first states, grouped value heads), in outputs, final states and the gradients of every input, float64;
packed sequences equal the sequences one by one. The layers: a DeltaProduct of two steps per token (which the generic
tests of tests/test_fla_families.py cannot hold: its input has n channels per output channel) reproduces the layer
and fla's reference; a conv bias is exact under left padding (hidden) and refused (unified); other gates and norms
reproduce the layer; each model trains on CPU.
"""
from __future__ import annotations

import pytest
import torch
from conftest import relative_error
from fla_models import (assert_trains_on_cpu_and_explains_both_formulations, fla_mixers, fla_models, padded_batch,
                        run_hooked, scale_up_mixer_weights)
from test_kernel_delta_rule_states import Float64
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from fla.ops.comba.naive import naive_chunk_comba
from fla.ops.delta_rule.naive import delta_rule_recurrence
from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda
from mamba_captum.fla_cpu import ops, ops_delta_family

EXACT = 1e-12  # float64 against float64, relative to the largest entry
B, T, H, HV, K, V = 2, 70, 2, 4, 5, 3  # T > 64: two chunks of the chunked delta rule


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def l2(x):
    """fla's in-kernel L2 norm (eps inside the root)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def results_and_gradients(function, inputs: dict, seed=99):
    """(o, final state, d⟨o, P⟩ + ⟨S, Q⟩ / d each input) of ``function(**inputs) -> (o, S)``."""
    leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    output, state = function(**leaves)
    loss = (output * randn(*output.shape, seed=seed)).sum() + (state * randn(*state.shape, seed=seed + 1)).sum()
    return [output, state, *torch.autograd.grad(loss, list(leaves.values()))]


def assert_all_equal(got, expected, names):
    assert len(got) == len(expected) == len(names)
    for name, actual, reference in zip(names, got, expected):
        assert actual.shape == reference.shape, name
        assert relative_error(actual, reference) <= EXACT, name
        assert reference.abs().max() > 1e-3, name  # every input matters


def delta_inputs(seed=0, value_heads=HV, length=T):
    return dict(q=randn(B, length, H, K, seed=seed), k=randn(B, length, H, K, seed=seed + 1),
                v=randn(B, length, value_heads, V, seed=seed + 2), beta=randn(B, length, value_heads, seed=seed + 3),
                h0=randn(B, value_heads, K, V, seed=seed + 4))


def grouped(x, value_heads):
    return x.repeat_interleave(value_heads // x.shape[2], dim=2)


# -- the op swaps against fla's references --------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["chunk_delta_rule", "fused_recurrent_delta_rule"])
def test_delta_rule_ops_equal_fla_delta_rule_recurrence(op):
    inputs = delta_inputs(value_heads=H)
    inputs["beta"] = torch.sigmoid(inputs["beta"])

    def ours(q, k, v, beta, h0):
        return getattr(ops, op)(q=q, k=k, v=v, beta=beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)

    def reference(q, k, v, beta, h0):  # fla's reference takes (B, H, T, ·)
        first = lambda x: x.transpose(1, 2)  # noqa: E731
        with Float64():
            o, state = delta_rule_recurrence(first(l2(q)), first(l2(k)), first(v), first(beta), initial_state=h0,
                                             output_final_state=True)
        return first(o), state

    assert_all_equal(results_and_gradients(ours, inputs), results_and_gradients(reference, inputs),
                     ["o", "S", "dq", "dk", "dv", "dbeta", "dh0"])


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_gated_delta_rule_ops_with_gated_deltanet_flags_equal_fla_reference(op):
    # as fla's GatedDeltaNet calls them: raw gate and β, in-kernel L2 norm, gate and sigmoid, β × 2, V-first states,
    # two value heads per key head
    inputs = dict(delta_inputs(), a=randn(B, T, HV, seed=5), A_log=randn(HV, seed=6) * 0.5, dt_bias=randn(HV, seed=7))

    def ours(q, k, v, beta, h0, a, A_log, dt_bias):
        o, state = getattr(ops, op)(q=q, k=k, v=v, g=a, beta=beta, initial_state=h0.transpose(-1, -2),
                                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
                                    use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        return o, state.transpose(-1, -2)

    def reference(q, k, v, beta, h0, a, A_log, dt_bias):
        with Float64():
            g = naive_gdn_gate(a, A_log, dt_bias, output_dtype=torch.float64)
            return naive_recurrent_gated_delta_rule(grouped(l2(q), HV), grouped(l2(k), HV), v,
                                                    2 * torch.sigmoid(beta), g, initial_state=h0,
                                                    output_final_state=True)

    assert_all_equal(results_and_gradients(ours, inputs), results_and_gradients(reference, inputs),
                     ["o", "S", "dq", "dk", "dv", "dbeta", "dh0", "da", "dA_log", "ddt_bias"])


@pytest.mark.parametrize("op", ["chunk_kda", "fused_recurrent_kda"])
@pytest.mark.parametrize("lower_bound", [None, -3.0])
def test_kda_ops_with_kda_flags_equal_fla_reference(op, lower_bound):
    # as fla's KimiDeltaAttention calls them (the raw gate f per value head and key channel); lower_bound: the
    # "safe gate" lower_bound · σ(exp(A_log) (f + dt_bias))
    inputs = dict(delta_inputs(seed=10), f=randn(B, T, HV, K, seed=15), A_log=randn(HV, seed=16) * 0.5,
                  dt_bias=randn(HV * K, seed=17))

    def ours(q, k, v, beta, h0, f, A_log, dt_bias):
        safe = dict(safe_gate=lower_bound is not None) if op == "chunk_kda" else {}
        o, state = getattr(ops, op)(q=q, k=k, v=v, g=f, beta=beta, A_log=A_log, dt_bias=dt_bias,
                                    initial_state=h0.transpose(-1, -2), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, lower_bound=lower_bound,
                                    state_v_first=True, **safe)
        return o, state.transpose(-1, -2)

    def reference(q, k, v, beta, h0, f, A_log, dt_bias):
        with Float64():
            if lower_bound is None:
                g = naive_kda_gate(f, A_log, dt_bias, output_dtype=torch.float64)
            else:
                g = naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound, output_dtype=torch.float64)
            return naive_recurrent_kda(l2(q), l2(k), v, g, 2 * torch.sigmoid(beta), initial_state=h0,
                                       output_final_state=True)

    assert_all_equal(results_and_gradients(ours, inputs), results_and_gradients(reference, inputs),
                     ["o", "S", "dq", "dk", "dv", "dbeta", "dh0", "df", "dA_log", "ddt_bias"])


def comba_inputs(seed=20, length=T):
    inputs = delta_inputs(seed=seed, length=length)
    inputs["beta"] = torch.sigmoid(inputs["beta"])
    return dict(inputs, p=randn(B, length, H, K, seed=seed + 5), g=-torch.rand(
        B, length, HV, generator=torch.Generator().manual_seed(seed + 6), dtype=torch.float64))


@pytest.mark.parametrize("op", ["chunk_comba", "fused_recurrent_comba"])
def test_comba_ops_equal_fla_naive_chunk_comba(op):
    # p ≠ k (the layer's p = σ(decay)·k; here any vector) and grouped value heads
    def ours(q, k, v, beta, h0, p, g):
        return getattr(ops_delta_family, op)(q=q, k=k, v=v, p=p, g=g, beta=beta, initial_state=h0,
                                             output_final_state=True, use_qk_l2norm_in_kernel=True)

    def reference(q, k, v, beta, h0, p, g):
        with Float64():
            return naive_chunk_comba(*(grouped(l2(x), HV) for x in (q, k)), v, grouped(l2(p), HV), g, beta,
                                     initial_state=h0, output_final_state=True)

    inputs = comba_inputs()
    assert_all_equal(results_and_gradients(ours, inputs), results_and_gradients(reference, inputs),
                     ["o", "S", "dq", "dk", "dv", "dbeta", "dh0", "dp", "dg"])


def delta_product_inputs(seed=30, steps=3, length=T // 2, gate=True):
    inputs = dict(q=randn(B, length, H, K, seed=seed), k=randn(B, length * steps, H, K, seed=seed + 1),
                  v=randn(B, length * steps, H, V, seed=seed + 2),
                  beta=torch.sigmoid(randn(B, length * steps, H, seed=seed + 3)), h0=randn(B, H, K, V, seed=seed + 4))
    if gate:
        inputs["g"] = -torch.rand(B, length, H, generator=torch.Generator().manual_seed(seed + 5),
                                  dtype=torch.float64)
    return inputs


@pytest.mark.parametrize("gate", [True, False])
def test_gated_delta_product_op_equals_fla_reference(gate):
    # three delta steps per token (the expanded sequence spans two chunks); without the forget gate g is None
    def ours(q, k, v, beta, h0, g=None):
        return ops_delta_family.chunk_gated_delta_product(q=q, k=k, v=v, g=g, beta=beta, num_householder=3,
                                                          initial_state=h0, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)

    def reference(q, k, v, beta, h0, g=None):
        with Float64():
            return naive_recurrent_gated_delta_product(l2(q), l2(k), v, g, beta, K ** -0.5, initial_state=h0,
                                                       output_final_state=True, num_householder=3)

    inputs = delta_product_inputs(gate=gate)
    assert_all_equal(results_and_gradients(ours, inputs), results_and_gradients(reference, inputs),
                     ["o", "S", "dq", "dk", "dv", "dbeta", "dh0", "dg"][:7 + gate])


def packed(tensors: dict, lengths, steps=1):
    """Batch element b's first lengths[b] tokens of each tensor, packed as (1, Σ, ...), and cu_seqlens."""
    out = {}
    for name, x in tensors.items():
        rows = steps if x.shape[1] == tensors["k"].shape[1] and steps > 1 else 1
        out[name] = torch.cat([x[b:b + 1, :n * rows] for b, n in enumerate(lengths)], dim=1)
    return out, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@pytest.mark.parametrize("op", ["chunk_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule",
                                "chunk_kda", "fused_recurrent_kda", "chunk_comba", "fused_recurrent_comba",
                                "chunk_gated_delta_product"])
def test_packed_sequences_equal_each_sequence(op):
    lengths = [9, 30]
    if op == "chunk_gated_delta_product":
        tensors = delta_product_inputs(steps=2)
        tensors.pop("h0")
        kwargs = dict(num_householder=2)
    else:
        inputs = comba_inputs() if "comba" in op else delta_inputs(value_heads=H if op == "chunk_delta_rule" else HV)
        tensors = {name: inputs[name] for name in ("q", "k", "v", "beta", "p", "g") if name in inputs}
        tensors["beta"] = torch.sigmoid(tensors["beta"])
        if "kda" in op:
            tensors["g"] = -torch.rand(B, T, HV, K, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        elif "gated_delta_rule" in op:
            tensors["g"] = -torch.rand(B, T, HV, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        kwargs = {}
    function = getattr(ops, op, None) or getattr(ops_delta_family, op)
    states = randn(2, tensors["v"].shape[2], K, V, seed=8)
    one_by_one = [function(**{n: x[b:b + 1, :lengths[b] * (x.shape[1] // tensors["q"].shape[1])]
                              for n, x in tensors.items()}, initial_state=states[b:b + 1], output_final_state=True,
                           use_qk_l2norm_in_kernel=True, **kwargs) for b in range(2)]
    together, cu_seqlens = packed(tensors, lengths, steps=kwargs.get("num_householder", 1))
    output, final = function(**together, initial_state=states, output_final_state=True, cu_seqlens=cu_seqlens,
                             use_qk_l2norm_in_kernel=True, **kwargs)
    assert output.shape[1] == sum(lengths)
    assert relative_error(output, torch.cat([o for o, _ in one_by_one], dim=1)) <= EXACT
    assert relative_error(final, torch.cat([s for _, s in one_by_one])) <= EXACT


# -- the layers -----------------------------------------------------------------------------------------------------
def tiny_model(config_class, dtype=torch.float64, seed=0, **kwargs):
    """A tiny random fla model (eval mode), its mixers' projection weights scaled up as tests/fla_models.py does."""
    config = getattr(fla_models, config_class)(vocab_size=64, hidden_size=32, num_hidden_layers=2, pad_token_id=0,
                                               bos_token_id=1, eos_token_id=2, fuse_cross_entropy=False,
                                               use_cache=False, **kwargs)
    torch.manual_seed(seed)
    return scale_up_mixer_weights(AutoModelForCausalLM.from_config(config).to(dtype).eval(), seed)


def unified_identity_error(model, ids, mask, sum_substeps=1):
    """max relative error of o_proj's input (the test's hooks) against Σ_s H_c[i, s] x_c[s] (x: v_proj's output),
    the output channels summed over ``sum_substeps`` blocks of channels (a DeltaProduct's sub-steps)."""
    records, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.v_proj.register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=out.detach())))
        handles.append(mixer.o_proj.register_forward_pre_hook(
            lambda mod, args, mixer=mixer: records.setdefault(mixer, {}).update(y=args[0].detach())))
    run_hooked(model, ids, mask, handles)
    operators = list(mc.build_operators(model, ids, mask, formulation="unified")[0].values())
    assert len(operators) == len(records) == 2
    worst, real = 0.0, mask.bool()
    for mixer, op in zip(fla_mixers(model), operators):
        x = torch.zeros(*ids.shape, records[mixer]["x"].shape[-1], dtype=torch.float64)
        x[real] = records[mixer]["x"].double().reshape(-1, x.shape[-1])  # fla packs the real tokens
        expected = torch.zeros(*ids.shape, records[mixer]["y"].shape[-1], dtype=torch.float64)
        expected[real] = records[mixer]["y"].double().reshape(-1, expected.shape[-1])
        got = torch.einsum("bcis,bsc->bic", op.maps(reduce=None).double(), x)
        got = got.reshape(*got.shape[:2], sum_substeps, -1).sum(2)
        assert expected.abs().max() > 1e-3
        worst = max(worst, relative_error(got, expected))
    return worst


def test_delta_product_of_two_steps_reproduces_the_layer_and_fla_reference():
    model = tiny_model("GatedDeltaProductConfig", num_heads=2, head_dim=8, expand_v=1.0, num_householder=2,
                       use_forget_gate=True, allow_neg_eigval=True)
    ids, mask = padded_batch(length=12)
    assert unified_identity_error(model, ids, mask, sum_substeps=2) <= 1e-9
    # hidden: one core per (sub-step j, head h), against fla's naive_recurrent_gated_delta_product on the op inputs
    # the layer recorded (chunk_gated_delta_product, which it calls with gradients on), one-hot values
    module = __import__("fla.layers.gated_deltaproduct", fromlist=["chunk_gated_delta_product"])
    calls = []
    with mc.fla_on_cpu():
        swapped = module.chunk_gated_delta_product  # fla_on_cpu's dispatcher

        def recording(**kwargs):
            out = swapped(**kwargs)
            calls.append(({name: x.detach() if torch.is_tensor(x) else x for name, x in kwargs.items()},
                          out[0].detach()))
            return out

        module.chunk_gated_delta_product = recording
        try:
            model(input_ids=ids[1:], use_cache=False)
        finally:
            module.chunk_gated_delta_product = swapped
    operators = list(mc.build_operators(model, ids[1:], None, formulation="hidden")[0].values())
    assert len(calls) == len(operators) == 2
    for op, (kwargs, out) in zip(operators, calls):
        q, k, v, beta, g = (kwargs[name].double() for name in ("q", "k", "v", "beta", "g"))
        length, heads, n = q.shape[1], q.shape[2], kwargs["num_householder"]
        one_hot = torch.eye(length * n, dtype=torch.float64)[None, :, None, :].expand(1, -1, heads, -1)
        with Float64():
            impulse, _ = naive_recurrent_gated_delta_product(l2(q), l2(k), one_hot.contiguous(), g, beta,
                                                             q.shape[-1] ** -0.5, num_householder=n)
        # impulse[0, t, h, s·n + j] = α_(j,h)[t, s], the core j·H + h
        expected = impulse[0].reshape(length, heads, length, n).permute(3, 1, 0, 2).flatten(0, 1)
        alpha = op.maps(reduce=None)[0]
        assert alpha.shape == expected.shape == (n * heads, length, length)
        assert relative_error(alpha, expected) <= 1e-10
        partial = torch.einsum("cts,scp->tcp", alpha, v[0].reshape(length, n * heads, -1))
        assert relative_error(partial.reshape(length, n, heads, -1).sum(1), out[0]) <= 1e-10


@pytest.mark.parametrize("config_class, kwargs", [
    ("DeltaNetConfig", dict(num_heads=2, expand_k=0.5, expand_v=1.0, qk_activation="relu", use_beta=False)),
    ("GatedDeltaNetConfig", dict(num_heads=2, head_dim=8, expand_v=1.0, output_gate_activation="sigmoid")),
    ("GatedDeltaNetConfig", dict(num_heads=2, head_dim=8, expand_v=1.0, use_gate=False, use_short_conv=False)),
    ("CombaConfig", dict(num_heads=2, head_dim=8, expand_v=1.0, use_output_gate=False, use_inner_decay=False,
                         use_output_correction=False)),
])
def test_other_gates_norms_and_features_reproduce_the_layer(config_class, kwargs):
    model = tiny_model(config_class, **kwargs)
    ids, mask = padded_batch(length=12)
    assert unified_identity_error(model, ids, mask) <= 1e-9


def test_a_conv_bias_is_exact_under_padding_for_hidden_and_refused_for_unified():
    # fla drops the pads; the rebuild keeps them, their keys zeroed after the conv (a bias makes them non-zero)
    # (fla's configs do not pass conv_bias to the layer: the biases are given to the layers' convs here)
    model = tiny_model("GatedDeltaNetConfig", num_heads=2, head_dim=8, expand_v=1.0)
    generator = torch.Generator().manual_seed(4)
    for mixer in fla_mixers(model):
        mixer.conv_bias = True
        for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
            conv.bias = torch.nn.Parameter(torch.randn(conv.out_channels, generator=generator, dtype=torch.float64))
    ids, mask = padded_batch(length=12)
    batched = mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")
    real = mask[0].bool()
    single = mc.implicit_attention(model, ids[:1, real], formulation="hidden")
    for key in batched:
        assert relative_error(batched[key][0][real][:, real], single[key][0]) <= 1e-10
    with pytest.raises(NotImplementedError, match="value conv has a bias"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")


@pytest.mark.parametrize("config_class, kwargs", [
    ("DeltaNetConfig", dict(num_heads=2, expand_k=0.5, expand_v=1.0)),
    ("GatedDeltaNetConfig", dict(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0)),
    ("KDAConfig", dict(num_heads=2, head_dim=8, expand_v=1.0)),
    ("CombaConfig", dict(num_heads=2, head_dim=8, expand_v=1.0)),
    ("GatedDeltaProductConfig", dict(num_heads=2, head_dim=8, expand_v=1.0, num_householder=2, use_forget_gate=True)),
])
def test_training_step_on_cpu_and_maps_of_both_formulations(config_class, kwargs):
    assert_trains_on_cpu_and_explains_both_formulations(tiny_model(config_class, **kwargs))
