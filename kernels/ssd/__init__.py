"""Mamba-2 (SSD) implicit-attention maps.

Per batch element, head h reading group g(h) = h // (H // G), ``S = cumsum(delta)``::

    alpha_h[i, j] = (C_i · B_j)_{g(h)} · exp(A_h · (S_i - S_j)) · delta_{j,h}   for j ≤ i, else 0
    H_c[i, s]     = row[i,h,p] · Σ_j alpha_h[i, j] · col[j,h,p] · M_{h,p}[j, s]   for channel c = h·P + p

with M the bias-free causal depthwise conv (``M[t, s] = conv_weight[h, p, K-1-(t-s)]``, 0 ≤ t-s < K). With no
row/col/conv weight the maps are per head (C = H, ``H_h = alpha_h``), otherwise per channel (C = H·P; a missing
weight means 1 / identity).

Inputs: delta (B, L, H), A (H,), B and C (B, L, G, N), row_weight and col_weight (B, L, H, P), conv_weight
(H, P, K). Output: (B, L, L) for reduce "mean" / "sum" / "abs_mean" over C, (B, C, L, L) for ``reduce=None``;
``rows`` (R,) replaces the L query rows by R.

* :func:`ssd_maps_naive` — direct float64 formula, the test reference.
* :func:`ssd_maps_blocked` — tiled, memory-bounded torch version (CPU).
* :func:`ssd_maps_triton` — the shared Triton tile kernel (:mod:`kernels.triton_maps`), for CUDA.
* :func:`ssd_maps` — dispatcher used by the library (:mod:`kernels.dispatch`).
"""
from __future__ import annotations

import functools

from ..dispatch import precision, use_triton
from ..taps import value_weighted_by_taps
from .blocked import ssd_maps_blocked
from .naive import ssd_maps_naive
from .triton import ssd_maps_triton

__all__ = ["ssd_maps", "ssd_maps_blocked", "ssd_maps_naive", "ssd_maps_triton"]


def ssd_maps(delta, A, B, C, *, row_weight=None, col_weight=None, conv_weight=None, rows=None, reduce="mean",
             value_weight=None):
    """Mamba-2 implicit-attention maps with the best available kernel: Triton for CUDA float32, else blocked.

    Args:
        delta: (B, L, H). A: (H,). B, C: (B, L, G, N). row_weight, col_weight: (B, L, H, P) or None.
        conv_weight: (H, P, K) or None. rows: None or (R,) query rows. reduce: "mean" | "sum" | "abs_mean" | None.
        value_weight: (B, L, H, P) or None ("mean" / "sum"): a column weight after the conv,
            ``H_c · diag(value_weight[:, c])``.

    Returns:
        (B, L, L) / (B, R, L), or (B, C, L, L) / (B, C, R, L) with ``reduce=None``; dtype and device of delta.
    """
    if value_weight is not None and reduce not in ("mean", "sum"):  # before either branch: a tap split is no |·|
        raise ValueError(f"value_weight needs reduce 'mean' or 'sum', got {reduce!r}")
    if use_triton(delta):
        kernel = functools.partial(ssd_maps_triton, delta, A, B, C, rows=rows, reduce=reduce, precision=precision())
        if value_weight is None:
            return kernel(row_weight=row_weight, col_weight=col_weight, conv_weight=conv_weight)
        # the Triton kernel takes no value weight: the conv tap by tap
        return value_weighted_by_taps(kernel, row_weight, col_weight, value_weight, conv_weight, delta.shape[1])
    return ssd_maps_blocked(delta, A, B, C, row_weight=row_weight, col_weight=col_weight, conv_weight=conv_weight,
                            rows=rows, reduce=reduce, value_weight=value_weight)
