"""A fast, exact, differentiable WKV in plain torch: explicit forward and backward, O(√L) Python steps.

With w = −exp(time_decay) < 0 and u = time_first, per channel (HF's ``rwkv_linear_attention_cpu``)::

    wkv_t = (S_{t−1} + e^{u + k_t} v_t) / Dn_t,   Dn_t = D_{t−1} + e^{u + k_t},
    S_t = e^w S_{t−1} + e^{k_t} v_t,   D_t = e^w D_{t−1} + e^{k_t}.

Every state is kept as HF keeps it, numerators over a running max (S = num · e^max), so no exponential has a
positive argument. Forward: :func:`log_scan` solves the (S, D) recurrence as a two-level blocked scan (each chunk
of T tokens from an empty state, all chunks at once; the state carried across chunks; then one vectorised merge,
each merge a max-and-rescale as in HF's loop): T + L/T Python steps. The outputs follow from the state before
each token in one vectorised pass.

Backward: the adjoints λ_t = ∂L/∂(S_t, D_t) obey the same kind of recurrence backwards in time,

    λ_{t−1} = e^w λ_t + (g_t, −g_t wkv_t) / Dn_t,

so :func:`log_scan` runs it too, from the last token to the first (the "keys" being −log Dn_t; every λ is again
stored over a running max). Then, all vectorised (p_t = e^{u + k_t} / Dn_t the token's own weight):

    ∂v_t = g_t p_t + e^{k_t} λ^S_t,   ∂k_t = g_t p_t (v_t − wkv_t) + e^{k_t} (λ^S_t v_t + λ^D_t),
    ∂u = Σ g_t p_t (v_t − wkv_t),     ∂w = Σ_t e^w (λ^S_t S_{t−1} + λ^D_t D_{t−1}),

and each product of a scaled λ with a scaled state is one attention weight e^{(t−1−j) w + k_j} / Dn_t ≤ 1 in
disguise: nothing overflows where HF's loop does not. Gradients reach the given state (num, den, max) and come
from the returned one (whose max, a running maximum, passes its gradient to the key, or the start, that set it).
"""
from __future__ import annotations

import math

import torch

from .naive import EMPTY_MAX, accumulation_dtype, start_state

CHUNK = 32  # tokens per chunk: T + L/T Python steps per scan (48 at L = 512)


def _floor(dtype: torch.dtype) -> float:
    """Just above the log of the smallest normal number: where exp's result nears it, torch's CPU exp takes a slow
    path (~30x). Every exp here weighs a term against one of weight 1 (the running max's, or the token's own in
    Dn), so flooring its exponent moves nothing by more than e^floor (3e-38 in float32, 6e-308 in float64)."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp_min(_floor(x.dtype)))


def _rescale(decayed, top):
    """(old, new) = (e^{decayed − m}, e^{top − m}) with m = max(decayed, top): one of them is 1."""
    diff, floor = decayed - top, _floor(top.dtype)
    return torch.exp(diff.clamp(floor, 0.0)), torch.exp(diff.neg_().clamp_(floor, 0.0))


def log_scan(values, keys, decay, start_values, start_max, chunk: int = CHUNK, reverse: bool = False):
    """X_t = e^{decay} X_{t−1} + e^{keys_t} values_t (X_{t+1} with ``reverse``) for each numerator in ``values``,
    all stored over one shared running max (X = x · e^max); no autograd (see the module docstring).

    Args:
        values: (V, B, L, C) numerators.  keys: (B, L, C).  decay: (C,) ≤ 0.
        start_values: (V, B, C) the scaled state before the first token (after the last with ``reverse``).
        start_max: (B, C).  reverse: run from the last token to the first.
    Returns:
        ((V, B, L, C), (B, L, C)): the scaled states and their max after each token (in the scan's order).
    """
    batch, length, channels = keys.shape
    n = -(-length // chunk)
    offset = n * chunk - length if reverse else 0  # zero padding where the scan ends: it reaches no real token

    def fold(x):  # a fresh (..., B, n, T, C) copy
        out = x.new_zeros(*x.shape[:-2], n * chunk, channels)
        out[..., offset:offset + length, :] = x
        return out.view(*x.shape[:-2], n, chunk, channels)

    top, local = fold(keys), fold(values)  # each chunk's own running max and numerators, in place
    back = 1 if reverse else -1  # the token before, in the scan's order, is i + back
    for i in range(chunk - 2, -1, -1) if reverse else range(1, chunk):  # every chunk from an empty state
        decayed = top[:, :, i + back] + decay
        old, new = _rescale(decayed, top[:, :, i])
        torch.maximum(decayed, top[:, :, i], out=top[:, :, i])
        local[..., i, :].mul_(new).addcmul_(old, local[..., i + back, :])
    entering_top = start_max.new_empty(batch, n, channels)  # the state before each chunk, in the scan's order
    entering = local.new_empty(values.shape[0], batch, n, channels)
    first, exit_ = (n - 1, 0) if reverse else (0, chunk - 1)
    entering_top[:, first], entering[:, :, first] = start_max, start_values
    for c in range(n - 2, -1, -1) if reverse else range(1, n):
        decayed = entering_top[:, c + back] + chunk * decay
        old, new = _rescale(decayed, top[:, c + back, exit_])
        entering_top[:, c] = torch.maximum(decayed, top[:, c + back, exit_])
        entering[:, :, c] = old * entering[:, :, c + back] + new * local[:, :, c + back, exit_]
    steps = torch.arange(chunk, 0, -1) if reverse else torch.arange(1, chunk + 1)  # from the chunk's entry
    decayed = entering_top[:, :, None] + steps.to(decay)[:, None] * decay  # (B, n, T, C)
    old, new = _rescale(decayed, top)
    torch.maximum(decayed, top, out=top)
    local.mul_(new).addcmul_(old, entering[:, :, :, None])
    unfold = lambda x: x.view(*x.shape[:-3], n * chunk, channels)[..., offset:offset + length, :]  # noqa: E731
    return unfold(local), unfold(top)


def outputs(k, v, first, before_num, before_den, before_max):
    """wkv_t, the token's own weight p_t = e^{u + k_t} / Dn_t and log Dn_t, from the state before each token.
    All (B, L, C)."""
    top = torch.maximum(before_max, k + first)
    e1, e2 = _exp(before_max - top), _exp(k + first - top)
    den = e1 * before_den + e2
    return (e1 * before_num + e2 * v) / den, e2 / den, top + torch.log(den)


def boundary_gradients(k, decay, start, first_adjoint, last, grads_last):
    """Gradients at the two ends of the sequence.

    Args:
        k: (B, L, C).  decay: (C,).  start, last: (num, den, max) before the first and after the last token.
        first_adjoint: (λ^S, λ^D, their max) before the first token, each (B, C).
        grads_last: the gradients of the returned (num, den, max), each (B, C) or None.
    Returns:
        (∂num0, ∂den0, ∂max0, ∂k from the returned max or None, ∂w from it or 0).
    """
    num0, den0, max0 = start
    scale = torch.exp(first_adjoint[2] + max0)  # the state before the first token is num0 · e^{max0}
    grad_num0, grad_den0 = first_adjoint[0] * scale, first_adjoint[1] * scale
    grad_max0 = grad_num0 * num0 + grad_den0 * den0
    if all(g is None for g in grads_last):
        return grad_num0, grad_den0, grad_max0, None, 0.0
    # The returned max is the largest of max0 + L w and k_j + (L−1−j) w; num and den are the states over it, so
    # it also takes −(∂num · num + ∂den · den). All of that goes to the term that set it.
    through_max = sum(-g * x for g, x in zip(grads_last[:2], last[:2]) if g is not None)
    if grads_last[2] is not None:
        through_max = through_max + grads_last[2]
    length = k.shape[1]
    lags = torch.arange(length, -1, -1, dtype=k.dtype, device=k.device)[:, None]  # L, L−1, …, 0
    candidates = torch.cat([max0[:, None], k], dim=1) + lags * decay  # (B, L + 1, C)
    routed = torch.zeros_like(candidates).scatter_(1, candidates.argmax(1, keepdim=True), through_max[:, None])
    return grad_num0, grad_den0, grad_max0 + routed[:, 0], routed[:, 1:], (routed * lags).sum((0, 1))


class _WkvScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, time_decay, time_first, key, value, num0, den0, max0, chunk):
        acc = accumulation_dtype(key)
        decay, first = (-torch.exp(time_decay)).to(acc), time_first.to(acc)
        k, v = key.to(acc), value.to(acc)
        num0, den0, max0 = (s.clone() for s in (num0, den0, max0))  # HF's states are slices it overwrites in place
        (num, den), top = log_scan(torch.stack([v, torch.ones_like(v)]), k, decay, torch.stack([num0, den0]), max0,
                                   chunk)
        before = [torch.cat([s0[:, None], s[:, :-1]], dim=1) for s0, s in ((num0, num), (den0, den), (max0, top))]
        last = num[:, -1].clone(), den[:, -1].clone(), top[:, -1].clone()
        wkv, own, log_norm = outputs(k, v, first, *before)
        ctx.save_for_backward(time_decay, k, v, *before, wkv, own, log_norm, num0, den0, max0, *last)
        ctx.chunk, ctx.dtypes = chunk, (key.dtype, value.dtype, num0.dtype, time_first.dtype)
        ctx.set_materialize_grads(False)
        return (wkv.to(key.dtype), *last)

    @staticmethod
    def backward(ctx, grad_wkv, *grads_last):
        time_decay, k, v, *before, wkv, own, log_norm, num0, den0, max0, num_l, den_l, max_l = ctx.saved_tensors
        acc = k.dtype
        decay = (-torch.exp(time_decay)).to(acc)
        g = torch.zeros_like(k) if grad_wkv is None else grad_wkv.to(acc)
        zeros = torch.zeros_like(num0)
        if all(x is None for x in grads_last):
            end = zeros, zeros, torch.full_like(zeros, EMPTY_MAX)
        else:  # λ after the last token: the returned num and den are the states over e^{max_l}
            end = tuple(zeros if x is None else x.to(acc) for x in grads_last[:2]) + (-max_l,)
        (adj_s, adj_d), adj_max = log_scan(torch.stack([g, -g * wkv]), -log_norm, decay, torch.stack(end[:2]),
                                           end[2], ctx.chunk, reverse=True)  # [t] = λ_{t−1}
        after = [torch.cat([x[:, 1:], e[:, None]], dim=1) for x, e in zip((adj_s, adj_d, adj_max), end)]  # λ_t
        scale = _exp(after[2] + k)  # e^{k_t} λ_t = (λ^S, λ^D) · scale
        direct = g * own
        grad_v = direct + after[0] * scale
        grad_first = direct * (v - wkv)
        grad_k = grad_first + scale * (after[0] * v + after[1])
        weight = _exp(after[2] + decay + before[2])  # e^w λ_t S_{t−1} = (λ^S num) · weight
        grad_decay = ((after[0] * before[0] + after[1] * before[1]) * weight).sum((0, 1))
        grad_num0, grad_den0, grad_max0, routed_k, routed_decay = boundary_gradients(
            k, decay, (num0, den0, max0), (adj_s[:, 0], adj_d[:, 0], adj_max[:, 0]), (num_l, den_l, max_l),
            grads_last)
        if routed_k is not None:
            grad_k = grad_k + routed_k
        grad_time_decay = (grad_decay + routed_decay) * decay  # w = −exp(time_decay)
        key_dtype, value_dtype, state_dtype, first_dtype = ctx.dtypes
        return (grad_time_decay.to(time_decay.dtype), grad_first.sum((0, 1)).to(first_dtype),
                grad_k.to(key_dtype), grad_v.to(value_dtype), grad_num0.to(state_dtype), grad_den0.to(state_dtype),
                grad_max0.to(state_dtype), None)


def wkv_scan_chunked(time_decay, time_first, key, value, state=None, return_state=False, chunk: int = CHUNK):
    """HF's ``rwkv_linear_attention``, differentiable, O(√L) Python steps forward and backward (see the module
    docstring).

    Args:
        time_decay, time_first: (C,).  key, value: (B, L, C).
        state: None, or (num, den, max), each (B, C): the state before the first token.
        return_state: return the last state even when no state was given.
    Returns:
        (wkv, state): wkv (B, L, C) in key's dtype; the last (num, den, max) as a list of (B, C) float32 tensors
        (float64 for float64 keys) when a state was given or ``return_state``, else None.
    """
    start = start_state(key, state, accumulation_dtype(key))
    wkv, *last = _WkvScan.apply(time_decay, time_first, key, value, *start, chunk)
    return wkv, (list(last) if return_state or state is not None else None)
