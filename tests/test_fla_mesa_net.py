"""flash-linear-attention's MesaNet (model type ``mesa_net``): its CPU ops and its adapter.

The torch versions of ``chunk_mesa_net`` and ``mesa_net_decoding_one_step`` against fla's own torch references run in
float64 (``naive_mesa_net_CG``: the kernels' conjugate-gradient solve, a fixed number of steps from zero; its
``naive_mesa_net_decoding_one_step``) and against per-token references written here: outputs, final states,
gradients, packed sequences; the solve is CG, not the exact one (``naive_mesa_net_exact``). Then the adapter, with the
generic tests of tests/test_fla_families.py written here (MesaNet is not in FLA_SPECS: its batch-equals-single test
holds to float32 rounding only, see :func:`test_batch_equals_single_examples_to_the_layers_float32_gates`): y = H x
against the test's own hooks, the hidden maps against fla's naive op on one-hot values, nothing left on the model, a
CPU training step and a cached generation.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla_models import (OpRecorder, _delta_inputs, _fla_naive_float64, common_config, fla_mixers, fla_models,
                        one_hot_values, padded_batch, run_hooked, scale_up_mixer_weights)
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from mamba_captum.kernels.mesa_net import mesa_chunked, mesa_recurrent

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import fla.ops.mesa_net as mesa_ops  # the swapped names are read from the module at call time
    from fla.ops.mesa_net.naive import (naive_mesa_net_CG, naive_mesa_net_decoding_one_step,
                                        naive_mesa_net_exact)

EXACT = 1e-12


def fla_naive_float64(function, *args, **kwargs):
    """One of fla's MesaNet references (they cast to float32 and allocate float32 zeros) run in float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _fla_naive_float64(function, *args, **kwargs)
    finally:
        torch.set_default_dtype(previous)


def mesa_inputs(seed=0, batch=2, length=12, heads=2, dim=4, states=True):
    """float64 (q, k, v, g, β, λ, H^kk_0, H^kv_0): q, k L2-normalised, H^kk_0 a sum of outer products (positive
    semi-definite, as a state of the rule)."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(randn(batch, length, heads, dim), dim=-1), F.normalize(randn(batch, length, heads, dim), dim=-1)
    v = randn(batch, length, heads, dim)
    log_decay = -torch.rand(batch, length, heads, generator=g, dtype=torch.float64) * 0.7 - 0.02
    beta = torch.rand(batch, length, heads, generator=g, dtype=torch.float64)
    lamb = torch.rand(heads, dim, generator=g, dtype=torch.float64) + 0.25
    keys = randn(batch, heads, 3, dim)
    h_kk = torch.einsum("bhnk,bhnj->bhkj", keys, keys) if states else None
    h_kv = randn(batch, heads, dim, dim) if states else None
    return q, k, v, log_decay, beta, lamb, h_kk, h_kv


def per_token_mesa(q, k, v, g, beta, lamb, iterations, h_kk=None, h_kv=None, jacobi_start=False):
    """The float64 reference written here, one token and one head at a time with explicit matrices: H^kk_t, H^kv_t
    updated, then fla's CG on (H^kk_t + diag(λ)) x = q_t (from 0, or with ``jacobi_start`` from
    q_t / (diag(H^kk_t) + λ + 1e-5) as fla's decoding kernel), o_t = H^kv_tᵀ x. Returns (o, q*, H^kk_T, H^kv_T)."""
    batch, length, heads, dim = q.shape
    h_kk = torch.zeros(batch, heads, dim, dim, dtype=q.dtype) if h_kk is None else h_kk.clone()
    h_kv = torch.zeros(batch, heads, dim, v.shape[-1], dtype=q.dtype) if h_kv is None else h_kv.clone()
    out, q_star = torch.zeros_like(v), torch.zeros_like(q)
    for t in range(length):
        for b in range(batch):
            for h in range(heads):
                decay, written = g[b, t, h].exp(), beta[b, t, h] * k[b, t, h]
                h_kk[b, h] = decay * h_kk[b, h] + torch.outer(written, k[b, t, h])
                h_kv[b, h] = decay * h_kv[b, h] + torch.outer(written, v[b, t, h])
                matrix = h_kk[b, h].T + torch.diag(lamb[h])
                x = q[b, t, h] / (h_kk[b, h].diagonal() + lamb[h] + 1e-5) if jacobi_start else q.new_zeros(dim)
                r = q[b, t, h] - matrix @ x
                p, delta = r.clone(), r @ r
                for _ in range(iterations):
                    a_p = matrix @ p
                    step = delta / (p @ a_p + 1e-5)
                    x, r = x + step * p, r - step * a_p
                    p, delta = r + (r @ r) / (delta + 1e-5) * p, r @ r
                q_star[b, t, h] = x
                out[b, t, h] = h_kv[b, h].T @ x
    return out, q_star, h_kk, h_kv


# -- the kernel (kernels/mesa_net) -------------------------------------------------------------------------------------
@pytest.mark.parametrize("jacobi_start", [False, True])
def test_kernel_recurrent_equals_the_per_token_reference(jacobi_start):
    q, k, v, g, beta, lamb, h_kk, h_kv = mesa_inputs(seed=7, length=6, dim=5)
    o, q_star, (final_kk, final_kv) = mesa_recurrent(q, k, v, g, beta, lamb, 4, h_kk_init=h_kk, h_kv_init=h_kv,
                                                     jacobi_start=jacobi_start, output_final_state=True)
    expected = per_token_mesa(q, k, v, g, beta, lamb, 4, h_kk, h_kv, jacobi_start=jacobi_start)
    for got, want in zip((o, q_star, final_kk, final_kv), expected):
        assert relative_error(got, want) <= EXACT


def test_kernel_chunked_equals_recurrent_across_chunks_with_gradients():
    q, k, v, g, beta, lamb, h_kk, h_kv = mesa_inputs(seed=8, length=70, heads=1, dim=3)  # 2 chunks of 64
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, lamb, h_kk, h_kv)]
    o, q_star, states = mesa_chunked(*leaves[:6], 6, h_kk_init=leaves[6], h_kv_init=leaves[7],
                                     output_final_state=True)
    chunked = torch.autograd.grad(o.square().sum() + states[0].sum() + states[1].sum(), leaves)
    o_ref, q_ref, states_ref = mesa_recurrent(*leaves[:6], 6, h_kk_init=leaves[6], h_kv_init=leaves[7],
                                              output_final_state=True)
    recurrent = torch.autograd.grad(o_ref.square().sum() + states_ref[0].sum() + states_ref[1].sum(), leaves)
    for got, want in zip((o, q_star, *states), (o_ref, q_ref, *states_ref)):
        assert relative_error(got, want) <= EXACT
    for got, want in zip(chunked, recurrent):
        assert relative_error(got, want) <= 1e-10


# -- the ops ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("iterations", [2, 30])
def test_chunk_op_equals_fla_naive_cg_with_states_and_gradients(iterations):
    q, k, v, g, beta, lamb, h_kk, h_kv = mesa_inputs()
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, lamb, h_kk, h_kv)]
    weights = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with mc.fla_on_cpu():
        o, final_kk, final_kv = mesa_ops.chunk_mesa_net(*inputs[:6], h_kk_init=inputs[6], h_kv_init=inputs[7],
                                                        output_final_state=True, max_CG_iteration=iterations)
    assert o.dtype == final_kk.dtype == torch.float64
    ours = torch.autograd.grad((o * weights).sum() + final_kk.sum() + final_kv.sum(), inputs)
    reference_inputs = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, lamb, h_kk, h_kv)]
    rq, rk, rv, rg, rbeta, rlamb, rkk, rkv = reference_inputs
    expected = fla_naive_float64(naive_mesa_net_CG, rq, rk, rv, rg, rlamb, rbeta, chunk_size=4,
                                 max_CG_iteration=iterations, h_kk_init=rkk, h_kv_init=rkv)
    assert expected[0].dtype == torch.float64
    for got, want in zip((o, final_kk, final_kv), expected):
        assert relative_error(got, want) <= EXACT
    theirs = torch.autograd.grad((expected[0] * weights).sum() + expected[1].sum() + expected[2].sum(),
                                 reference_inputs)
    for name, got, want in zip("q k v g beta lamb h_kk h_kv".split(), ours, theirs):
        assert relative_error(got, want) <= 1e-10, name


def test_chunk_op_equals_the_per_token_reference_and_normalises_in_the_kernel():
    q, k, v, g, beta, lamb, h_kk, h_kv = mesa_inputs(seed=2, length=7, dim=5)
    raw_q, raw_k = q * 3.0, k * 0.5  # the kernel's L2 norm undoes the scales (up to its eps 1e-6 inside the root)
    with mc.fla_on_cpu():
        o, final_kk, final_kv = mesa_ops.chunk_mesa_net(raw_q, raw_k, v, g, beta, lamb, h_kk_init=h_kk,
                                                        h_kv_init=h_kv, output_final_state=True,
                                                        max_CG_iteration=4, use_qk_l2norm_in_kernel=True)
    norm = lambda x: x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    expected = per_token_mesa(norm(raw_q), norm(raw_k), v, g, beta, lamb, 4, h_kk, h_kv)
    for got, want in zip((o, final_kk, final_kv), (expected[0], expected[2], expected[3])):
        assert relative_error(got, want) <= EXACT


def test_the_solve_is_fla_cg_not_the_exact_solve():
    """A few CG steps are far from (H^kk + diag λ)^{-1} q, thirty are close to it but not equal (the 1e-5 guards):
    the op follows the step count, as fla's kernels do."""
    q, k, v, g, beta, lamb, _, _ = mesa_inputs(seed=3, dim=6, states=False)
    exact, _, _ = fla_naive_float64(naive_mesa_net_exact, q, k, v, g, lamb, beta)
    errors = {}
    for iterations in (1, 30):
        with mc.fla_on_cpu():
            o, _, _ = mesa_ops.chunk_mesa_net(q, k, v, g, beta, lamb, max_CG_iteration=iterations)
        errors[iterations] = relative_error(o, exact)
    assert errors[1] > 0.05
    assert 1e-9 < errors[30] < 1e-2


def test_packed_sequences_equal_each_sequence_with_gradients():
    q, k, v, g, beta, lamb, h_kk, h_kv = mesa_inputs(seed=4, batch=3, length=5)
    weights = torch.randn(v.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    lengths = [5, 2, 4]
    packed = lambda x: torch.cat([x[n, :length] for n, length in enumerate(lengths)])[None]  # noqa: E731
    cu_seqlens = torch.tensor([0, 5, 7, 11])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, h_kk, h_kv)]
    with mc.fla_on_cpu():
        o, final_kk, final_kv = mesa_ops.chunk_mesa_net(
            packed(leaves[0]), packed(leaves[1]), packed(leaves[2]), packed(g), packed(beta), lamb,
            h_kk_init=leaves[3], h_kv_init=leaves[4], output_final_state=True, max_CG_iteration=5,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        packed_grads = torch.autograd.grad((o * packed(weights)).sum() + final_kk.sum() + final_kv.sum(), leaves)
        single_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, h_kk, h_kv)]
        total = 0.0
        for n, length in enumerate(lengths):
            cut = lambda x: x[n:n + 1, :length]  # noqa: E731
            o_n, kk_n, kv_n = mesa_ops.chunk_mesa_net(
                cut(single_leaves[0]), cut(single_leaves[1]), cut(single_leaves[2]), cut(g), cut(beta), lamb,
                h_kk_init=single_leaves[3][n:n + 1], h_kv_init=single_leaves[4][n:n + 1], output_final_state=True,
                max_CG_iteration=5, use_qk_l2norm_in_kernel=True)
            start = sum(lengths[:n])
            assert relative_error(o[:, start:start + length], o_n) <= EXACT
            assert relative_error(final_kk[n], kk_n[0]) <= EXACT and relative_error(final_kv[n], kv_n[0]) <= EXACT
            total = total + (o_n * cut(weights)).sum() + kk_n.sum() + kv_n.sum()
        single_grads = torch.autograd.grad(total, single_leaves)
    for got, want in zip(packed_grads, single_grads):
        assert relative_error(got, want) <= 1e-10


def test_decoding_step_follows_fla_kernel_and_agrees_with_its_naive_reference_when_converged():
    q, k, v, g, beta, lamb, h_kk, h_kv = mesa_inputs(seed=6, length=1, dim=5)
    step = lambda x: x[:, 0]  # noqa: E731
    with mc.fla_on_cpu():
        o, new_kk, new_kv = mesa_ops.mesa_net_decoding_one_step(step(q), step(k), step(v), step(g), lamb, step(beta),
                                                                h_kk, h_kv, max_CG_iteration=3)
        converged = mesa_ops.mesa_net_decoding_one_step(step(q), step(k), step(v), step(g), lamb, step(beta), h_kk,
                                                        h_kv, max_CG_iteration=30)
    expected, _, want_kk, want_kv = per_token_mesa(q, k, v, g, beta, lamb, 3, h_kk, h_kv, jacobi_start=True)
    assert relative_error(o, step(expected)) <= EXACT
    assert relative_error(new_kk, want_kk) <= EXACT and relative_error(new_kv, want_kv) <= EXACT
    # fla's naive reference starts from q / (diag + λ), without the kernel's 1e-5: converged, the two agree
    naive = fla_naive_float64(naive_mesa_net_decoding_one_step, step(q), step(k), step(v), step(g), lamb, step(beta),
                              h_kk, h_kv, max_CG_iteration=30)
    assert relative_error(converged[0], naive[0]) <= 1e-6
    assert relative_error(converged[1], naive[1]) <= EXACT and relative_error(converged[2], naive[2]) <= EXACT


# -- the adapter -----------------------------------------------------------------------------------------------------
MESA_CONFIGS = {
    "mesa_net": common_config(num_heads=2, head_dim=16),
    # the gated norm, 3 CG steps (q* far from the exact solve: the rebuild follows the layer's step count)
    "mesa_net_gated": common_config(num_heads=2, head_dim=8, use_output_gate=True, max_cg_step_training=3),
}
MESA_OPS = ("chunk_mesa_net", "mesa_net_decoding_one_step")


def make_mesa_model(name, dtype=torch.float32, seed=0):
    config = fla_models.MesaNetConfig(**MESA_CONFIGS[name])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return scale_up_mixer_weights(model, seed)


def mesa_net_impulse(kwargs):
    """α (B, H, T, T) of fla's MesaNet op from its recorded inputs: q, k L2-normalised as in the kernel, then fla's
    ``naive_mesa_net_CG`` (one chunk of T tokens, ``max_CG_iteration`` steps) in float64 on one-hot values, K
    columns at a time (its values must have K channels)."""
    t = _delta_inputs(kwargs, "q", "k", "beta", "g")
    batch, length, heads, dim = t["q"].shape
    eye = one_hot_values(batch, length, heads)
    columns = []
    for start in range(0, length, dim):
        block = eye[..., start:start + dim]
        width = block.shape[-1]
        block = torch.cat([block, block.new_zeros(*block.shape[:-1], dim - width)], dim=-1)
        out, _, _ = fla_naive_float64(naive_mesa_net_CG, t["q"], t["k"], block, t["g"], kwargs["lamb"].double(),
                                      t["beta"], chunk_size=length, max_CG_iteration=kwargs["max_CG_iteration"])
        columns.append(out[..., :width])
    return torch.cat(columns, dim=-1).double().permute(0, 2, 1, 3)


@pytest.mark.parametrize("name", list(MESA_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unified_identity_out_proj_input_equals_H_x(name, dtype):
    model = make_mesa_model(name, dtype)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    operators, _, _ = mc.build_operators(model, ids, mask, formulation="unified")
    records, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.v_proj.register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=out.detach())))
        handles.append(mixer.o_proj.register_forward_pre_hook(
            lambda mod, args, mixer=mixer: records.setdefault(mixer, {}).update(out_in=args[0].detach())))
    run_hooked(model, ids, mask, handles)
    mixers = fla_mixers(model)
    assert len(operators) == len(mixers) == 2
    for mixer, op in zip(mixers, operators.values()):
        real = mask.bool()  # fla unpads: the hooks see the real tokens packed
        x = torch.zeros(*ids.shape, records[mixer]["x"].shape[-1], dtype=torch.float64)
        x[real] = records[mixer]["x"].double().reshape(-1, x.shape[-1])
        expected = torch.zeros_like(x)
        expected[real] = records[mixer]["out_in"].double().reshape(-1, x.shape[-1])
        got = torch.einsum("bcis,bsc->bic", op.maps(reduce=None).double(), x)
        assert relative_error(got, expected) <= (1e-5 if dtype == torch.float64 else 3e-5), name
        assert expected.abs().max() > 1e-3
    assert_untouched(model, before)


@pytest.mark.parametrize("name", list(MESA_CONFIGS))
def test_hidden_maps_equal_fla_naive_cg_impulse_response(name):
    model = make_mesa_model(name, torch.float64)
    ids = padded_batch(length=10)[0]
    with mc.fla_on_cpu(), OpRecorder(model, MESA_OPS) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators, _, _ = mc.build_operators(model, ids, None, formulation="hidden")
    assert len(recorder.calls) == len(operators) == 2
    for op, (op_name, kwargs, out) in zip(operators.values(), recorder.calls):
        assert op_name == "chunk_mesa_net" and kwargs["max_CG_iteration"] == MESA_CONFIGS[name].get(
            "max_cg_step_training", 30)
        alpha = op.maps(reduce=None)  # (B, H, L, L)
        assert relative_error(alpha, mesa_net_impulse(kwargs)) <= 1e-6, name
        got = torch.einsum("bhts,bshp->bthp", alpha, kwargs["v"].double())
        assert relative_error(got, out.double()) <= 1e-6


@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_batch_equals_single_examples_to_the_layers_float32_gates(formulation):
    """fla's layer takes β, g and λ in float32 (``.float()``) even in a float64 model, and torch's float32 sigmoid
    on a CPU is not the same bit for bit at every position of a tensor (vector body and scalar tail): a batch and a
    single example differ by float32 rounding in the layer itself (and in the rebuild, which follows it). So rtol
    1e-6 here where the generic test asks 1e-9."""
    model = make_mesa_model("mesa_net", torch.float64)
    ids, mask = padded_batch(length=12)
    batched = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        single = mc.implicit_attention(model, ids[b:b + 1, real], formulation=formulation)
        for key in batched:
            torch.testing.assert_close(batched[key][b][real][:, real].double(), single[key][0].double(), rtol=1e-6,
                                       atol=1e-8)


def test_training_step_and_cached_generation_run_on_cpu():
    model = make_mesa_model("mesa_net_gated", torch.float64)
    ids, mask = padded_batch(length=9)
    with mc.fla_on_cpu():
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        model.eval()
        assert torch.isfinite(loss) and model.lm_head.weight.grad.abs().sum() > 0
        model.zero_grad(set_to_none=True)
        with torch.no_grad():  # a prefill then one cached step (the decoding op) against the whole sequence
            whole = model(input_ids=ids[1:2], use_cache=False).logits[:, -1]
            prefix = model(input_ids=ids[1:2, :-1], use_cache=True)
            step = model(input_ids=ids[1:2, -1:], past_key_values=prefix.past_key_values, use_cache=True).logits[:, -1]
    # the step's CG starts from the Jacobi guess, the chunk's from zero: 3 steps each, close but not equal
    assert 1e-12 < relative_error(step, whole) <= 1e-2
