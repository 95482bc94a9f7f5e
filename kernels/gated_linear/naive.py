"""Reference: the gated linear attention recurrence run token by token (tests, and the definition of the op).

Per head, with state S (K × V), log decays g_t ≤ 0 (per key channel, one per head, or none) and D_t = diag(e^{g_t})::

    GLA (bonus None):     S_t = D_t S_{t−1} + k_t v_tᵀ,      o_t = scale · S_tᵀ q_t
    RWKV-6 (bonus u):     o_t = scale · (S_{t−1} + diag(u) k_t v_tᵀ)ᵀ q_t,      S_t = D_t S_{t−1} + k_t v_tᵀ
"""
from __future__ import annotations

import torch


def gated_linear_recurrent(q, k, v, log_decay=None, *, scale=None, bonus=None, initial_state=None,
                           output_final_state=False):
    """The recurrence above, one token at a time, in the dtype of q (float64 in → float64 throughout).

    Args:
        q, k: (B, L, H, K). v: (B, L, H, V).
        log_decay: (B, L, H, K) (per key channel: GLA, HGRN2, RWKV-6), (B, L, H) (one per head: simple GLA,
            retention) or None (no decay: linear attention); ≤ 0.
        scale: multiplies the queries; None → K^−½.
        bonus: (H, K) RWKV-6's u: the read comes before the write and the current token enters through
            diag(u) instead of the state; None → GLA (write, then read).
        initial_state: (B, H, K, V) or None (zeros). output_final_state: return S_L as well.

    Returns:
        o (B, L, H, V) in the dtype of q, and S_L (B, H, K, V) when ``output_final_state``, else None.
    """
    dtype = q.dtype
    batch, length, heads, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    q, k, v = q.to(dtype) * scale, k.to(dtype), v.to(dtype)
    decay = None
    if log_decay is not None:
        decay = log_decay.to(dtype).exp()
        if decay.dim() == 3:  # one decay per head: the same for every key channel
            decay = decay[..., None].expand(batch, length, heads, dim)
    state = q.new_zeros(batch, heads, dim, v.shape[-1])
    if initial_state is not None:
        state = state + initial_state.to(dtype)
    outputs = []
    for t in range(length):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]  # (B, H, K, V)
        if bonus is not None:  # RWKV-6: read the previous state plus the bonus-weighted current token
            read = state + bonus.to(dtype)[None, :, :, None] * kv
            outputs.append((q[:, t, :, :, None] * read).sum(-2))
        if decay is not None:
            state = state * decay[:, t, :, :, None]
        state = state + kv
        if bonus is None:  # GLA: read the state that already holds token t
            outputs.append((q[:, t, :, :, None] * state).sum(-2))
    o = torch.stack(outputs, dim=1)  # (B, L, H, V)
    return o, (state if output_final_state else None)
