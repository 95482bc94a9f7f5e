"""Plain-torch scans used to check a rebuilt operator against the layer's real output.

They are sequential (one step per token) and deliberately simple: their job is to be obviously right, not fast.
The fast, differentiable scans belong to the kernels issue and will sit beside these.
"""
from __future__ import annotations

import torch


def selective_scan_reference(u, delta, A, B, C):
    """Mamba-1 selective scan without the D skip and the gate.

    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,  y_t = C_t · h_t  (per channel, state size N).

    Args:
        u: (B, L, D) scan input.  delta: (B, L, D) step sizes (softplus applied).
        A: (D, N) negative decay rates.  B, C: (B, L, N).
    Returns:
        y: (B, L, D), in the dtype of ``u``.
    """
    batch, length, channels = u.shape
    state = u.new_zeros(batch, channels, A.shape[-1])
    out = torch.empty_like(u)
    for t in range(length):
        decay = torch.exp(delta[:, t, :, None] * A)
        state = decay * state + (delta[:, t] * u[:, t])[:, :, None] * B[:, t, None, :]
        out[:, t] = (state * C[:, t, None, :]).sum(-1)
    return out


def ssd_scan_reference(x, delta, A, B, C):
    """Mamba-2 (SSD) scan without the D skip.

    h_t = exp(delta_t A_h) h_{t-1} + delta_t x_t B_tᵀ,  y_t = h_t C_t  (per head h; head h reads group h // (H/G)).

    Args:
        x: (B, L, H, P).  delta: (B, L, H).  A: (H,).  B, C: (B, L, G, N).
    Returns:
        y: (B, L, H, P), in the dtype of ``x``.
    """
    batch, length, heads, head_dim = x.shape
    groups = B.shape[2]
    B = B.repeat_interleave(heads // groups, dim=2)
    C = C.repeat_interleave(heads // groups, dim=2)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    out = torch.empty_like(x)
    for t in range(length):
        decay = torch.exp(delta[:, t] * A)[:, :, None, None]
        state = decay * state + (delta[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        out[:, t] = (state * C[:, t, :, None, :]).sum(-1)
    return out
