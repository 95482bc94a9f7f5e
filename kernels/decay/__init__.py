"""Diagonal-decay recurrence maps: RWKV-4's WKV and Griffin's RG-LRU (one decay per channel and token).

Per channel c, with ``S = cumsum(log_decay)``::

    α_c[i, j] = exp(log_q[i] + log_k[j] − (S[i] − S[j]))   (j < i),   α_c[i, i] = exp(log_diag[i]),
    0 above the diagonal and across segments (state resets);
    H_c = diag(row_weight_c) · α_c · diag(col_weight_c) · M_c   (M_c: bias-free causal conv, Toeplitz).

RWKV-4: log_decay = w = exp(time_decay), log_k = k + w, log_q = −log Z (the row normaliser), log_diag =
u + k − log Z. RG-LRU: log_decay = −log a, col_weight = √(1 − a²) · input gate, segments from ``position_ids == 0``.

- :func:`decay_maps_naive` — the full float64 (B, C, L, L) stack: the test reference.
- :func:`decay_maps_blocked` — tiled GEMMs for reduced maps, every exponent ≤ 0 (no overflow for large keys).
- :func:`decay_maps_triton` — the shared Triton tile kernel (:mod:`kernels.triton_maps`), for CUDA.
- :func:`decay_maps` — the dispatcher the library calls (:mod:`kernels.dispatch`).
"""
from __future__ import annotations

import functools

import torch

from ..dispatch import precision, use_triton
from ..taps import value_weighted_by_taps
from .blocked import decay_maps_blocked
from .naive import check_value_reduce, decay_maps_naive, validate_inputs
from .triton import decay_maps_triton

__all__ = ["decay_maps", "decay_maps_blocked", "decay_maps_naive", "decay_maps_triton"]


def decay_maps(log_decay, log_q=None, log_k=None, *, log_diag=None, row_weight=None, col_weight=None,
               conv_weight=None, segments=None, rows=None, reduce="mean", out_dtype=None, value_weight=None):
    """Diagonal-decay maps with the best available kernel: Triton for CUDA float32 maps, else blocked torch.

    Args:
        log_decay: (B, L, C) ≥ 0.  log_q, log_k, log_diag, row_weight, col_weight: (B, L, C) or None.
        conv_weight: (C, K) or None.  segments: (B, L) integer ids or None.  rows: None or (R,).
        reduce: "mean" | "sum" | "abs_mean" | None.  out_dtype: default log_decay's dtype.
        value_weight: (B, L, C) or None ("mean" / "sum"): a column weight after the conv, ``H_c · diag(value_c)``.
    Returns:
        (B, L, L) / (B, R, L), or (B, C, L, L) / (B, C, R, L) with ``reduce=None``.
    """
    common = dict(log_diag=log_diag, segments=segments, rows=rows, reduce=reduce, out_dtype=out_dtype)
    if value_weight is not None:  # before either branch: the tap-by-tap split below is a sum, right for no other
        validate_inputs(log_decay, log_q, log_k, log_diag, row_weight, col_weight, conv_weight, segments, rows,
                        reduce, value_weight)
        check_value_reduce(reduce)
    if not ((out_dtype or log_decay.dtype) == torch.float32 and use_triton(log_decay, torch.float32)):
        return decay_maps_blocked(log_decay, log_q, log_k, row_weight=row_weight, col_weight=col_weight,
                                  conv_weight=conv_weight, value_weight=value_weight, **common)
    kernel = functools.partial(decay_maps_triton, log_decay, log_q, log_k, precision=precision(), **common)
    if value_weight is None:
        return kernel(row_weight=row_weight, col_weight=col_weight, conv_weight=conv_weight)
    # the Triton kernel takes no value weight: the conv tap by tap
    return value_weighted_by_taps(kernel, row_weight, col_weight, value_weight, conv_weight, log_decay.shape[1])
