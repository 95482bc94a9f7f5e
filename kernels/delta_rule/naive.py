"""Reference: the delta-rule recurrence run on one-hot values, token by token, in float64 (tests only)."""
from __future__ import annotations

import torch


def delta_rule_alpha_naive(q, k, beta, log_decay):
    """α (B, H, L, L) float64 with α[b, h, t, s] = o_t of head h when v_s = 1 and every other value is 0.

    Args:
        q, k: (B, L, H, K). beta: (B, L, H). log_decay: (B, L, H) (one decay per head) or (B, L, H, K) (per key
            channel).
    """
    q, k, beta, g = (t.to(torch.float64) for t in (q, k, beta, log_decay))
    batch, length, heads, dim = q.shape
    if g.dim() == 3:
        g = g[..., None].expand(batch, length, heads, dim)
    state = q.new_zeros(batch, heads, dim, length)  # column s: what the value of token s left in the state
    alpha = q.new_zeros(batch, heads, length, length)
    for t in range(length):
        state = state * g[:, t].exp()[..., None]
        k_t = k[:, t][..., None]  # (B, H, K, 1)
        state = state - beta[:, t][..., None, None] * k_t * (k_t * state).sum(-2, keepdim=True)
        state[..., t] += beta[:, t][..., None] * k[:, t]
        alpha[:, :, t] = (q[:, t][..., None] * state).sum(-2)
    return alpha
