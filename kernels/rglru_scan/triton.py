"""The RG-LRU scan in Triton (GPU): one program per (batch element, block of channels), the state in registers.

Forward: ``h_t = a_t h_{t−1} + x_t`` token by token, every state stored (float32; y is them cast to x's dtype).
Backward: ``λ_t = ∂y_t + a_{t+1} λ_{t+1}`` backwards in time (λ_{L−1} also takes the last state's gradient), with
``∂x_t = λ_t``, ``∂a_t = λ_t h_{t−1}``, ``∂h_{−1} = a_0 λ_0``. Channels are contiguous in (B, L, C), so every load
is coalesced. float32 accumulation (float64 inputs take :func:`.chunked.rglru_scan_chunked`). CUDA tensors, or CPU
under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

BLOCK_C = 128  # channels per program

if triton is not None:

    @triton.jit
    def _rglru_forward(X, A, START, H, L, C, BC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = c < C
        h = tl.load(START + b * C + c, mask=ok, other=0.0)
        for t in range(0, L):
            offset = (b * L + t) * C + c
            x = tl.load(X + offset, mask=ok, other=0.0).to(tl.float32)
            a = tl.load(A + offset, mask=ok, other=0.0).to(tl.float32)
            h = a * h + x
            tl.store(H + offset, h, mask=ok)

    @triton.jit
    def _rglru_backward(A, H, START, GH, GLAST, GX, GA, GSTART, L, C, BC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = c < C
        start = tl.load(START + b * C + c, mask=ok, other=0.0)
        lam = tl.load(GLAST + b * C + c, mask=ok, other=0.0)
        next_decay = tl.full((BC,), 1.0, tl.float32)  # the last state takes the last state's gradient as it is
        for r in range(0, L):
            t = L - 1 - r
            offset = (b * L + t) * C + c
            lam = tl.load(GH + offset, mask=ok, other=0.0) + next_decay * lam
            previous = tl.load(H + (b * L + tl.maximum(t - 1, 0)) * C + c, mask=ok, other=0.0)
            previous = tl.where(t > 0, previous, start)  # h_{t−1}
            tl.store(GX + offset, lam, mask=ok)
            tl.store(GA + offset, lam * previous, mask=ok)
            next_decay = tl.load(A + offset, mask=ok, other=0.0).to(tl.float32)
        tl.store(GSTART + b * C + c, next_decay * lam, mask=ok)


def _grid(x):
    return x.shape[0], triton.cdiv(x.shape[2], BLOCK_C)


class _TritonRglruScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, initial_state):
        x, a = x.contiguous(), a.contiguous()
        batch, length, channels = x.shape
        start = x.new_zeros(batch, channels, dtype=torch.float32) if initial_state is None else \
            initial_state.float().contiguous()
        states = torch.empty(batch, length, channels, device=x.device, dtype=torch.float32)
        _rglru_forward[_grid(x)](x, a, start, states, length, channels, BC=BLOCK_C)
        ctx.save_for_backward(a, states, start)
        ctx.dtypes = x.dtype, None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)
        return states.to(x.dtype), states[:, -1].clone()

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        a, states, start = ctx.saved_tensors
        x_dtype, start_dtype = ctx.dtypes
        grad_y = torch.zeros_like(states) if grad_y is None else grad_y.float().contiguous()
        grad_last = torch.zeros_like(start) if grad_last is None else grad_last.float().contiguous()
        grad_x, grad_a, grad_start = torch.empty_like(states), torch.empty_like(states), torch.empty_like(start)
        _rglru_backward[_grid(states)](a, states, start, grad_y, grad_last, grad_x, grad_a, grad_start,
                                       states.shape[1], states.shape[2], BC=BLOCK_C)
        return grad_x.to(x_dtype), grad_a.to(a.dtype), None if start_dtype is None else grad_start.to(start_dtype)


def rglru_scan_triton(x, a, initial_state=None):
    """h_t = a_t h_{t−1} + x_t in Triton, differentiable (float32 accumulation; see the module docstring).

    Args:
        x: (B, L, C) scan inputs.  a: (B, L, C) decays (0 at resets).  initial_state: (B, C) or None.
    Returns:
        (y, last): y (B, L, C) the states in x's dtype; last (B, C) the last state, float32.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed: use rglru_scan_chunked")
    return _TritonRglruScan.apply(x, a, initial_state)
