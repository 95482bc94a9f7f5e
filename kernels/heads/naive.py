"""Reference: per-channel maps of a per-head core with channel weights and a causal conv, by the literal formula."""
from __future__ import annotations

import torch

from ..reductions import reduce_channels


def _toeplitz(taps: torch.Tensor, length: int) -> torch.Tensor:
    """(..., L, L) causal conv matrices M[t, s] = taps[..., K−1−(t−s)] for 0 ≤ t−s < K."""
    kernel = taps.shape[-1]
    out = taps.new_zeros(*taps.shape[:-1], length, length)
    index = torch.arange(length)
    for lag in range(min(kernel, length)):
        out[..., index[lag:], index[lag:] - lag] = taps[..., kernel - 1 - lag, None]
    return out


def head_maps_naive(alpha, *, row_weight=None, col_weight=None, conv_weight=None, rows=None, reduce="mean"):
    """Maps of ``diag(row) α_h diag(col) M`` per channel, float64.

    Args:
        alpha: (B, H, L, L). row_weight, col_weight: (B, L, H, P) or None. conv_weight: (H, P, K) or None.
        rows: None or (R,) query rows. reduce: "mean" | "sum" | "abs_mean" | None.
    Returns:
        (B, L, L) / (B, R, L) reduced; (B, C, L, L) / (B, C, R, L) with ``reduce=None``; C = H, or H·P when a
        weight is given.
    """
    alpha = alpha.to(torch.float64)
    batch, heads, length, _ = alpha.shape
    weights = [w for w in (row_weight, col_weight) if w is not None]
    if not weights and conv_weight is None:
        per_channel = alpha
    else:
        head_dim = weights[0].shape[-1] if weights else conv_weight.shape[1]
        per_channel = alpha.repeat_interleave(head_dim, dim=1)  # (B, H·P, L, L)
        if col_weight is not None:
            per_channel = per_channel * col_weight.to(torch.float64).flatten(2).transpose(1, 2)[:, :, None, :]
        if conv_weight is not None:
            per_channel = per_channel @ _toeplitz(conv_weight.to(torch.float64).flatten(0, 1), length)
        if row_weight is not None:
            per_channel = per_channel * row_weight.to(torch.float64).flatten(2).transpose(1, 2)[:, :, :, None]
    if rows is not None:
        per_channel = per_channel[:, :, torch.as_tensor(rows, dtype=torch.long)]
    return reduce_channels(per_channel, reduce)
