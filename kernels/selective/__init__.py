"""Mamba-1 (selective scan, S6) implicit-attention maps.

Shapes: B batch, L tokens, D channels, N state size, K conv taps, R query rows. Inputs ``delta`` (B, L, D) ≥ 0,
``A`` (D, N) ≤ 0, ``B`` and ``C`` (B, L, N); optional ``row_weight``/``col_weight`` (B, L, D) and ``conv_weight``
(D, K). With ``seg_c(i, j) = Σ_{k=j+1..i} delta[k, c]``:

    α_c[i, j] = Σ_n C[i, n] · exp(A[c, n] · seg_c(i, j)) · delta[j, c] · B[j, n]   (j ≤ i, else 0),
    H_c = diag(row_weight[:, c]) · α_c · diag(col_weight[:, c]) · M_c,   M_c[t, s] = conv_weight[c, K-1-(t-s)].

Outputs: (B, L, L) for ``reduce`` in "mean" / "sum" / "abs_mean" over channels, (B, D, L, L) for ``reduce=None``;
with ``rows`` (R,) only those query rows: (B, R, L) / (B, D, R, L).

- :func:`selective_maps_naive` — direct formula, the test reference.
- :func:`selective_maps_blocked` — exact blocked GEMM algorithm (DESIGN §5) in plain torch.
- :func:`selective_maps_triton` — the shared Triton tile kernel (:mod:`kernels.triton_maps`), for CUDA.
- :func:`selective_maps` — the dispatcher the library calls (:mod:`kernels.dispatch`).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

from torch import Tensor

from ..dispatch import precision, use_triton
from ..taps import value_weighted_by_taps
from .blocked import selective_maps_blocked
from .naive import selective_maps_naive
from .triton import selective_maps_triton

__all__ = ["selective_maps", "selective_maps_blocked", "selective_maps_naive", "selective_maps_triton"]


def selective_maps(delta: Tensor, A: Tensor, B: Tensor, C: Tensor, *, row_weight: Optional[Tensor] = None,
                   col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                   rows: Union[Tensor, Sequence[int], None] = None, reduce: Optional[str] = "mean",
                   value_weight: Optional[Tensor] = None) -> Tensor:
    """Mamba-1 channel maps with the best available kernel: Triton for CUDA float32 tensors, else blocked torch.

    Args:
        delta: (B, L, D).  A: (D, N).  B, C: (B, L, N).  row_weight, col_weight: (B, L, D) or None.
        conv_weight: (D, K) or None.  rows: None or (R,) query indices.
        reduce: "mean" | "sum" | "abs_mean" | None.
        value_weight: (B, L, D) or None: a column weight after the conv (``H_c · diag(value_weight[:, c])``).
    Returns:
        (B, L, L) reduced or (B, D, L, L) per channel; R rows instead of L with ``rows``. delta's dtype and device.
    """
    if use_triton(delta):
        triton = functools.partial(selective_maps_triton, delta, A, B, C, rows=rows, reduce=reduce,
                                   precision=precision())
        if value_weight is None:
            return triton(row_weight=row_weight, col_weight=col_weight, conv_weight=conv_weight)
        if reduce != "abs_mean":  # linear in the columns: the conv tap by tap (kernels/taps.py)
            return value_weighted_by_taps(triton, row_weight, col_weight, value_weight, conv_weight, delta.shape[1])
    return selective_maps_blocked(delta, A, B, C, row_weight=row_weight, col_weight=col_weight,
                                  conv_weight=conv_weight, rows=rows, reduce=reduce, value_weight=value_weight)
