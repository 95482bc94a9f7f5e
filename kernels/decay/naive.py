"""Diagonal-decay recurrence maps (RWKV-4 WKV, Griffin RG-LRU) by the direct formula: the test reference.

Shapes: B batch, L tokens, C channels, K conv taps, R query rows. Per channel c, with ``S = cumsum(log_decay)``:

    α_c[i, j] = exp(log_q[i] + log_k[j] − (S[i] − S[j]))   for j < i,
    α_c[i, i] = exp(log_diag[i])                            (default log_q[i] + log_k[i]),
    α_c[i, j] = 0 for j > i, and 0 where ``segments[i] != segments[j]`` (a state reset between j and i);
    H_c = diag(row_weight_c) · α_c · diag(col_weight_c) · M_c,   M_c[t, s] = conv_weight[c, K−1−(t−s)].

Everything is computed in float64 and returned in ``out_dtype``; the exponents are formed per element (no
cumulative product), so large keys or long sequences cannot overflow as long as α itself is bounded (RWKV's rows
are normalised, RG-LRU's gates are ≤ 1).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..reductions import REDUCTIONS, reduce_channels


def validate_inputs(log_decay: Tensor, log_q: Optional[Tensor], log_k: Optional[Tensor],
                    log_diag: Optional[Tensor], row_weight: Optional[Tensor], col_weight: Optional[Tensor],
                    conv_weight: Optional[Tensor], segments: Optional[Tensor],
                    rows: Union[Tensor, Sequence[int], None], reduce,
                    value_weight: Optional[Tensor] = None) -> Optional[Tensor]:
    """Check shapes and ``reduce``; return ``rows`` as a 1-D int64 tensor (or None).

    Raises:
        ValueError: on a bad shape, dtype, row index or reduction.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if log_decay.dim() != 3 or not log_decay.is_floating_point():
        raise ValueError(f"log_decay must be a floating (B, L, C) tensor, got {log_decay.dtype} "
                         f"{tuple(log_decay.shape)}")
    batch, length, channels = log_decay.shape
    for name, t in (("log_q", log_q), ("log_k", log_k), ("log_diag", log_diag), ("row_weight", row_weight),
                    ("col_weight", col_weight), ("value_weight", value_weight)):
        if t is not None and (t.shape != log_decay.shape or not t.is_floating_point()):
            raise ValueError(f"{name} must be a floating (B, L, C) = {tuple(log_decay.shape)} tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if conv_weight is not None and (conv_weight.dim() != 2 or conv_weight.shape[0] != channels):
        raise ValueError(f"conv_weight must be (C, K) = ({channels}, K), got shape {tuple(conv_weight.shape)}")
    if segments is not None and (segments.shape != (batch, length) or segments.is_floating_point()):
        raise ValueError(f"segments must be an integer (B, L) = {(batch, length)} tensor, got {segments.dtype} "
                         f"{tuple(segments.shape)}")
    if rows is None:
        return None
    rows = torch.as_tensor(rows, device=log_decay.device)
    if rows.numel() == 0:
        rows = rows.long()
    if rows.dim() != 1 or rows.dtype == torch.bool or rows.is_floating_point():
        raise ValueError(f"rows must be a 1-D integer tensor of query indices, got {rows.dtype} {tuple(rows.shape)}")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= length):
        raise ValueError(f"rows must lie in [0, L) = [0, {length}), got min {int(rows.min())} max {int(rows.max())}")
    return rows.long()


def check_value_reduce(reduce) -> None:
    """``value_weight`` weighs the columns of a channel sum: it applies to ``reduce="mean"`` / ``"sum"`` only."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"value_weight applies to reduce='mean' or 'sum', got reduce={reduce!r}")


def decay_maps_naive(log_decay: Tensor, log_q: Optional[Tensor] = None, log_k: Optional[Tensor] = None, *,
                     log_diag: Optional[Tensor] = None, row_weight: Optional[Tensor] = None,
                     col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                     segments: Optional[Tensor] = None, rows: Union[Tensor, Sequence[int], None] = None,
                     reduce: Optional[str] = "mean", out_dtype: Optional[torch.dtype] = None,
                     value_weight: Optional[Tensor] = None) -> Tensor:
    """The maps of the module docstring, built as a full (B, C, L, L) float64 stack (small inputs only).

    Args:
        log_decay: (B, L, C) per-step log decay ≥ 0.  log_q, log_k, log_diag: (B, L, C) or None (0; log_diag
            defaults to log_q + log_k).  row_weight, col_weight: (B, L, C) or None (1).  conv_weight: (C, K) or
            None.  segments: (B, L) integer segment ids or None.  rows: None or (R,).
        reduce: "mean" | "sum" | "abs_mean" over channels, or None.  out_dtype: default log_decay's dtype.
        value_weight: (B, L, C) or None: a column weight after the conv, ``H_c · diag(value_weight[:, :, c])``.
    Returns:
        (B, L, L) reduced or (B, C, L, L) per channel; R rows instead of L with ``rows``.
    """
    rows = validate_inputs(log_decay, log_q, log_k, log_diag, row_weight, col_weight, conv_weight, segments, rows,
                           reduce, value_weight)
    out_dtype = out_dtype or log_decay.dtype
    f64 = lambda t: None if t is None else t.to(torch.float64).transpose(1, 2)  # noqa: E731 -> (B, C, L)
    decay = f64(log_decay)
    batch, channels, length = decay.shape
    zero = torch.zeros_like(decay)
    log_q = zero if log_q is None else f64(log_q)
    log_k = zero if log_k is None else f64(log_k)
    log_diag = log_q + log_k if log_diag is None else f64(log_diag)
    S = decay.cumsum(-1)
    exponent = log_q[..., :, None] + log_k[..., None, :] - (S[..., :, None] - S[..., None, :])  # (B, C, i, j)
    index = torch.arange(length, device=decay.device)
    strict = index[:, None] > index[None, :]
    alpha = torch.where(strict, exponent, torch.full_like(exponent, float("-inf"))).exp()
    alpha = alpha + torch.diag_embed(log_diag.exp())
    if segments is not None:
        alpha = alpha * (segments[:, None, :, None] == segments[:, None, None, :])
    if row_weight is not None:
        alpha = alpha * f64(row_weight)[..., :, None]
    if col_weight is not None:
        alpha = alpha * f64(col_weight)[..., None, :]
    if conv_weight is not None:
        taps = conv_weight.shape[1]
        lag = index[:, None] - index[None, :]  # t − s
        toeplitz = conv_weight.to(torch.float64)[:, (taps - 1 - lag).clamp(0, taps - 1)]  # (C, t, s)
        toeplitz = toeplitz * ((lag >= 0) & (lag < taps))
        alpha = alpha @ toeplitz
    if value_weight is not None:
        alpha = alpha * f64(value_weight)[..., None, :]
    if rows is not None:
        alpha = alpha[:, :, rows]
    return reduce_channels(alpha, reduce).to(out_dtype)
