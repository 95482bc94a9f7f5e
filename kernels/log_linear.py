"""Log-linear attention's level weights (Guo et al. 2025, "Log-Linear Attention"; flash-linear-attention's
``chunk_log_linear_attn``) and its implicit attention.

The keys of query i are split by a Fenwick tree: key j ≤ i sits at level ℓ(i, j) = bit length of (i XOR j) over
absolute token positions (0 on the diagonal, 1 for the other token of an aligned pair, 2 for the other pair of an
aligned four, ...), and each level has its own per-query weight λ_i[ℓ]. On top of a scalar-decay core (Mamba-2's, per
head h)::

    α_h[i, j] = (q_i · k_j) · exp(G_i − G_j) · λ_{i,h}[ℓ(i, j)]        for j ≤ i,  0 above the diagonal

with G a cumulative log decay. fla's naive reference builds the same matrix level by level from masks
(``construct_level_mask``); its chunked kernel keeps one state per level of 64-token chunks.

- :func:`fenwick_levels`: ℓ(i, j) for query rows and all keys, (R, L).
- :func:`log_linear_alpha`: α for query rows, (B, H, R, L), batched: what the fla op's torch version multiplies by
  its values block by block and what the adapter holds whole.

Inputs: q, k (B, L, H, K) (one key head per value head: groups repeated by the caller), cumulative (B, L, H),
level_scales (B, L, H, n_levels).
"""
from __future__ import annotations

import torch

__all__ = ["bit_lengths", "fenwick_levels", "levels_needed", "log_linear_alpha"]


def levels_needed(length: int, offset: int = 0) -> int:
    """How many levels the tokens offset … offset + length − 1 use: 1 + the bit length of the largest XOR of two of
    their positions (at most 1 + the bit length of the last position)."""
    return (offset + length - 1).bit_length() + 1 if length > 0 else 0


def bit_lengths(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The bit length of each entry of the non-negative int64 tensor x (entries below 2 ** bits), exact in integers:
    the number of powers of two not above it."""
    powers = 2 ** torch.arange(max(bits, 1), device=x.device)
    return (x[..., None] >= powers).sum(-1)


def fenwick_levels(rows: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    """ℓ(i, j) (R, L) int64 for the query rows ``rows`` (R,) and keys 0 … L − 1, positions counted from ``offset``:
    the bit length of (i XOR j). Above the diagonal the entries are defined the same way; the caller masks them."""
    keys = torch.arange(length, device=rows.device) + offset
    xor = torch.bitwise_xor((rows + offset)[:, None], keys[None, :])
    return bit_lengths(xor, levels_needed(length, offset) - 1)


def log_linear_alpha(q, k, cumulative, level_scales, rows: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """α_h[rows, :] (B, H, R, L) by the formula of the module docstring, in the promoted dtype of q, k, cumulative
    and level_scales (fla's references compute in their inputs' dtype).

    Args:
        q, k: (B, L, H, K). cumulative: (B, L, H) Σ of the log decays up to and including each token.
        level_scales: (B, L, H, n) λ per query token, head and level; n must cover :func:`levels_needed`.
        rows: (R,) int64 query rows. offset: the absolute position of token 0 (a continued sequence).
    Raises:
        ValueError: fewer levels than the positions use.
    """
    length, n_levels = k.shape[1], level_scales.shape[-1]
    if n_levels < levels_needed(length, offset):
        raise ValueError(f"mamba_captum: log-linear attention over positions {offset}…{offset + length - 1} uses "
                         f"{levels_needed(length, offset)} levels; level_scales has {n_levels}.")
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype),
                                torch.promote_types(cumulative.dtype, level_scales.dtype))
    scores = torch.einsum("brhk,blhk->bhrl", q[:, rows].to(dtype), k.to(dtype))
    cumulative = cumulative.to(dtype)
    causal = torch.arange(length, device=rows.device)[None, :] <= rows[:, None]  # (R, L)
    exponent = cumulative[:, rows].transpose(1, 2)[..., None] - cumulative.transpose(1, 2)[:, :, None, :]
    decay = exponent.masked_fill(~causal, float("-inf")).exp()  # masked before the exp: no inf · 0
    levels = fenwick_levels(rows, length, offset)  # (R, L)
    per_row = level_scales[:, rows].to(dtype).transpose(1, 2)  # (B, H, R, n)
    weights = torch.gather(per_row, -1, levels.masked_fill(~causal, 0).expand(*per_row.shape[:2], -1, -1))
    return scores * decay * weights
