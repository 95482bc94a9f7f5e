"""Mamba-1 / S6 implicit-attention maps by the shared Triton tile kernel (:mod:`kernels.triton_maps`).

Same contract as :func:`.naive.selective_maps_naive`; the S6 map is the channel-decay map with one decay head per
channel (``S = cumsum(delta)`` in float64, rates ``A`` (D, N)), queries ``C`` and keys ``B`` shared by all
channels (one group), and ``delta`` folded into the column weight. Runs on CUDA tensors, or on CPU under
``TRITON_INTERPRET=1`` (tests). Result in float32, cast to delta's dtype.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..triton_maps import channel_decay_maps_triton
from .naive import validate_inputs


def selective_maps_triton(delta: Tensor, A: Tensor, B: Tensor, C: Tensor, *, row_weight: Optional[Tensor] = None,
                          col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                          rows: Union[Tensor, Sequence[int], None] = None, reduce: Optional[str] = "mean",
                          precision: str = "ieee") -> Tensor:
    """Mamba-1 channel maps with Triton.

    Args:
        delta: (B, L, D).  A: (D, N).  B, C: (B, L, N).  row_weight, col_weight: (B, L, D) or None.
        conv_weight: (D, K) or None.  rows: None or (R,).  reduce: "mean" | "sum" | "abs_mean" | None.
        precision: "ieee" (fp32-exact products, default) or "tf32" (tensor-core products, ~1e-3 relative).
    Returns:
        (B, L, L) / (B, R, L), or (B, D, L, L) / (B, D, R, L) with ``reduce=None``; delta's dtype and device.
    """
    rows = validate_inputs(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce)
    keys_weight = delta if col_weight is None else delta * col_weight
    maps = channel_decay_maps_triton(
        delta.to(torch.float64).cumsum(1), A, CQ=C[:, :, None, :], BK=B[:, :, None, :], row_weight=row_weight,
        col_weight=keys_weight, conv_weight=conv_weight, channels_per_head=1, heads_per_group=delta.shape[2],
        rows=rows, reduce=reduce, precision=precision)
    return maps.to(delta.dtype)
