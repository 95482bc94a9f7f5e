"""Banded token maps and the depthwise convolutions behind them: pure tensor maths, no operator.

A short causal conv (Mamba's, LFM2's, Inkling's) mixes each channel c over K neighbouring tokens, so as a token map
it is a band ``M_c`` of K diagonals; these functions build the band's entries and maps, apply it, and describe
convolutions that read other neighbours (LFM3-VL's 2-D conv over the patch grid). Shapes: B batch, L tokens,
D channels, K conv taps, T taps of a sparse conv, R query rows. The operators (:mod:`mamba_captum.operators`) call
them for their "w/o S6" ablations and the bands that follow a mixer; the adapters call the convolutions.
"""
from __future__ import annotations

import torch

from .reductions import reduce_channels


def band_entries(row_weight, col_weight, conv_weight, input_weight=None):
    """The non-zero entries of the per-channel bands ``H_c = diag(row_c · col_c) · M_c · diag(in_c)``:
    ``bands[b, i, c, τ] = H_c[i, i − τ]`` (B, L, D, K); the entries that would reach before token 0 are 0.

    Args:
        row_weight, col_weight: (B, L, D).  conv_weight: (D, K) static taps, (B, L, D, K) per-row taps (row i's
            taps: the conv's output token i has its own weights, Inkling2's dynamic convolution), or None
            (identity). Taps run forward in time: ``conv_weight[..., K−1]`` weighs the token itself.
        input_weight: (B, L, D) or None: a weight on the conv's input (LFM2's input gate).
    """
    diag = row_weight * col_weight  # (B, L, D)
    batch, length, channels = diag.shape
    taps = conv_weight.flip(-1) if conv_weight is not None else diag.new_ones(channels, 1)  # taps[.., τ] = w[K-1-τ]
    bands = diag[:, :, :, None] * taps  # (B, L, D, K): H_c[i, i - τ]
    width = taps.shape[-1]
    if input_weight is not None or width > length:
        shifted = torch.zeros_like(bands)
        for tau in range(min(width, length)):
            shifted[:, tau:, :, tau] = 1.0 if input_weight is None else input_weight[:, :length - tau]
        bands = bands * shifted
    else:
        for tau in range(1, width):
            bands[:, :tau, :, tau] = 0.0
    return bands


def causal_neighbours(taps: int, length: int, device=None) -> torch.Tensor:
    """(K, L) long: the token that tap τ of a causal 1-D conv reads for output token i, ``i − τ``, or −1 before the
    first token (tap τ weighs ``w[K−1−τ]``)."""
    index = torch.arange(length, device=device)
    offsets = torch.arange(taps, device=device)[:, None]
    shifted = index[None, :] - offsets
    return shifted.masked_fill(shifted < 0, -1)


def sparse_conv(values: torch.Tensor, taps: torch.Tensor, neighbours: torch.Tensor) -> torch.Tensor:
    """The depthwise conv that :func:`banded_maps` describes with ``neighbours``, applied: ``y[:, i, c] =
    Σ_τ taps[c, τ] · values[:, neighbours[τ, i], c]`` over the taps that read a token. values (B, L, D), taps
    (D, T), neighbours (T, L) -> (B, L, D)."""
    out = torch.zeros_like(values)
    neighbours = neighbours.to(values.device)
    for tau in range(neighbours.shape[0]):
        valid = neighbours[tau] >= 0
        out[:, valid] += values[:, neighbours[tau][valid]] * taps[:, tau]
    return out


def banded_maps(row_weight, col_weight, conv_weight, rows=None, reduce="mean", input_weight=None, neighbours=None):
    """Per-channel maps without the S6 part (the "w/o S6" ablation): H_c = diag(row_c · col_c) · M_c · diag(in_c).

    M_c is a sparse conv of T taps: tap τ of output token i reads token ``neighbours[τ, i]`` with weight
    ``taps[c, τ]``. Without ``neighbours`` it is the causal 1-D band (T = K diagonals, ``neighbours[τ, i] = i − τ``,
    ``taps[c, τ] = w[c, K−1−τ]``); with it any conv whose taps read distinct tokens (LFM3-VL's 2-D conv over the
    patch grid, :meth:`mamba_captum.vision.PackedPatches.neighbours`). Only these T entries per row are non-zero, so
    reduced maps are reduced tap by tap, without a per-channel (D, L, L) stack.

    Args:
        row_weight, col_weight: (B, L, D).  conv_weight: (D, K), per-row (B, L, D, K) (the output token i has its
            own taps, Inkling2's dynamic convolution; :func:`band_entries`), or None (identity; ``neighbours`` then
            ignored).
        input_weight: (B, L, D) or None: a weight on the conv's input (LFM2's input gate).
        neighbours: (T, L) long, −1 where a tap reads no token (outside the sequence or the frame), or None. With
            it, conv_weight is (D, T) in the same tap order (not flipped). For each i the taps' tokens are distinct.
    Returns:
        (B, L, L) reduced or (B, D, L, L) per channel; R rows with ``rows``.
    """
    diag = row_weight * col_weight  # (B, L, D)
    batch, length, channels = diag.shape
    if conv_weight is None:
        taps, neighbours = diag.new_ones(channels, 1), torch.arange(length, device=diag.device)[None]
    elif neighbours is None:
        taps = conv_weight.flip(-1)  # taps[c, τ] = w[c, K-1-τ]
        neighbours = causal_neighbours(min(taps.shape[-1], length), length, diag.device)
    else:
        taps, neighbours = conv_weight, neighbours.to(diag.device)
    per_row = taps.dim() == 4  # (B, L, D, T): row i's own taps
    index = torch.arange(length, device=diag.device)
    maps = diag.new_zeros(batch, 1 if reduce is not None else channels, length, length)
    for tau in range(neighbours.shape[0]):
        valid = neighbours[tau] >= 0
        out_rows, in_tokens = index[valid], neighbours[tau][valid]
        weight = taps[:, out_rows, :, tau] if per_row else taps[:, tau]
        band = diag[:, out_rows] * weight  # (B, n, D): H_c[i, neighbours[τ, i]]
        if input_weight is not None:
            band = band * input_weight[:, in_tokens]
        band = band.transpose(1, 2)  # (B, D, n)
        if reduce is not None:
            band = reduce_channels(band[:, :, None], reduce)[:, None, 0]  # (B, 1, n)
        maps[:, :, out_rows, in_tokens] = band
    if rows is not None:
        maps = maps[:, :, rows]
    return maps if reduce is None else maps[:, 0]


def causal_band(values: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """A depthwise causal conv without bias: ``out[t] = Σ_τ taps[..., K−1−τ] · values[t − τ]`` (zero before token 0).

    Args:
        values: (B, L, *channels).  taps: (*channels, K) static, or (B, L, *channels, K) per row (the output token
            t has its own taps, Inkling2's dynamic convolution); ``taps[..., K−1]`` weighs the token itself.
    """
    width, length = taps.shape[-1], values.shape[1]
    per_row = taps.dim() == values.dim() + 1
    out = values * taps[..., width - 1]
    for tau in range(1, min(width, length)):
        weight = taps[..., width - 1 - tau]
        out[:, tau:] += values[:, :length - tau] * (weight[:, tau:] if per_row else weight)
    return out


def apply_band(bands: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Σ_τ bands[:, i, d, τ] · values[:, i − τ, d]: a per-channel causal band (B, L, D, K) on (B, L, D)."""
    out = values * bands[..., 0]
    for tau in range(1, min(bands.shape[-1], values.shape[1])):
        out[:, tau:] += values[:, :-tau] * bands[:, tau:, :, tau]
    return out


def skip_taps(weight: torch.Tensor, scale: float = 1.0, conv: bool = True) -> torch.Tensor:
    """The taps of ``scale · (x + conv(x))`` (Inkling's short convolutions): the conv's taps (..., K) with the skip
    added to the token's own tap (``[..., K−1]``); only the skip with ``conv=False`` (the conv switched off)."""
    taps = weight.clone() if conv else torch.zeros_like(weight)
    taps[..., -1] += 1.0
    return taps * scale
