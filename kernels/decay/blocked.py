"""Diagonal-decay recurrence maps (RWKV-4 WKV, Griffin RG-LRU), exact and overflow-free, in plain torch.

The maps are those of :mod:`.naive`. With ``S = cumsum(log_decay)`` (float64) and a reference token r between j and
i, ``α_c[i, j] = exp(log_q[i] − (S[i] − S[r]) + m) · exp(log_k[j] − (S[r] − S[j]) − m)``. Taking for r the last
token of a tile of columns and for m the largest key exponent of that tile (per channel), the key factor is ≤ 1 and
the query factor is the largest α_c[i, j] over the tile, also ≤ 1 whenever α is bounded by 1 (RWKV's normalised
rows; RG-LRU's products of gates ≤ 1). So every exponential is of a number ≤ 0: keys of magnitude 50 or 500 and
sequences of any length neither overflow nor lose precision to differences of large cumulative sums.

The channel-reduced map of the rows below a tile is then one GEMM over the channel axis (queries × keys); only the
diagonal tiles are formed per channel, by the direct formula. The conv (when given) is applied tap by tap: tap τ
is a channel-weighted map shifted τ columns left, K GEMM passes in all, never a (C, L, L) stack. ``reduce=None``
and ``"abs_mean"`` (which cannot be factorised over channels) use the direct formula on channel chunks, except
``"abs_mean"`` without a conv: α ≥ 0 everywhere, so ``|row α col| = |row| α |col|`` and it is the mean path of the
absolute weights (RWKV-430m's width, L = 1024: 0.2 s instead of 20 s). With a conv (Griffin) and no reset, each
channel's conv'd map is rank one below a band of K − 1 + TILE rows per column tile, so ``"abs_mean"`` is one GEMM
of |queries| and |conv'd keys| there and the direct formula on the band (:func:`_conv_maps`); ``"mean"`` / ``"sum"``
take the same path (one GEMM per tile instead of one per conv tap). With resets the tap-by-tap paths remain.

All arithmetic is float64; results are returned in ``out_dtype`` (default: log_decay's dtype).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..selective.naive import apply_conv_columns
from ..taps import value_weighted_by_taps
from .naive import check_value_reduce, validate_inputs

TILE = 32  # columns per tile of the reduced maps (diagonal tiles cost L·TILE·C exponentials)
_WORKING_ELEMENTS = 1 << 22  # elements of one float64 (B, rows, cols, channels) exponent block
_FULL_MAP_ROWS = 16  # above this many query rows the full reduced map (one pass of GEMMs) is cheaper


@dataclass
class _Inputs:
    S: Tensor  # (B, L, C) float64 cumulative log decay
    log_q: Tensor
    log_k: Tensor
    log_diag: Tensor
    row: Optional[Tensor]
    segments: Optional[Tensor]

    @property
    def shape(self):
        return self.S.shape


def decay_maps_blocked(log_decay: Tensor, log_q: Optional[Tensor] = None, log_k: Optional[Tensor] = None, *,
                       log_diag: Optional[Tensor] = None, row_weight: Optional[Tensor] = None,
                       col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                       segments: Optional[Tensor] = None, rows: Union[Tensor, Sequence[int], None] = None,
                       reduce: Optional[str] = "mean", out_dtype: Optional[torch.dtype] = None,
                       value_weight: Optional[Tensor] = None) -> Tensor:
    """Channel maps of a diagonal-decay recurrence, exact, by tiled GEMMs (see the module docstring).

    Args:
        log_decay: (B, L, C) per-step log decay ≥ 0.  log_q, log_k, log_diag: (B, L, C) or None (0; log_diag
            defaults to log_q + log_k).  row_weight, col_weight: (B, L, C) or None (1).  conv_weight: (C, K) or
            None.  segments: (B, L) integer segment ids (α is 0 across segments) or None.  rows: None or (R,).
        reduce: "mean" | "sum" (tiled GEMMs) | "abs_mean" | None (direct formula on channel chunks).
        out_dtype: dtype of the result, default log_decay's.
        value_weight: (B, L, C) or None ("mean" / "sum"): a column weight after the conv, ``H_c · diag(value_c)``
            (the values of gradient × operator × input): folded into the conv'd keys without resets, else the conv
            is split into its taps (:func:`kernels.taps.post_conv_columns`).
    Returns:
        (B, L, L) reduced or (B, C, L, L) per channel; R rows instead of L with ``rows``.
    """
    rows = validate_inputs(log_decay, log_q, log_k, log_diag, row_weight, col_weight, conv_weight, segments, rows,
                           reduce, value_weight)
    if value_weight is not None:
        check_value_reduce(reduce)
    if value_weight is not None and conv_weight is not None and not _conv_path(segments, rows, reduce):
        kernel = functools.partial(decay_maps_blocked, log_decay, log_q, log_k, log_diag=log_diag,
                                   segments=segments, rows=rows, reduce=reduce, out_dtype=out_dtype)
        return value_weighted_by_taps(kernel, row_weight, col_weight, value_weight, conv_weight, log_decay.shape[1])
    out_dtype = out_dtype or log_decay.dtype
    f64 = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731
    zero = torch.zeros_like(log_decay, dtype=torch.float64)
    log_q = zero if log_q is None else f64(log_q)
    log_k = zero if log_k is None else f64(log_k)
    inputs = _Inputs(f64(log_decay).cumsum(1), log_q, log_k, log_q + log_k if log_diag is None else f64(log_diag),
                     f64(row_weight), segments)
    col = f64(col_weight)
    value = f64(value_weight)
    if value is not None and conv_weight is None:  # no conv: a column weight like any other
        col, value = (value if col is None else col * value), None
    length = log_decay.shape[1]
    if reduce == "abs_mean" and conv_weight is None:
        # every α entry is an exponential (≥ 0), so |row α col| = |row| α |col|: the mean path with |weights|
        inputs.row = None if inputs.row is None else inputs.row.abs()
        col, reduce = None if col is None else col.abs(), "mean"
    if conv_weight is not None and _conv_path(segments, rows, reduce):
        out = _conv_maps(inputs, col, f64(conv_weight), absolute=reduce == "abs_mean", value=value)
        out = out if reduce == "sum" else out / log_decay.shape[-1]
        return (out if rows is None else out[:, rows]).to(out_dtype)
    if reduce in ("mean", "sum"):
        taps = [(0, None)] if conv_weight is None else [
            (tau, f64(conv_weight[:, conv_weight.shape[1] - 1 - tau])) for tau in range(min(conv_weight.shape[1],
                                                                                             length))]
        out = None
        for tau, tap in taps:  # H[i, s] = Σ_τ (row α col)[i, s + τ] · w[K−1−τ]
            tap_col = col if tap is None else (tap.expand(log_decay.shape) if col is None else col * tap)
            part = reduced_alpha(inputs, tap_col, rows)
            if out is None:  # tau = 0 comes first
                out = part
            else:
                out[..., :length - tau] += part[..., tau:]
        if reduce == "mean":
            out = out / log_decay.shape[-1]
        return out.to(out_dtype)
    return _channel_maps(inputs, col, f64(conv_weight), rows, reduce).to(out_dtype)


def _segment_mask(segments: Optional[Tensor], query: Tensor) -> Optional[Tensor]:
    """(B, R, L) float64: 1 where query row and column lie in the same segment."""
    if segments is None:
        return None
    return (segments[:, query, None] == segments[:, None, :]).to(torch.float64)


def direct_alpha(inputs: _Inputs, col: Optional[Tensor], query: Tensor, c0: int, c1: int, col_start: int = 0,
                 col_stop: Optional[int] = None) -> Tensor:
    """row · α · col of channels [c0, c1) at query rows ``query`` (R,), columns [col_start, col_stop):
    (B, R, cols, c).

    Every exponent is formed per element (no factorisation), as (log_q_i − S'_i) + (log_k_j + S'_j) with S' = S
    relative to the first column (small numbers: no cancellation). Segments are not applied here.
    """
    stop = inputs.shape[1] if col_stop is None else col_stop
    chan = slice(c0, c1)
    S = inputs.S[..., chan] - inputs.S[:, col_start:col_start + 1, chan]
    exponent = (inputs.log_q[:, query, chan] - S[:, query])[:, :, None] + \
        (inputs.log_k[:, col_start:stop, chan] + S[:, col_start:stop])[:, None]
    columns = torch.arange(col_start, stop, device=S.device)
    above = torch.zeros(query.numel(), stop - col_start, dtype=S.dtype, device=S.device)
    above.masked_fill_(query[:, None] <= columns[None, :], float("-inf"))  # j ≥ i: the diagonal is set below
    exponent += above[None, :, :, None]
    alpha = exponent.exp_()
    on_diagonal = ((query >= col_start) & (query < stop)).nonzero().flatten()
    if on_diagonal.numel():
        picked = query[on_diagonal]
        alpha[:, on_diagonal, picked - col_start] = inputs.log_diag[:, picked, chan].exp()
    if inputs.row is not None:
        alpha *= inputs.row[:, query, None, chan]
    if col is not None:
        alpha *= col[:, None, col_start:stop, chan]
    return alpha


def _channel_chunk(batch: int, rows: int, cols: int, channels: int) -> int:
    return max(1, min(channels, _WORKING_ELEMENTS // max(1, batch * rows * cols)))


def reduced_alpha(inputs: _Inputs, col: Optional[Tensor], rows: Optional[Tensor]) -> Tensor:
    """Σ_c row_c[i] α_c[i, j] col_c[j] with segments applied: (B, L, L), or (B, R, L) with ``rows``."""
    batch, length, channels = inputs.shape
    device = inputs.S.device
    if rows is not None and rows.numel() <= _FULL_MAP_ROWS:
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        n_cols = int(unique[-1]) + 1 if unique.numel() else 0
        out = inputs.S.new_zeros(batch, unique.numel(), length)
        chunk = _channel_chunk(batch, unique.numel(), n_cols, channels)
        for c0 in range(0, channels, chunk):
            out[..., :n_cols] += direct_alpha(inputs, col, unique, c0, min(channels, c0 + chunk), 0, n_cols).sum(-1)
        mask = _segment_mask(inputs.segments, unique)
        out = out if mask is None else out * mask
        return out[:, inverse]
    out = inputs.S.new_zeros(batch, length, length)
    for j0 in range(0, length, TILE):
        j1 = min(j0 + TILE, length)
        tile = torch.arange(j0, j1, device=device)
        chunk = _channel_chunk(batch, j1 - j0, j1 - j0, channels)
        for c0 in range(0, channels, chunk):  # the diagonal tile, per channel
            diagonal = direct_alpha(inputs, col, tile, c0, min(channels, c0 + chunk), j0, j1)
            out[:, j0:j1, j0:j1] += diagonal.sum(-1)
        if j1 == length:
            continue
        r = j1 - 1  # reference token: the tile's last column
        key_exponent = inputs.log_k[:, j0:j1] - (inputs.S[:, r:r + 1] - inputs.S[:, j0:j1])  # (B, T, C) ≤ m
        m = key_exponent.amax(1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        keys = (key_exponent - m).exp_()
        if col is not None:
            keys *= col[:, j0:j1]
        queries = (inputs.log_q[:, j1:] - (inputs.S[:, j1:] - inputs.S[:, r:r + 1]) + m).exp_()  # ≤ max α ≤ 1
        if inputs.row is not None:
            queries *= inputs.row[:, j1:]
        out[:, j1:, j0:j1] = torch.bmm(queries, keys.transpose(1, 2))
    if inputs.segments is not None:
        out *= _segment_mask(inputs.segments, torch.arange(length, device=device))
    return out if rows is None else out[:, rows]


def _conv_path(segments: Optional[Tensor], rows: Optional[Tensor], reduce) -> bool:
    """Whether :func:`_conv_maps` applies: a reduction, no reset splitting any sequence (α has no segment mask),
    and the full map (not a few rows, which the direct formula gives cheaper)."""
    return (reduce is not None and (segments is None or bool((segments == segments[:, :1]).all()))
            and (rows is None or rows.numel() > _FULL_MAP_ROWS))


def _conv_maps(inputs: _Inputs, col: Optional[Tensor], conv_weight: Tensor, absolute: bool,
               value: Optional[Tensor] = None) -> Tensor:
    """Σ_c H_c, or Σ_c |H_c| when ``absolute``, with the conv and no segment mask, (B, L, L), in tiles of columns;
    ``value`` (B, L, C) weighs the columns after the conv (it multiplies the conv'd keys and the band's columns).

    For a tile of output columns s ∈ [j0, j1), the conv reads α columns s .. s + K − 1 ≤ j1 + K − 2 =: r. Every row
    i > r lies after all of them, where ``(row α col)_c[i, t] = Q_c[i] · k_c[t]`` (no diagonal term), so
    ``H_c[i, s] = Q_c[i] · κ_c[s]`` with the conv'd keys ``κ_c[s] = Σ_τ k_c[s + τ] w_c[K−1−τ]``: rank one per
    channel: ``Σ_c H_c[i, s] = Σ_c Q_c[i] κ_c[s]`` and ``Σ_c |H_c[i, s]| = Σ_c |Q_c[i]| |κ_c[s]|`` are one GEMM each
    (one, where the tap-by-tap reduced path takes K). The K − 1 + T rows from j0 to r (the band) come from the
    direct formula per channel. Keys are taken relative to r and their largest exponent, queries
    after it: every exponential is of a number ≤ 0, as in :func:`reduced_alpha`.
    """
    batch, length, channels = inputs.shape
    taps = conv_weight.shape[1]
    out = inputs.S.new_zeros(batch, length, length)
    for j0 in range(0, length, TILE):
        j1 = min(j0 + TILE, length)
        band_end = min(length, j1 + taps - 1)
        band_rows = torch.arange(j0, band_end, device=inputs.S.device)
        chunk = _channel_chunk(batch, band_end - j0, band_end - j0, channels)
        for c0 in range(0, channels, chunk):
            c1 = min(channels, c0 + chunk)
            alpha = direct_alpha(inputs, col, band_rows, c0, c1, j0, band_end).permute(0, 3, 1, 2)
            conved = apply_conv_columns(alpha, conv_weight[c0:c1])  # columns ≥ j1 read past the band: dropped
            conved = conved[..., :j1 - j0]
            if value is not None:
                conved = conved * value[:, None, j0:j1, c0:c1].permute(0, 3, 1, 2)
            out[:, j0:band_end, j0:j1] += (conved.abs() if absolute else conved).sum(1)
        if band_end == length:
            continue
        r = band_end - 1
        key_exponent = inputs.log_k[:, j0:band_end] - (inputs.S[:, r:r + 1] - inputs.S[:, j0:band_end])
        m = key_exponent.amax(1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        keys = (key_exponent - m).exp_()
        if col is not None:
            keys *= col[:, j0:band_end]
        conved_keys = sum(keys[:, lag:lag + j1 - j0] * conv_weight[:, taps - 1 - lag] for lag in range(taps))
        if value is not None:
            conved_keys = conved_keys * value[:, j0:j1]
        queries = (inputs.log_q[:, band_end:] - (inputs.S[:, band_end:] - inputs.S[:, r:r + 1]) + m).exp_()
        if inputs.row is not None:
            queries *= inputs.row[:, band_end:]
        if absolute:
            queries, conved_keys = queries.abs_(), conved_keys.abs()
        out[:, band_end:, j0:j1] = torch.bmm(queries, conved_keys.transpose(1, 2))
    return out


def _channel_maps(inputs: _Inputs, col, conv_weight, rows, reduce) -> Tensor:
    """Per-channel maps (reduce None) or mean_c |H_c| ("abs_mean") by the direct formula on channel chunks."""
    batch, length, channels = inputs.shape
    query = torch.arange(length, device=inputs.S.device) if rows is None else rows
    mask = _segment_mask(inputs.segments, query)
    if reduce is None:
        out = inputs.S.new_empty(batch, channels, query.numel(), length)
    else:
        out = inputs.S.new_zeros(batch, query.numel(), length)
    chunk = _channel_chunk(batch, query.numel(), length, channels)
    for c0 in range(0, channels, chunk):
        c1 = min(channels, c0 + chunk)
        maps = direct_alpha(inputs, col, query, c0, c1)
        if mask is not None:
            maps *= mask[..., None]
        maps = maps.permute(0, 3, 1, 2)  # (B, c, R, L)
        if conv_weight is not None:
            maps = apply_conv_columns(maps, conv_weight[c0:c1])
        if reduce is None:
            out[:, c0:c1] = maps
        else:
            out += maps.abs().sum(1)
    if reduce == "abs_mean":
        out /= channels
    return out
