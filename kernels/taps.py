"""A column weight after a conv, for any map kernel, by splitting the conv into its taps.

``H_c = diag(row_c) · K_c · diag(col_c) · M_c`` (K_c the kernel's own map, M_c the causal conv) times
``diag(v_c)`` on the right is not a column scaling of ``K_c`` before the conv, but tap by tap it is: with τ = s − j,
``H_c[i, j] v_c[j] = Σ_τ (row K col)_c[i, j + τ] · w_c[K−1−τ] · v_c[j]``. So each tap τ is one call of the kernel
without the conv, whose column weight is ``col[s] · w[K−1−τ] · v[s − τ]``, shifted left by τ columns: K calls and
no (C, L, L) stack. Kernels that fold the conv into their keys take ``v`` directly (one call); this is the general
fallback (Mamba-2, RWKV, Griffin, and the Triton kernels).
"""
from __future__ import annotations

import torch


def post_conv_columns(maps, row, col, values, conv_weight, length: int):
    """Channel-summed (or per-channel) maps of ``diag(row) K diag(col) M diag(values)``, by taps.

    Args:
        maps: ``maps(row, col) -> (B, [C,] R, L)`` the kernel's maps of ``diag(row) K diag(col)`` (no conv); linear
            in ``col``.
        row, col, values: (B, L, *channel dims).  conv_weight: (*channel dims, K) or None (no conv).
        length: L.
    Returns:
        what ``maps`` returns, for the whole product.
    """
    if conv_weight is None:
        return maps(row, col * values)
    taps = conv_weight.shape[-1]
    total = None
    for tau in range(min(taps, length)):
        shifted = torch.zeros_like(values)
        shifted[:, tau:] = values[:, :length - tau]
        part = maps(row, col * conv_weight[..., taps - 1 - tau] * shifted)  # (B, [C,] R, L) over columns s
        if total is None:
            total = part.clone()
        else:
            total[..., :length - tau] += part[..., tau:]
    return total


def value_weighted_by_taps(kernel, row_weight, col_weight, value_weight, conv_weight, length: int):
    """``kernel(row_weight=, col_weight=)`` (a map kernel that takes no value weight, its other arguments bound)
    for ``diag(row) K diag(col) M diag(value_weight)``: :func:`post_conv_columns` with absent weights as ones.
    Linear in the columns, so right for channel sums and per-channel maps, not for ``"abs_mean"``."""
    ones = torch.ones_like(value_weight)
    return post_conv_columns(lambda r, c: kernel(row_weight=r, col_weight=c),
                             ones if row_weight is None else row_weight, ones if col_weight is None else col_weight,
                             value_weight, conv_weight, length)
