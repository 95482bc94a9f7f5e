"""Diagonal-decay maps (RWKV-4 WKV, RG-LRU) by the shared Triton tile kernel (:mod:`kernels.triton_maps`).

Same contract as :func:`.naive.decay_maps_naive`, with one restriction: ``segments`` are runs (a state reset
wherever the id changes from one token to the next, which is what position-id resets give). The decay map is the
channel-decay map with N = 1, rate −1 and ``S = cumsum(log_decay)`` in float64 plus a jump of
:data:`RESET_JUMP` at every reset; the log query/key/diagonal terms stay float64 inside the kernel. Runs on CUDA
tensors, or on CPU under ``TRITON_INTERPRET=1``. Computed in float32 (exponents in float64); returned in
``out_dtype``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..triton_maps import RESET_JUMP, channel_decay_maps_triton
from .naive import validate_inputs


def decay_maps_triton(log_decay: Tensor, log_q: Optional[Tensor] = None, log_k: Optional[Tensor] = None, *,
                      log_diag: Optional[Tensor] = None, row_weight: Optional[Tensor] = None,
                      col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                      segments: Optional[Tensor] = None, rows: Union[Tensor, Sequence[int], None] = None,
                      reduce: Optional[str] = "mean", out_dtype: Optional[torch.dtype] = None,
                      precision: str = "ieee") -> Tensor:
    """Diagonal-decay maps with Triton.

    Args:
        log_decay: (B, L, C) ≥ 0.  log_q, log_k, log_diag, row_weight, col_weight: (B, L, C) or None.
        conv_weight: (C, K) or None.  segments: (B, L) integer run ids or None.  rows: None or (R,).
        reduce: "mean" | "sum" | "abs_mean" | None.  out_dtype: default log_decay's dtype.
        precision: "ieee" (fp32-exact products, default) or "tf32".
    Returns:
        (B, L, L) / (B, R, L), or (B, C, L, L) / (B, C, R, L) with ``reduce=None``.
    """
    rows = validate_inputs(log_decay, log_q, log_k, log_diag, row_weight, col_weight, conv_weight, segments, rows,
                           reduce)
    S = log_decay.to(torch.float64).cumsum(1)
    if segments is not None:
        resets = torch.zeros_like(segments, dtype=torch.float64)
        resets[:, 1:] = (segments[:, 1:] != segments[:, :-1]).to(torch.float64)
        S = S + RESET_JUMP * resets.cumsum(1)[..., None]
    channels = log_decay.shape[2]
    maps = channel_decay_maps_triton(
        S, torch.full((channels, 1), -1.0, device=log_decay.device), LQ=log_q, LK=log_k, LDIAG=log_diag,
        row_weight=row_weight, col_weight=col_weight, conv_weight=conv_weight, shared_rate=True, rows=rows, reduce=reduce,
        precision=precision)
    return maps.to(out_dtype or log_decay.dtype)
