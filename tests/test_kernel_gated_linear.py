"""The gated linear attention kernels (kernels/gated_linear): the token loop against fla's torch references, the
chunked form against the token loop (outputs, final states, gradients), strong decays, α and its rows, and the
RWKV-6 convention (fla's fused_recurrent_rwkv6 kernel in Triton's interpreter, and a hand-computed case)."""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla.ops.gla.naive import naive_recurrent_gla
from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
from fla.ops.retention.naive import naive_retention
from fla.ops.rwkv6.chunk_naive import naive_chunk_rwkv6
from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6
from fla.ops.simple_gla.naive import (naive_chunk_simple_gla, naive_parallel_simple_gla,
                                      naive_recurrent_simple_gla)

from mamba_captum.kernels.gated_linear import (gated_linear_alpha, gated_linear_alpha_rows, gated_linear_chunked,
                                               gated_linear_recurrent)

B, T, H, K, V = 2, 37, 2, 5, 3  # T: not a multiple of any chunk size used here
FLOAT32_REFERENCE = 2e-6  # fla's torch references compute in float32 whatever the input dtype
DECAYS = ["channel", "head", None]


def make_inputs(seed, decay, *, bonus=False, length=T):
    """float64 q, k (B, L, H, K), v (B, L, H, V), log decays (per channel / per head / None), bonus (H, K) or None,
    initial state (B, H, K, V)."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    q, k, v = randn(B, length, H, K), randn(B, length, H, K), randn(B, length, H, V)
    shape = {"channel": (B, length, H, K), "head": (B, length, H), None: None}[decay]
    log_decay = None if shape is None else F.logsigmoid(randn(*shape) + 1.0)
    return q, k, v, log_decay, (randn(H, K) if bonus else None), randn(B, H, K, V)


def as_float32(*tensors):
    return [None if t is None else t.float() for t in tensors]


# --- the token loop against fla's references -------------------------------------------------------------------

def test_naive_equals_fla_gla_per_channel():
    q, k, v, g, _, h0 = make_inputs(0, "channel")
    o, state = gated_linear_recurrent(q, k, v, g, initial_state=h0, output_final_state=True)
    o_fla, state_fla = naive_recurrent_gla(*as_float32(q, k, v, g), initial_state=h0.float(),
                                           output_final_state=True)
    assert o.dtype == torch.float64 and state.shape == (B, H, K, V)
    assert relative_error(o_fla, o) < FLOAT32_REFERENCE and relative_error(state_fla, state) < FLOAT32_REFERENCE


def test_naive_equals_fla_simple_gla_per_head():
    q, k, v, g, _, h0 = make_inputs(1, "head")
    o, state = gated_linear_recurrent(q, k, v, g, scale=0.3, initial_state=h0, output_final_state=True)
    o_fla, state_fla = naive_recurrent_simple_gla(*as_float32(q, k, v, g), scale=0.3, initial_state=h0.float(),
                                                  output_final_state=True)
    assert relative_error(o_fla, o) < FLOAT32_REFERENCE and relative_error(state_fla, state) < FLOAT32_REFERENCE
    # fla's chunked simple-GLA reference (it pads T to its chunk) gives the same
    o_chunk, state_chunk = naive_chunk_simple_gla(*as_float32(q, k, v, g), initial_state=h0.float(),
                                                  output_final_state=True, chunk_size=16, scale=0.3)
    assert relative_error(o_chunk, o) < FLOAT32_REFERENCE and relative_error(state_chunk, state) < FLOAT32_REFERENCE


def test_naive_equals_fla_retention():
    q, k, v, _, _, _ = make_inputs(2, None)
    # retention: simple GLA with the fixed decay log(1 − 2^(−5−h)) per head (fla's chunk_retention's g_gamma)
    gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64)))
    o, _ = gated_linear_recurrent(q, k, v, gamma.expand(B, T, H))
    o_fla = naive_retention(*(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)  # head-first layout
    assert relative_error(o_fla, o) < FLOAT32_REFERENCE


def test_naive_equals_fla_linear_attention():
    q, k, v, _, _, h0 = make_inputs(3, None)
    o, state = gated_linear_recurrent(q, k, v, None, scale=0.7, initial_state=h0, output_final_state=True)
    o_fla, state_fla = naive_recurrent_linear_attn(*as_float32(q, k, v), scale=0.7, initial_state=h0.float(),
                                                   output_final_state=True, normalize=False)
    assert relative_error(o_fla, o) < FLOAT32_REFERENCE and relative_error(state_fla, state) < FLOAT32_REFERENCE


def test_naive_equals_fla_rwkv6_references():
    q, k, v, w, u, h0 = make_inputs(4, "channel", bonus=True)
    o, state = gated_linear_recurrent(q, k, v, w, bonus=u, initial_state=h0, output_final_state=True)
    head_first = [x.float().transpose(1, 2) for x in (q, k, v, w)]
    o_fla, state_fla = naive_recurrent_rwkv6(*head_first, u.float(), initial_state=h0.float(),
                                             output_final_state=True)
    assert relative_error(o_fla.transpose(1, 2), o) < FLOAT32_REFERENCE
    assert relative_error(state_fla, state) < FLOAT32_REFERENCE
    # fla's chunked RWKV-6 reference: no scale (1), zero initial state, a multiple of its chunk
    o, _ = gated_linear_recurrent(q[:, :32], k[:, :32], v[:, :32], w[:, :32], bonus=u, scale=1.0)
    o_chunk = naive_chunk_rwkv6(*(x[:, :, :32] for x in head_first), u.float(), chunk_size=16)
    assert relative_error(o_chunk.transpose(1, 2), o) < FLOAT32_REFERENCE


# --- the RWKV-6 convention ---------------------------------------------------------------------------------------

def test_rwkv6_hand_computed_two_tokens():
    # one head, K = 2, V = 1; read before write: o_1 sees S_0 and the bonus, o_2 sees e^{w_1} S_0 + k_1 v_1
    q = torch.tensor([[[[1.0, 2.0]], [[0.5, -1.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[3.0, -1.0]], [[2.0, 1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[2.0]], [[-1.0]]]], dtype=torch.float64)
    w = torch.tensor([[[[-1.0, -2.0]], [[-0.5, -3.0]]]], dtype=torch.float64)
    u = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    s0 = torch.tensor([[[[1.0], [4.0]]]], dtype=torch.float64)
    scale = 0.5
    o1 = scale * (1.0 * 1.0 + 2.0 * 4.0 + (1.0 * 0.5 * 3.0 + 2.0 * 2.0 * -1.0) * 2.0)
    s1 = [math.exp(-1.0) * 1.0 + 3.0 * 2.0, math.exp(-2.0) * 4.0 + -1.0 * 2.0]
    o2 = scale * (0.5 * s1[0] + -1.0 * s1[1] + (0.5 * 0.5 * 2.0 + -1.0 * 2.0 * 1.0) * -1.0)
    s2 = [math.exp(-0.5) * s1[0] + 2.0 * -1.0, math.exp(-3.0) * s1[1] + 1.0 * -1.0]
    expected_o = torch.tensor([o1, o2], dtype=torch.float64)
    expected_state = torch.tensor(s2, dtype=torch.float64)
    for run in (gated_linear_recurrent, gated_linear_chunked):
        o, state = run(q, k, v, w, scale=scale, bonus=u, initial_state=s0, output_final_state=True)
        assert torch.allclose(o.reshape(2), expected_o, rtol=1e-14, atol=0)
        assert torch.allclose(state.reshape(2), expected_state, rtol=1e-14, atol=0)


FLA_RWKV6_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"  # before triton / fla are imported: the kernels run in the interpreter
    import torch
    import triton
    import fla.ops.rwkv6.fused_recurrent as fused_recurrent
    # the autotuner would time its configs through a GPU driver (none here); with one config it just runs it
    fused_recurrent.fused_recurrent_rwkv6_fwd_kernel.fn.configs = [triton.Config({}, num_warps=1)]
    from fla.ops.rwkv6 import fused_recurrent_rwkv6
    q, k, v, w, u, h0 = torch.load(sys.argv[1])
    o, state = fused_recurrent_rwkv6(q, k, v, w, u, scale=0.6, initial_state=h0, output_final_state=True)
    torch.save((o, state), sys.argv[2])
""")


def test_rwkv6_convention_matches_fla_fused_recurrent_kernel(tmp_path):
    """fla's Triton kernel itself (fused_recurrent_rwkv6_fwd_kernel), run by Triton's interpreter on CPU in a
    subprocess: our token loop and the chunked form match it (float32 kernel, so float32 tolerance)."""
    q, k, v, w, u, h0 = make_inputs(5, "channel", bonus=True, length=6)
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save(as_float32(q, k, v, w, u, h0), inputs)
    subprocess.run([sys.executable, "-c", FLA_RWKV6_SCRIPT, str(inputs), str(outputs)], check=True,
                   env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    o_fla, state_fla = torch.load(outputs)
    for run in (gated_linear_recurrent, gated_linear_chunked):
        o, state = run(q, k, v, w, scale=0.6, bonus=u, initial_state=h0, output_final_state=True)
        assert relative_error(o_fla, o) < FLOAT32_REFERENCE and relative_error(state_fla, state) < FLOAT32_REFERENCE


# --- chunked against the token loop ------------------------------------------------------------------------------

def assert_chunked_equals_naive(q, k, v, g, u, h0, *, chunk_size, tolerance=1e-12):
    """Outputs, final states and the gradients (of a random projection of both) of every input agree."""
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, u, h0) if x is not None]
    projection = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    state_projection = torch.randn(h0.shape, dtype=torch.float64)
    results = []
    for run, options in ((gated_linear_recurrent, {}), (gated_linear_chunked, {"chunk_size": chunk_size})):
        it = iter(inputs)
        args = [next(it) if x is not None else None for x in (q, k, v, g, u, h0)]
        o, state = run(*args[:4], bonus=args[4], initial_state=args[5], output_final_state=True, **options)
        assert torch.isfinite(o).all() and torch.isfinite(state).all()
        grads = torch.autograd.grad((o * projection).sum() + (state * state_projection).sum(), inputs)
        assert all(torch.isfinite(grad).all() for grad in grads)
        results.append((o, state, grads))
    (o, state, grads), (o_chunked, state_chunked, grads_chunked) = results
    assert o_chunked.dtype == torch.float64 and state_chunked.dtype == torch.float64
    assert relative_error(o_chunked, o) < tolerance and relative_error(state_chunked, state) < tolerance
    for grad_chunked, grad in zip(grads_chunked, grads):
        assert relative_error(grad_chunked, grad) < tolerance


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("bonus", [False, True], ids=["gla", "rwkv6"])
def test_chunked_equals_naive(decay, bonus):
    # chunks of 16: per-channel decays run two sub-chunks of 8 per chunk
    q, k, v, g, u, h0 = make_inputs(6, decay, bonus=bonus)
    assert_chunked_equals_naive(q, k, v, g, u, h0, chunk_size=16)


@pytest.mark.parametrize("chunk_size", [8, 12, 32, 64])
def test_chunked_per_channel_chunk_sizes(chunk_size):
    # 8: one sub-chunk per chunk; 12 (not a multiple of 8): one pairwise sub-chunk of 12; 32: four sub-chunks;
    # 64 > T: a single chunk
    q, k, v, g, u, h0 = make_inputs(7, "channel", bonus=chunk_size == 32)
    assert_chunked_equals_naive(q, k, v, g, u, h0, chunk_size=chunk_size)


def strong_decays(g):
    """Log decays of −30 a step at three tokens of four, weak (about −0.003) at the fourth: the cumulative sum falls
    below −745 within 37 tokens (e^Γ underflows even in float64), while the weight of a token on the next one across
    a weak decay stays about 1 — its exponent must be a difference of cumulative sums, never a ratio of
    exponentials."""
    weak = torch.arange(T)[(None, slice(None)) + (None,) * (g.dim() - 2)] % 4 == 3
    return torch.where(weak, 0.01 * g, torch.full_like(g, -30.0))


@pytest.mark.parametrize("decay", ["channel", "head"])
@pytest.mark.parametrize("bonus", [False, True], ids=["gla", "rwkv6"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_strong_decays(decay, bonus, chunk_size):
    q, k, v, g, u, h0 = make_inputs(8, decay, bonus=bonus)
    g = strong_decays(g)
    assert g.min() == -30.0 and g.sum(1).max() < -745
    assert_chunked_equals_naive(q, k, v, g, u, h0, chunk_size=chunk_size)
    # float32: e^Γ underflows after 4 tokens; the chunked form stays at float32 accuracy, gradients finite
    inputs = [x.float().requires_grad_() for x in (q, k, v, g)]
    o, state = gated_linear_chunked(*inputs, bonus=None if u is None else u.float(), initial_state=h0.float(),
                                    output_final_state=True, chunk_size=chunk_size)
    o_exact, state_exact = gated_linear_recurrent(q, k, v, g, bonus=u, initial_state=h0, output_final_state=True)
    assert relative_error(o, o_exact) < 1e-6 and relative_error(state, state_exact) < 1e-6
    assert all(torch.isfinite(grad).all() for grad in torch.autograd.grad(o.sum() + state.sum(), inputs))


def test_chunked_float32_and_no_state():
    q, k, v, g, _, _ = make_inputs(10, "channel")
    o, state = gated_linear_chunked(*as_float32(q, k, v, g), chunk_size=16)
    assert o.dtype == torch.float32 and state is None
    assert relative_error(o, gated_linear_recurrent(q, k, v, g)[0]) < 1e-6


# --- α --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("bonus", [False, True], ids=["gla", "rwkv6"])
def test_alpha_reproduces_the_output(decay, bonus):
    q, k, v, g, u, _ = make_inputs(11, decay, bonus=bonus)
    alpha = gated_linear_alpha(q, k, g, scale=0.8, bonus=u)
    assert alpha.shape == (B, H, T, T) and alpha.dtype == torch.float64
    assert torch.equal(alpha.triu(1), torch.zeros_like(alpha))  # causal; the diagonal is the token's own weight
    assert alpha.diagonal(dim1=-2, dim2=-1).abs().min() > 0
    o, _ = gated_linear_recurrent(q, k, v, g, scale=0.8, bonus=u)
    assert relative_error(torch.einsum("bhts,bshv->bthv", alpha, v), o) < 1e-13


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("bonus", [False, True], ids=["gla", "rwkv6"])
def test_alpha_rows_equal_alpha(decay, bonus):
    q, k, v, g, u, _ = make_inputs(12, decay, bonus=bonus)
    alpha = gated_linear_alpha(q, k, g, bonus=u)
    rows = [36, 0, 17, 8, 7, 9, 17]  # any order, repeats, at and around column-block edges
    for block_size in (8, 16, None):
        picked = gated_linear_alpha_rows(q[1], k[1], None if g is None else g[1], rows, bonus=u,
                                         block_size=block_size)
        assert picked.shape == (H, len(rows), T)
        assert relative_error(picked, alpha[1][:, rows]) < 1e-14


def test_alpha_strong_decays_and_fla_attention_matrix():
    q, k, v, g, u, _ = make_inputs(13, "channel", bonus=True)
    for bonus in (None, u):
        alpha = gated_linear_alpha(q, k, strong_decays(g), bonus=bonus)
        o, _ = gated_linear_recurrent(q, k, v, strong_decays(g), bonus=bonus)
        assert torch.isfinite(alpha).all() and relative_error(torch.einsum("bhts,bshv->bthv", alpha, v), o) < 1e-13
        rows = gated_linear_alpha_rows(q[0].float(), k[0].float(), strong_decays(g)[0].float(), [36, 3, 20],
                                       bonus=None if bonus is None else bonus.float(), block_size=8)
        assert rows.dtype == torch.float32 and relative_error(rows, alpha[0][:, [36, 3, 20]]) < 1e-6
    # one decay per head: fla's parallel simple-GLA reference returns its attention matrix A, which is α
    q, k, v, g, _, _ = make_inputs(14, "head")
    _, attention = naive_parallel_simple_gla(*as_float32(q, k, v, g))
    assert relative_error(attention, gated_linear_alpha(q, k, g)) < FLOAT32_REFERENCE
