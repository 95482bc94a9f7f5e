"""RWKV-4's WKV in Triton (GPU): the forward and backward of :mod:`.chunked`, one program per (batch element,
block of channels), the state in registers.

Forward: HF's loop token by token (state over a running max), storing the state before every token. Backward,
backwards in time: the token's wkv, own weight p_t and log Dn_t are recomputed from the stored state, then

    ∂v_t = g_t p_t + e^{k_t} λ^S_t,  ∂k_t = g_t p_t (v_t − wkv_t) + e^{k_t} (λ^S_t v_t + λ^D_t),
    ∂u += g_t p_t (v_t − wkv_t),     ∂w += e^w (λ^S_t S_{t−1} + λ^D_t D_{t−1}),
    λ_{t−1} = e^w λ_t + (g_t, −g_t wkv_t) / Dn_t     (λ over its own running max).

Sums over the batch are written per batch element and added in torch (deterministic, no atomics); the gradients
at the ends of the sequence (given and returned state) are :func:`.chunked.boundary_gradients`. float32 only
(float64 inputs take :func:`.chunked.wkv_scan_chunked`). CUDA tensors, or CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch

from .chunked import boundary_gradients
from .naive import EMPTY_MAX, start_state

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

BLOCK_C = 128  # channels per program

if triton is not None:

    @triton.jit
    def _wkv_forward(K, V, DECAY, FIRST, START, OUT, BEFORE, LAST, B, L, C, BC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = c < C
        w = tl.load(DECAY + c, mask=ok, other=0.0)
        u = tl.load(FIRST + c, mask=ok, other=0.0)
        num = tl.load(START + b * C + c, mask=ok, other=0.0)  # START, LAST: (3, B, C); BEFORE: (3, B, L, C)
        den = tl.load(START + (B + b) * C + c, mask=ok, other=0.0)
        top = tl.load(START + (2 * B + b) * C + c, mask=ok, other=0.0)
        plane = B * L * C
        for t in range(0, L):
            offset = (b * L + t) * C + c
            k = tl.load(K + offset, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(V + offset, mask=ok, other=0.0).to(tl.float32)
            tl.store(BEFORE + offset, num, mask=ok)
            tl.store(BEFORE + plane + offset, den, mask=ok)
            tl.store(BEFORE + 2 * plane + offset, top, mask=ok)
            out_top = tl.maximum(top, u + k)
            e1, e2 = tl.exp(top - out_top), tl.exp(u + k - out_top)
            tl.store(OUT + offset, (e1 * num + e2 * v) / (e1 * den + e2), mask=ok)
            new_top = tl.maximum(top + w, k)
            e1, e2 = tl.exp(top + w - new_top), tl.exp(k - new_top)
            num, den, top = e1 * num + e2 * v, e1 * den + e2, new_top
        tl.store(LAST + b * C + c, num, mask=ok)
        tl.store(LAST + (B + b) * C + c, den, mask=ok)
        tl.store(LAST + (2 * B + b) * C + c, top, mask=ok)

    @triton.jit
    def _wkv_backward(K, V, DECAY, FIRST, BEFORE, GOUT, END, GK, GV, GFIRST, GDECAY, FIRST_ADJ, B, L, C,
                      BC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = c < C
        w = tl.load(DECAY + c, mask=ok, other=0.0)
        u = tl.load(FIRST + c, mask=ok, other=0.0)
        adj_s = tl.load(END + b * C + c, mask=ok, other=0.0)  # END, FIRST_ADJ: (3, B, C) λ^S, λ^D, their max
        adj_d = tl.load(END + (B + b) * C + c, mask=ok, other=0.0)
        adj_top = tl.load(END + (2 * B + b) * C + c, mask=ok, other=0.0)
        grad_u = tl.zeros((BC,), dtype=tl.float32)
        grad_w = tl.zeros((BC,), dtype=tl.float32)
        plane = B * L * C
        for r in range(0, L):
            offset = (b * L + L - 1 - r) * C + c
            k = tl.load(K + offset, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(V + offset, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(GOUT + offset, mask=ok, other=0.0)
            num = tl.load(BEFORE + offset, mask=ok, other=0.0)
            den = tl.load(BEFORE + plane + offset, mask=ok, other=0.0)
            top = tl.load(BEFORE + 2 * plane + offset, mask=ok, other=0.0)
            out_top = tl.maximum(top, u + k)
            e1, e2 = tl.exp(top - out_top), tl.exp(u + k - out_top)
            norm = e1 * den + e2
            wkv = (e1 * num + e2 * v) / norm
            direct = g * e2 / norm
            scale = tl.exp(adj_top + k)
            tl.store(GV + offset, direct + adj_s * scale, mask=ok)
            tl.store(GK + offset, direct * (v - wkv) + scale * (adj_s * v + adj_d), mask=ok)
            grad_u += tl.where(ok, direct * (v - wkv), 0.0)
            grad_w += tl.where(ok, (adj_s * num + adj_d * den) * tl.exp(adj_top + w + top), 0.0)
            # λ_{t−1} = e^w λ_t + (g, −g wkv) / Dn_t
            log_norm = out_top + tl.log(norm)
            decayed = adj_top + w
            new_top = tl.maximum(decayed, -log_norm)
            e1, e2 = tl.exp(decayed - new_top), tl.exp(-log_norm - new_top)
            adj_s, adj_d, adj_top = e1 * adj_s + e2 * g, e1 * adj_d - e2 * g * wkv, new_top
        tl.store(GFIRST + b * C + c, grad_u, mask=ok)
        tl.store(GDECAY + b * C + c, grad_w, mask=ok)
        tl.store(FIRST_ADJ + b * C + c, adj_s, mask=ok)
        tl.store(FIRST_ADJ + (B + b) * C + c, adj_d, mask=ok)
        tl.store(FIRST_ADJ + (2 * B + b) * C + c, adj_top, mask=ok)


def _grid(key):
    return key.shape[0], triton.cdiv(key.shape[2], BLOCK_C)


class _TritonWkvScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, time_decay, time_first, key, value, num0, den0, max0):
        batch, length, channels = key.shape
        decay, first = (-torch.exp(time_decay)).float().contiguous(), time_first.float().contiguous()
        key_c, value_c = key.contiguous(), value.contiguous()
        start = torch.stack([num0, den0, max0]).float()
        out = torch.empty(batch, length, channels, device=key.device, dtype=torch.float32)
        before = torch.empty(3, batch, length, channels, device=key.device, dtype=torch.float32)
        last = torch.empty_like(start)
        _wkv_forward[_grid(key)](key_c, value_c, decay, first, start, out, before, last, batch, length, channels,
                                 BC=BLOCK_C)
        ctx.save_for_backward(time_decay, time_first, key_c, value_c, before, start, last)
        ctx.dtypes = key.dtype, value.dtype, num0.dtype
        ctx.set_materialize_grads(False)
        return out.to(key.dtype), *(x.clone() for x in last)  # separate tensors, not views of one

    @staticmethod
    def backward(ctx, grad_wkv, *grads_last):
        time_decay, time_first, key, value, before, start, last = ctx.saved_tensors
        batch, length, channels = key.shape
        decay, first = (-torch.exp(time_decay)).float().contiguous(), time_first.float().contiguous()
        grad_wkv = torch.zeros_like(before[0]) if grad_wkv is None else grad_wkv.float().contiguous()
        zeros = torch.zeros_like(start[0])
        if all(x is None for x in grads_last):
            end = torch.stack([zeros, zeros, torch.full_like(zeros, EMPTY_MAX)])
        else:  # λ after the last token: the returned num and den are the states over e^{max}
            end = torch.stack([zeros if x is None else x.float() for x in grads_last[:2]] + [-last[2]])
        grad_k, grad_v = torch.empty_like(before[0]), torch.empty_like(before[0])
        grad_first, grad_decay = torch.empty_like(zeros), torch.empty_like(zeros)
        first_adjoint = torch.empty_like(end)
        _wkv_backward[_grid(key)](key, value, decay, first, before, grad_wkv, end.contiguous(), grad_k, grad_v,
                                  grad_first, grad_decay, first_adjoint, batch, length, channels, BC=BLOCK_C)
        grad_num0, grad_den0, grad_max0, routed_k, routed_decay = boundary_gradients(
            key.float(), decay, start.unbind(0), first_adjoint.unbind(0), last.unbind(0), grads_last)
        if routed_k is not None:
            grad_k = grad_k + routed_k
        grad_time_decay = (grad_decay.sum(0) + routed_decay) * decay  # w = −exp(time_decay)
        key_dtype, value_dtype, state_dtype = ctx.dtypes
        return (grad_time_decay.to(time_decay.dtype), grad_first.sum(0).to(time_first.dtype), grad_k.to(key_dtype),
                grad_v.to(value_dtype), grad_num0.to(state_dtype), grad_den0.to(state_dtype),
                grad_max0.to(state_dtype))


def wkv_scan_triton(time_decay, time_first, key, value, state=None, return_state=False):
    """HF's ``rwkv_linear_attention`` in Triton, differentiable (float32; see the module docstring).

    Args:
        time_decay, time_first: (C,).  key, value: (B, L, C).
        state: None, or (num, den, max), each (B, C): the state before the first token.
        return_state: return the last state even when no state was given.
    Returns:
        (wkv, state): wkv (B, L, C) in key's dtype; the last (num, den, max) as a list of (B, C) float32 tensors
        when a state was given or ``return_state``, else None.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed: use wkv_scan_chunked")
    wkv, *last = _TritonWkvScan.apply(time_decay, time_first, key, value, *start_state(key, state, torch.float32))
    return wkv, (list(last) if return_state or state is not None else None)
