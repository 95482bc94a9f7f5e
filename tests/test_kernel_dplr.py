"""kernels.dplr: RWKV-7's generalized delta rule (diagonal plus low rank) against flash-linear-attention 0.6.0.

The per-token loop equals fla's ``dplr_recurrence`` bit for bit; the chunked WY form equals the loop (outputs, final
states and every gradient) in float64 for chunk sizes that cut the sequence mid-chunk, for decays down to −30 per
token on both of its paths (sub-chunks as one GEMM, and pairwise), and for RWKV-7's own parametrisation; α
reproduces the outputs and a product of explicit transition matrices; fla's Triton kernels (interpreted, in a
subprocess) agree in float32.
"""
import os
import subprocess
import sys
import textwrap
from unittest import mock

import torch
from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

from conftest import relative_error
from mamba_captum.kernels.dplr import dplr_alpha, dplr_alpha_rows, dplr_chunked, dplr_recurrent
from mamba_captum.kernels.dplr.chunked import _cumulative_chunks, _plan

BATCH, LENGTH, HEADS, KEY, VALUE = 2, 37, 2, 5, 3


def make_inputs(seed=0, dtype=torch.float64, decay_scale=1.0, rwkv=False, length=LENGTH, key=KEY, value=VALUE):
    """(q, k, v, a, b, log_decay, initial_state). Generic: a, b small random (a transition near D); rwkv: a = −kk,
    b = kk ⊙ gate with kk unit-norm per head and gate in (0, 1), log decay −e^{−1/2} σ(·) as fla's RWKV7Attention.
    log_decay = −decay_scale · U(0, 1) otherwise."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    shape = (BATCH, length, HEADS, key)
    q, k, v = rand(*shape), rand(*shape), rand(BATCH, length, HEADS, value)
    if rwkv:
        kk = torch.nn.functional.normalize(rand(*shape), dim=-1)
        gate = torch.rand(*shape, generator=g, dtype=dtype)
        a, b = -kk, kk * gate
        log_decay = -0.6065306597126334 * torch.sigmoid(rand(*shape))
    else:
        a, b = 0.4 * rand(*shape), 0.4 * rand(*shape)
        log_decay = -decay_scale * torch.rand(*shape, generator=g, dtype=dtype)
    initial_state = rand(BATCH, HEADS, key, value)
    return q, k, v, a, b, log_decay, initial_state


def results(fn, inputs, seed=1, **kw):
    """[o, final state, then the gradients of a random projection of both w.r.t. q, k, v, a, b, log_decay and the
    initial state]."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    *tensors, initial_state = inputs
    o, final = fn(*tensors, initial_state=initial_state, output_final_state=True, **kw)
    g = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() \
        + (final * torch.randn(final.shape, generator=g, dtype=final.dtype)).sum()
    return [o.detach(), final.detach(), *torch.autograd.grad(loss, inputs)]


def assert_all_close(got, expected, tolerance, decay_gradient_scale=None):
    """Each result within ``tolerance`` of the reference, relative to its largest entry; d log_decay relative to
    ``decay_gradient_scale`` instead where given (see the strong-decay test)."""
    names = ["o", "final state", "dq", "dk", "dv", "da", "db", "dlog_decay", "dinitial_state"]
    for name, x, y in zip(names, got, expected):
        assert torch.isfinite(x).all(), name
        if name == "dlog_decay" and decay_gradient_scale is not None:
            error = (x - y).abs().max().item() / decay_gradient_scale
        else:
            error = relative_error(x, y)
        assert error < tolerance, (name, error)


# -- the loop against fla's reference ---------------------------------------------------------------------------------
def fla_reference(q, k, v, a, b, log_decay, initial_state):
    """fla's dplr_recurrence on (B, L, H, ·) inputs; it runs head-first and with scale K^−½."""
    head_first = lambda x: x.transpose(1, 2)  # noqa: E731
    o, final = dplr_recurrence(*(head_first(x) for x in (q, k, v, a, b, log_decay)), initial_state=initial_state,
                               output_final_state=True)
    return head_first(o), final


def test_loop_equals_fla_dplr_recurrence_bit_for_bit():
    q, k, v, a, b, log_decay, initial_state = make_inputs()
    o, final = dplr_recurrent(q, k, v, a, b, log_decay, initial_state=initial_state, output_final_state=True)
    # fla's reference casts its inputs with .float() first; as an identity it runs the same steps in float64
    with mock.patch.object(torch.Tensor, "float", lambda self: self):
        fla_o, fla_final = fla_reference(q, k, v, a, b, log_decay, initial_state)
    assert fla_o.dtype == torch.float64 and fla_final.dtype == torch.float64
    assert torch.equal(o, fla_o) and torch.equal(final, fla_final)
    # unpatched, in float32
    inputs32 = [x.float() for x in (q, k, v, a, b, log_decay, initial_state)]
    o32, final32 = dplr_recurrent(*inputs32[:-1], initial_state=inputs32[-1], output_final_state=True)
    fla_o32, fla_final32 = fla_reference(*inputs32)
    assert o32.dtype == torch.float32 and torch.equal(o32, fla_o32) and torch.equal(final32, fla_final32)


def test_loop_matches_the_dplr_update_written_out():
    # one step from a known state: S_1 = D S_0 + b (aᵀ S_0) + k vᵀ, o = scale S_1ᵀ q; the initial state is read
    q, k, v, a, b, log_decay, initial_state = (x[:, :1] if x.dim() == 4 and x.shape[1] == LENGTH else x
                                               for x in make_inputs())
    o, final = dplr_recurrent(q, k, v, a, b, log_decay, scale=0.7, initial_state=initial_state,
                              output_final_state=True)
    expected = log_decay[:, 0].exp()[..., None] * initial_state \
        + b[:, 0, :, :, None] * torch.einsum("bhk,bhkv->bhv", a[:, 0], initial_state)[:, :, None, :] \
        + k[:, 0, :, :, None] * v[:, 0, :, None, :]
    assert relative_error(final, expected) < 1e-15
    assert relative_error(o[:, 0], 0.7 * torch.einsum("bhk,bhkv->bhv", q[:, 0], expected)) < 1e-15


# -- the chunked form against the loop --------------------------------------------------------------------------------
def test_chunked_equals_the_loop_with_gradients():
    inputs = make_inputs()
    expected = results(dplr_recurrent, inputs)
    for chunk_size, sub_chunk in ((8, 8), (16, 4), (12, 5), (37, 37)):  # 37 tokens: partial last chunks, and one
        assert_all_close(results(dplr_chunked, inputs, chunk_size=chunk_size, sub_chunk=sub_chunk), expected, 1e-12)
    assert_all_close(results(dplr_chunked, inputs, scale=0.3), results(dplr_recurrent, inputs, scale=0.3), 1e-12)


def test_chunked_without_initial_or_final_state():
    q, k, v, a, b, log_decay, _ = make_inputs()
    o, final = dplr_chunked(q, k, v, a, b, log_decay, chunk_size=8)
    expected, _ = dplr_recurrent(q, k, v, a, b, log_decay)
    assert final is None and relative_error(o, expected) < 1e-12


def plan_of(log_decay, chunk_size, sub_chunk):
    """(sub-chunk, factored) that dplr_chunked chooses for these decays."""
    cumulative = _cumulative_chunks(log_decay.transpose(1, 2), chunk_size)
    return _plan(cumulative, chunk_size, sub_chunk, log_decay.dtype)


def test_chunked_is_exact_for_strong_decays_on_both_paths():
    # up to −30 per token: e^{Γ} spans e^{−480} over a chunk of 16; one GEMM of e^{±480} factors (bound 600)
    inputs = list(make_inputs(decay_scale=30.0))
    assert plan_of(inputs[5], 16, 4) == (16, True)
    assert_all_close(results(dplr_chunked, inputs, chunk_size=16, sub_chunk=4), results(dplr_recurrent, inputs),
                     1e-12)
    # −50 per token: spans of 1600 and 800 at 32 and 16 tokens, past float64's range: pairwise within sub-chunks.
    # Here every path through a decay carries e^{−50}, so the true d log_decay is ~1e-22, while the chunked form
    # gets it as a sum of O(1) terms that cancel (∂/∂Γ_i and ∂/∂Γ_j of one e^{Γ_i − Γ_j}): it is held to the
    # rounding of those terms, measured against the O(1) gradient of the values
    inputs[5] = torch.full_like(inputs[5], -50.0)
    expected = results(dplr_recurrent, inputs)
    for chunk_size, sub_chunk in ((32, 16), (32, 32)):
        assert plan_of(inputs[5], chunk_size, sub_chunk) == (sub_chunk, False)
        got = results(dplr_chunked, inputs, chunk_size=chunk_size, sub_chunk=sub_chunk)
        assert_all_close(got, expected, 1e-12, decay_gradient_scale=expected[4].abs().max().item())


def test_chunked_float32_is_as_close_as_the_float32_loop_for_strong_decays():
    inputs = make_inputs(decay_scale=30.0, length=64)
    expected, expected_final = dplr_recurrent(*inputs[:-1], initial_state=inputs[-1], output_final_state=True)
    inputs32 = [x.float() for x in inputs]
    assert plan_of(inputs32[5], 16, 4)[1] is False  # float32: spans beyond 60 are formed pairwise
    for chunk_size, sub_chunk in ((16, 4), (64, 64)):
        o, final = dplr_chunked(*inputs32[:-1], initial_state=inputs32[-1], output_final_state=True,
                                chunk_size=chunk_size, sub_chunk=sub_chunk)
        assert o.dtype == torch.float32 and torch.isfinite(o).all()
        assert relative_error(o, expected) < 2e-6 and relative_error(final, expected_final) < 2e-6


def test_chunked_equals_the_loop_for_rwkv7_inputs():
    # a = −kk, b = kk ⊙ gate: the transition D − (kk ⊙ gate) kkᵀ; RWKV-7's decays, one GEMM per chunk of 16
    inputs = make_inputs(rwkv=True)
    assert plan_of(inputs[5], 16, 4) == (16, True)
    expected = results(dplr_recurrent, inputs, scale=1.0)
    assert_all_close(results(dplr_chunked, inputs, scale=1.0, chunk_size=16, sub_chunk=4), expected, 1e-12)


# -- α ----------------------------------------------------------------------------------------------------------------
def alpha_by_products(q, k, a, b, log_decay, scale):
    """α[b, h, t, s] = scale q_tᵀ M_t ⋯ M_{s+1} k_s with M_t = diag(e^{g_t}) + b_t a_tᵀ as explicit K × K matrices."""
    batch, length, heads, _ = q.shape
    transitions = torch.diag_embed(log_decay.exp()) + b[..., :, None] * a[..., None, :]  # (B, L, H, K, K)
    alpha = torch.zeros(batch, heads, length, length, dtype=q.dtype)
    for s in range(length):
        carried = k[:, s]  # (B, H, K): M_t ⋯ M_{s+1} k_s
        for t in range(s, length):
            if t > s:
                carried = torch.einsum("bhij,bhj->bhi", transitions[:, t], carried)
            alpha[:, :, t, s] = scale * (q[:, t] * carried).sum(-1)
    return alpha


def test_alpha_reproduces_the_outputs_and_the_transition_products():
    q, k, v, a, b, log_decay, _ = make_inputs()
    expected = alpha_by_products(q, k, a, b, log_decay, KEY ** -0.5)
    output, _ = dplr_recurrent(q, k, v, a, b, log_decay)
    for chunk_size, sub_chunk in ((8, 8), (16, 4), (64, 16)):
        alpha = dplr_alpha(q, k, a, b, log_decay, chunk_size=chunk_size, sub_chunk=sub_chunk)
        assert alpha.shape == (BATCH, HEADS, LENGTH, LENGTH)
        assert relative_error(alpha, expected) < 1e-12
        assert torch.equal(alpha.triu(1), torch.zeros_like(alpha))  # causal
        assert relative_error(torch.einsum("bhts,bshv->bthv", alpha, v), output) < 1e-12


def test_alpha_for_strong_decays_and_rwkv7_inputs():
    for inputs, scale in ((make_inputs(decay_scale=30.0), None), (make_inputs(rwkv=True), 1.0)):
        q, k, v, a, b, log_decay, _ = inputs
        alpha = dplr_alpha(q, k, a, b, log_decay, scale=scale, chunk_size=16, sub_chunk=4)
        assert torch.isfinite(alpha).all()
        output, _ = dplr_recurrent(q, k, v, a, b, log_decay, scale=scale)
        assert relative_error(torch.einsum("bhts,bshv->bthv", alpha, v), output) < 1e-12


def test_alpha_rows_equal_the_rows_of_alpha():
    q, k, _, a, b, log_decay, _ = make_inputs(rwkv=True)
    alpha = dplr_alpha(q, k, a, b, log_decay, scale=1.0, chunk_size=8, sub_chunk=4)
    rows = torch.tensor([36, 0, 9, 8, 17, 9, 23])  # any order, repeats, both sides of chunk borders
    for element in range(BATCH):
        got = dplr_alpha_rows(q[element], k[element], a[element], b[element], log_decay[element], rows, scale=1.0,
                              chunk_size=8, sub_chunk=4)
        assert got.shape == (HEADS, rows.numel(), LENGTH)
        assert relative_error(got, alpha[element][:, rows]) < 1e-12
    early = dplr_alpha_rows(q[0], k[0], a[0], b[0], log_decay[0], torch.tensor([3]), scale=1.0, chunk_size=8)
    assert relative_error(early, alpha[0][:, [3]]) < 1e-12 and not early[..., 4:].any()


# -- fla's Triton kernels, interpreted ---------------------------------------------------------------------------------
TRITON_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"  # chosen when the kernels are defined: before fla is imported
    import triton
    # the interpreter has no benchmarking driver: keep each autotuned kernel's first configuration
    autotune = triton.autotune
    triton.autotune = lambda configs, key, **kw: autotune(configs=configs[:1], key=key, **kw)
    import torch
    from fla.ops.rwkv7 import fused_mul_recurrent_rwkv7, fused_recurrent_rwkv7
    r, w, k, v, kk, gate, h0 = torch.load(sys.argv[1])
    o_mul, final_mul = fused_mul_recurrent_rwkv7(r, w, k, v, kk, gate, scale=1.0, initial_state=h0,
                                                 output_final_state=True)
    o_dplr, final_dplr = fused_recurrent_rwkv7(r, w, k, v, -kk, kk * gate, scale=1.0, initial_state=h0,
                                               output_final_state=True)
    torch.save([o_mul, final_mul, o_dplr, final_dplr], sys.argv[2])
""")


def test_fla_rwkv7_triton_kernels_agree(tmp_path):
    g = torch.Generator().manual_seed(3)
    shape = (1, 9, 2, 8)
    r, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    kk = torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)
    gate = torch.rand(*shape, generator=g)
    w = -0.6065306597126334 * torch.rand(*shape, generator=g)
    h0 = torch.randn(1, 2, 8, 8, generator=g)
    torch.save([r, w, k, v, kk, gate, h0], tmp_path / "inputs.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                   check=True, env=env, capture_output=True, timeout=300)
    o_mul, final_mul, o_dplr, final_dplr = torch.load(tmp_path / "out.pt")
    inputs64 = [x.double() for x in (r, k, v, -kk, kk * gate, w)]
    expected, expected_final = dplr_recurrent(*inputs64, scale=1.0, initial_state=h0.double(),
                                              output_final_state=True)
    chunked, chunked_final = dplr_chunked(*inputs64, scale=1.0, initial_state=h0.double(), output_final_state=True,
                                          chunk_size=4)
    for o, final in ((o_mul, final_mul), (o_dplr, final_dplr), (chunked, chunked_final)):
        assert relative_error(o, expected) < 1e-6 and relative_error(final, expected_final) < 1e-6
