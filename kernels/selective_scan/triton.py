"""The Mamba-1 selective scan in Triton (GPU): the forward and backward of :mod:`.chunked`, one program per
(batch element, block of channels), the state in registers.

Forward: ``h_t = exp(Δ_t A) h_{t−1} + Δ_t u_t B_t``, ``y_t = C_t · h_t``, token by token; the state before every
CHUNK-th token is stored. Backward, chunks in reverse: the chunk's states are recomputed from its stored start into
a (B, D, CHUNK, N) scratch slab, then the adjoint runs backwards, ``λ_t = C_t g_t + a_{t+1} λ_{t+1}``, with

    ∂C_t = Σ_d g_t h_t,  ∂B_t = Σ_d λ_t Δ_t u_t,  ∂u_t = Δ_t Σ_n λ_t B_t,
    ∂Δ_t = Σ_n λ_t (A a_t h_{t−1}) + u_t Σ_n λ_t B_t,  ∂A = Σ_t λ_t Δ_t a_t h_{t−1}.

Sums over channels are written per channel block and added in torch (deterministic, no atomics). float32 only
(float64 inputs take :func:`.chunked.selective_scan_chunked`). CUDA tensors, or CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

from .naive import skip_and_gate, step_sizes

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

CHUNK = 64  # tokens between stored states (the backward's scratch slab is (B, D, CHUNK, N))
BLOCK_D = 16  # channels per program

if triton is not None:

    @triton.jit
    def _scan_forward(U, DELTA, A, BM, CM, Y, STARTS, LAST, D, L, N, n_chunks, CHUNK: tl.constexpr,
                      BD: tl.constexpr, NP: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        n = tl.arange(0, NP)
        d_ok, n_ok = d < D, n < N
        ok = d_ok[:, None] & n_ok[None, :]
        a_rate = tl.load(A + d[:, None] * N + n[None, :], mask=ok, other=0.0)
        h = tl.zeros((BD, NP), dtype=tl.float32)
        for t in range(0, L):
            if t % CHUNK == 0:
                tl.store(STARTS + ((b * n_chunks + t // CHUNK) * D + d[:, None]) * N + n[None, :], h, mask=ok)
            u = tl.load(U + (b * D + d) * L + t, mask=d_ok, other=0.0)
            dt = tl.load(DELTA + (b * D + d) * L + t, mask=d_ok, other=0.0)
            bt = tl.load(BM + (b * N + n) * L + t, mask=n_ok, other=0.0)
            ct = tl.load(CM + (b * N + n) * L + t, mask=n_ok, other=0.0)
            h = tl.exp(dt[:, None] * a_rate) * h + (dt * u)[:, None] * bt[None, :]
            tl.store(Y + (b * D + d) * L + t, tl.sum(h * ct[None, :], axis=1), mask=d_ok)
        tl.store(LAST + (b * D + d[:, None]) * N + n[None, :], h, mask=ok)

    @triton.jit
    def _scan_backward(U, DELTA, A, BM, CM, GY, GLAST, STARTS, SCRATCH, GU, GDELTA, GA, GB, GC, D, L, N, n_chunks,
                       n_blocks, CHUNK: tl.constexpr, BD: tl.constexpr, NP: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        d = block * BD + tl.arange(0, BD)
        n = tl.arange(0, NP)
        d_ok, n_ok = d < D, n < N
        ok = d_ok[:, None] & n_ok[None, :]
        a_rate = tl.load(A + d[:, None] * N + n[None, :], mask=ok, other=0.0)
        lam = tl.load(GLAST + (b * D + d[:, None]) * N + n[None, :], mask=ok, other=0.0)
        grad_rate = tl.zeros((BD, NP), dtype=tl.float32)
        next_decay = tl.full((BD, NP), 1.0, tl.float32)  # a_{t+1}; the last state takes grad_last as it is
        slab = SCRATCH + ((b * D + d[:, None]) * CHUNK) * N + n[None, :]  # this program's (BD, CHUNK, N) slab
        for back in range(0, n_chunks):
            index = n_chunks - 1 - back
            t0 = index * CHUNK
            t1 = tl.minimum(L, t0 + CHUNK)
            start = tl.load(STARTS + ((b * n_chunks + index) * D + d[:, None]) * N + n[None, :], mask=ok, other=0.0)
            h = start
            for t in range(t0, t1):  # recompute the chunk's states
                u = tl.load(U + (b * D + d) * L + t, mask=d_ok, other=0.0)
                dt = tl.load(DELTA + (b * D + d) * L + t, mask=d_ok, other=0.0)
                bt = tl.load(BM + (b * N + n) * L + t, mask=n_ok, other=0.0)
                h = tl.exp(dt[:, None] * a_rate) * h + (dt * u)[:, None] * bt[None, :]
                tl.store(slab + (t - t0) * N, h, mask=ok)
            for r in range(0, t1 - t0):
                t = t1 - 1 - r
                u = tl.load(U + (b * D + d) * L + t, mask=d_ok, other=0.0)
                dt = tl.load(DELTA + (b * D + d) * L + t, mask=d_ok, other=0.0)
                bt = tl.load(BM + (b * N + n) * L + t, mask=n_ok, other=0.0)
                ct = tl.load(CM + (b * N + n) * L + t, mask=n_ok, other=0.0)
                g = tl.load(GY + (b * D + d) * L + t, mask=d_ok, other=0.0)
                h = tl.load(slab + (t - t0) * N, mask=ok, other=0.0)
                if t > t0:
                    previous = tl.load(slab + (t - 1 - t0) * N, mask=ok, other=0.0)
                else:
                    previous = start
                decay = tl.exp(dt[:, None] * a_rate)
                lam = lam * next_decay + g[:, None] * ct[None, :]
                lam = tl.where(ok, lam, 0.0)
                next_decay = decay
                grad_decay = lam * previous * decay  # ∂ w.r.t. Δ·A
                grad_inputs = tl.sum(lam * bt[None, :], axis=1)  # ∂ w.r.t. Δ·u
                tl.store(GU + (b * D + d) * L + t, grad_inputs * dt, mask=d_ok)
                tl.store(GDELTA + (b * D + d) * L + t, tl.sum(grad_decay * a_rate, axis=1) + grad_inputs * u,
                         mask=d_ok)
                grad_rate += grad_decay * dt[:, None]
                partial = (b * n_blocks + block) * N + n
                tl.store(GC + partial * L + t, tl.sum(g[:, None] * h, axis=0), mask=n_ok)
                tl.store(GB + partial * L + t, tl.sum(lam * (dt * u)[:, None], axis=0), mask=n_ok)
        tl.store(GA + (b * D + d[:, None]) * N + n[None, :], grad_rate, mask=ok)


class _TritonScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C):
        u, delta, A, B, C = (t.float().contiguous() for t in (u, delta, A, B, C))
        batch, channels, length = u.shape
        state = A.shape[1]
        n_chunks = triton.cdiv(length, CHUNK)
        y = torch.empty_like(u)
        starts = torch.empty(batch, n_chunks, channels, state, device=u.device)
        last = torch.empty(batch, channels, state, device=u.device)
        grid = (batch, triton.cdiv(channels, BLOCK_D))
        _scan_forward[grid](u, delta, A, B, C, y, starts, last, channels, length, state, n_chunks, CHUNK=CHUNK,
                            BD=BLOCK_D, NP=triton.next_power_of_2(state))
        ctx.save_for_backward(u, delta, A, B, C, starts)
        return y, last

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        u, delta, A, B, C, starts = ctx.saved_tensors
        batch, channels, length = u.shape
        state = A.shape[1]
        n_chunks, n_blocks = starts.shape[1], triton.cdiv(channels, BLOCK_D)
        grad_y = torch.zeros_like(u) if grad_y is None else grad_y.float().contiguous()
        grad_last = torch.zeros(batch, channels, state, device=u.device) if grad_last is None else \
            grad_last.float().contiguous()
        scratch = torch.empty(batch, channels, CHUNK, state, device=u.device)
        grad_u, grad_delta = torch.empty_like(u), torch.empty_like(u)
        grad_A = torch.empty(batch, channels, state, device=u.device)
        grad_B = torch.empty(batch, n_blocks, state, length, device=u.device)
        grad_C = torch.empty_like(grad_B)
        _scan_backward[(batch, n_blocks)](u, delta, A, B, C, grad_y, grad_last, starts, scratch, grad_u, grad_delta,
                                          grad_A, grad_B, grad_C, channels, length, state, n_chunks, n_blocks,
                                          CHUNK=CHUNK, BD=BLOCK_D, NP=triton.next_power_of_2(state))
        return grad_u, grad_delta, grad_A.sum(0), grad_B.sum(1), grad_C.sum(1)


def selective_scan_triton(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                          return_last_state=False, **kwargs):
    """mamba-ssm's ``selective_scan_fn`` in Triton, differentiable (float32; see the module docstring).

    Args:
        u, delta: (B, D, L).  A: (D, N).  B, C: (B, N, L).  D: (D,) or None.  z: (B, D, L) or None.
        delta_bias: (D,) or None.  delta_softplus: apply softplus to delta (+ bias).
    Returns:
        y (B, D, L) in u's dtype; with ``return_last_state`` also the last state (B, D, N) float32.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed: use selective_scan_chunked")
    delta = step_sizes(delta, delta_bias, delta_softplus)
    y, last = _TritonScan.apply(u, delta, A, B, C)
    y = skip_and_gate(y.to(u.dtype), u, D, z)
    return (y, last) if return_last_state else y
