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

so :func:`log_scan` runs it too (on the flipped sequence, the "keys" being −log Dn_t; every λ is again stored over
a running max). Then, all vectorised (p_t = e^{u + k_t} / Dn_t the token's own weight):

    ∂v_t = g_t p_t + e^{k_t} λ^S_t,   ∂k_t = g_t p_t (v_t − wkv_t) + e^{k_t} (λ^S_t v_t + λ^D_t),
    ∂u = Σ g_t p_t (v_t − wkv_t),     ∂w = Σ_t e^w (λ^S_t S_{t−1} + λ^D_t D_{t−1}),

and each product of a scaled λ with a scaled state is one attention weight e^{(t−1−j) w + k_j} / Dn_t ≤ 1 in
disguise: nothing overflows where HF's loop does not. Gradients reach the given state (num, den, max) and come
from the returned one (whose max, a running maximum, passes its gradient to the key, or the start, that set it).
"""
from __future__ import annotations

import torch

from ..rglru_scan.chunked import _sequence_first, _tokens_first
from .naive import EMPTY_MAX, accumulation_dtype, start_state

CHUNK = 32  # tokens per chunk: T + L/T Python steps per scan (48 at L = 512)


def log_scan(values, keys, decay, start_values, start_max, chunk: int = CHUNK):
    """X_t = e^{decay} X_{t−1} + e^{keys_t} values_t for each numerator in ``values``, all stored over one shared
    running max (X = x · e^max); no autograd (see the module docstring).

    Args:
        values: tuple of (B, L, C).  keys: (B, L, C).  decay: (C,) ≤ 0.
        start_values: tuple of (B, C), the scaled state before the first token.  start_max: (B, C).
    Returns:
        (tuple of (B, L, C), (B, L, C)): the scaled states and their max after each token.
    """
    length = keys.shape[1]
    top = _tokens_first(keys, chunk)  # (T, B, n, C): each chunk's own running max, in place
    local = [_tokens_first(v, chunk) for v in values]  # each chunk's own numerators, in place
    for i in range(1, chunk):  # token i of every chunk, from an empty state at the chunk's start
        decayed = top[i - 1] + decay
        new_top = torch.maximum(decayed, top[i])
        old, new = torch.exp(decayed - new_top), torch.exp(top[i] - new_top)
        for x in local:
            x[i].mul_(new).addcmul_(old, x[i - 1])
        top[i] = new_top
    entering_top = torch.empty_like(top[0])  # (B, n, C): the state before each chunk
    entering = [torch.empty_like(x[0]) for x in local]
    entering_top[:, 0] = start_max
    for e, s in zip(entering, start_values):
        e[:, 0] = s
    for c in range(1, entering_top.shape[1]):
        decayed = entering_top[:, c - 1] + chunk * decay
        new_top = torch.maximum(decayed, top[-1, :, c - 1])
        old, new = torch.exp(decayed - new_top), torch.exp(top[-1, :, c - 1] - new_top)
        for e, x in zip(entering, local):
            e[:, c] = old * e[:, c - 1] + new * x[-1, :, c - 1]
        entering_top[:, c] = new_top
    steps = torch.arange(1, chunk + 1, dtype=decay.dtype, device=decay.device)[:, None, None, None]
    decayed = entering_top + steps * decay  # the state before the chunk, decayed to each token of it
    merged_top = torch.maximum(decayed, top)
    old, new = torch.exp(decayed - merged_top), torch.exp(top - merged_top)
    merged = [old * e + new * x for e, x in zip(entering, local)]
    return tuple(_sequence_first(x, length) for x in merged), _sequence_first(merged_top, length)


def outputs(k, v, first, before_num, before_den, before_max):
    """wkv_t, the token's own weight p_t = e^{u + k_t} / Dn_t and log Dn_t, from the state before each token.
    All (B, L, C)."""
    top = torch.maximum(before_max, k + first)
    e1, e2 = torch.exp(before_max - top), torch.exp(k + first - top)
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
        (num, den), top = log_scan((v, torch.ones_like(v)), k, decay, (num0, den0), max0, chunk)
        before = [torch.cat([s0[:, None], s[:, :-1]], dim=1) for s0, s in ((num0, num), (den0, den), (max0, top))]
        last = num[:, -1].clone(), den[:, -1].clone(), top[:, -1].clone()
        ctx.save_for_backward(time_decay, time_first, k, v, *before, num0, den0, max0, *last)
        ctx.chunk, ctx.dtypes = chunk, (key.dtype, value.dtype, num0.dtype)
        ctx.set_materialize_grads(False)
        return (outputs(k, v, first, *before)[0].to(key.dtype), *last)

    @staticmethod
    def backward(ctx, grad_wkv, *grads_last):
        time_decay, time_first, k, v, *before, num0, den0, max0, num_l, den_l, max_l = ctx.saved_tensors
        acc = k.dtype
        decay, first = (-torch.exp(time_decay)).to(acc), time_first.to(acc)
        wkv, own, log_norm = outputs(k, v, first, *before)
        g = torch.zeros_like(k) if grad_wkv is None else grad_wkv.to(acc)
        zeros = torch.zeros_like(num0)
        if all(x is None for x in grads_last):
            end = zeros, zeros, torch.full_like(zeros, EMPTY_MAX)
        else:  # λ after the last token: the returned num and den are the states over e^{max_l}
            end = tuple(zeros if x is None else x.to(acc) for x in grads_last[:2]) + (-max_l,)
        (adj_s, adj_d), adj_max = log_scan((g.flip(1), (-g * wkv).flip(1)), (-log_norm).flip(1), decay, end[:2],
                                           end[2], ctx.chunk)
        adj_s, adj_d, adj_max = adj_s.flip(1), adj_d.flip(1), adj_max.flip(1)  # [t] = λ_{t−1}
        after = [torch.cat([x[:, 1:], e[:, None]], dim=1) for x, e in zip((adj_s, adj_d, adj_max), end)]  # λ_t
        scale = torch.exp(after[2] + k)  # e^{k_t} λ_t = (λ^S, λ^D) · scale
        direct = g * own
        grad_v = direct + after[0] * scale
        grad_first = direct * (v - wkv)
        grad_k = grad_first + scale * (after[0] * v + after[1])
        weight = torch.exp(after[2] + decay + before[2])  # e^w λ_t S_{t−1} = (λ^S num) · weight
        grad_decay = ((after[0] * before[0] + after[1] * before[1]) * weight).sum((0, 1))
        grad_num0, grad_den0, grad_max0, routed_k, routed_decay = boundary_gradients(
            k, decay, (num0, den0, max0), (adj_s[:, 0], adj_d[:, 0], adj_max[:, 0]), (num_l, den_l, max_l),
            grads_last)
        if routed_k is not None:
            grad_k = grad_k + routed_k
        grad_time_decay = (grad_decay + routed_decay) * decay  # w = −exp(time_decay)
        key_dtype, value_dtype, state_dtype = ctx.dtypes
        return (grad_time_decay.to(time_decay.dtype), grad_first.sum((0, 1)).to(time_first.dtype),
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
