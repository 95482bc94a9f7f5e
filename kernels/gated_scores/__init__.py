"""Decayed linear attention's implicit attention: MiniMax's lightning attention and xLSTM's mLSTM.

Per head h (one number per head, shared by its value channels)::

    α_h[i, j] = (q_i · k_j) · exp(G_i − G_j + log_col_j + log_row_i)     for j ≤ i,  0 above the diagonal

with G a cumulative log decay (non-increasing in i: MiniMax ``G_i = −λ_h i``; mLSTM ``G_i = Σ_{r≤i} log f_r``),
log_col a per-key log weight (mLSTM's log input gate) and log_row a per-query one (mLSTM's stabiliser and
normaliser). Exponents are formed in float64 and masked before the exp, as the real kernels keep them bounded.

- :func:`gated_scores_alpha_naive`: the whole (B, H, L, L) stack in float64, the test reference.
- :func:`gated_scores_alpha_rows`: the rows of one batch element, (H, R, L), in the dtype of q; what the library
  calls tile by tile.

Inputs: q, k (B, L, H, K), cumulative (B, L, H), log_col and log_row (B, L, H) or None.
"""
from __future__ import annotations

import torch

__all__ = ["gated_scores_alpha_naive", "gated_scores_alpha_rows"]


def _exponent(cumulative, log_col, log_row, rows):
    """(H, R, L) float64: G_i − G_j + log_col_j + log_row_i, −inf above the diagonal. Inputs of one element."""
    cumulative = cumulative.to(torch.float64)
    exponent = cumulative[rows].T[:, :, None] - cumulative.T[:, None, :]
    if log_col is not None:
        exponent = exponent + log_col.to(torch.float64).T[:, None, :]
    if log_row is not None:
        exponent = exponent + log_row.to(torch.float64)[rows].T[:, :, None]
    keys = torch.arange(cumulative.shape[0], device=cumulative.device)
    return exponent.masked_fill(keys[None, None, :] > rows[None, :, None], float("-inf"))


def gated_scores_alpha_rows(q, k, cumulative, log_col, log_row, rows):
    """α_h[rows, :] of one batch element: (H, R, L) in q's dtype.

    Args:
        q, k: (L, H, K). cumulative: (L, H). log_col, log_row: (L, H) or None. rows: (R,) int64.
    """
    scores = torch.einsum("rhk,lhk->hrl", q[rows], k)
    return scores * _exponent(cumulative, log_col, log_row, rows).exp().to(q.dtype)


def gated_scores_alpha_naive(q, k, cumulative, log_col=None, log_row=None):
    """α (B, H, L, L) float64, by the formula of the module docstring, one element and head pair at a time."""
    batch, length, heads, _ = q.shape
    out = torch.zeros(batch, heads, length, length, dtype=torch.float64)
    for b in range(batch):
        for i in range(length):
            for j in range(i + 1):
                exponent = cumulative[b, i].double() - cumulative[b, j].double()
                if log_col is not None:
                    exponent = exponent + log_col[b, j].double()
                if log_row is not None:
                    exponent = exponent + log_row[b, i].double()
                out[b, :, i, j] = (q[b, i].double() * k[b, j].double()).sum(-1) * exponent.exp()
    return out
