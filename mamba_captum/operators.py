"""The operator of one layer -> its implicit-attention maps.

Each operator holds the data-controlled pieces of one token mixer (Δ, A, B, C, gate, activation gain, conv taps,
norm scale, or softmax probabilities) rebuilt by a family adapter, and turns them into maps through
:mod:`mamba_captum.kernels`. Shapes: B batch, L tokens, D channels, N state size, H heads, P head dim, K conv taps.

``maps(reduce, rows)`` returns (B, L, L) for a reduced map, (B, C, L, L) with ``reduce=None``; with ``rows`` the
L query rows become R. Rows and columns of padding tokens are zero.

For gradient rules an operator also carries what it acts on and what it produces: ``values`` (its input x),
``output`` (H x, the part of the layer that comes from tokens) and ``readout`` (output -> the mixer's output,
float64), so that a gradient of the mixer output becomes a gradient of the operator output
(:func:`operator_output_grad`), and ``contributions(grad, rows)`` = ``Σ_c g_c[i] · H_c[i, j] · x_c[j]``: the
channel-summed first-order contribution of token j to the target through row i (rows of it sum to
``Σ_c g_c[i] · y_c[i]``). ``value_channels`` is the number of channels c in that sum.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from .kernels.decay import decay_maps
from .kernels.delta_rule import delta_rule_alpha
from .kernels.gated_scores import gated_scores_alpha_rows
from .kernels.heads import head_maps_blocked
from .kernels.reductions import REDUCTIONS, reduce_channels  # noqa: F401 (REDUCTIONS re-exported)
from .kernels.selective import selective_maps
from .kernels.ssd import ssd_maps
from .kernels.taps import post_conv_columns

def masked_tokens(tensor: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` (B, L, ...) with the padded tokens zeroed (``mask`` (B, L), 1 for real tokens; None: no padding),
    in ``tensor``'s dtype: the adapters' rebuilds re-apply the pad mask where the mixer's forward applies it."""
    return tensor if mask is None else (tensor * mask[:, :, None]).to(tensor.dtype)


def _mask_rows_cols(maps: torch.Tensor, mask: torch.Tensor | None, rows) -> torch.Tensor:
    if mask is None:
        return maps
    row_mask = mask if rows is None else mask[:, rows]
    row_mask = row_mask[:, :, None] * mask[:, None, :]
    return maps * (row_mask if maps.dim() == 3 else row_mask[:, None])


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


def skip_taps(weight: torch.Tensor, scale: float = 1.0, conv: bool = True) -> torch.Tensor:
    """The taps of ``scale · (x + conv(x))`` (Inkling's short convolutions): the conv's taps (..., K) with the skip
    added to the token's own tap (``[..., K−1]``); only the skip with ``conv=False`` (the conv switched off)."""
    taps = weight.clone() if conv else torch.zeros_like(weight)
    taps[..., -1] += 1.0
    return taps * scale


def operator_output_grad(operator, grad_output: torch.Tensor) -> torch.Tensor:
    """The gradient of a target with respect to ``operator.output`` (the operator's own output, e.g. out_proj's
    input), given its gradient with respect to the mixer output: the vector-Jacobian product of ``readout``.

    Args:
        grad_output: (B, L, D_model) for SSM mixers; (B, L, H, d) for softmax layers (readout is the identity).
    Returns:
        a tensor shaped like ``operator.output``, float64.
    """
    with torch.enable_grad():
        output = operator.output.detach().to(torch.float64).requires_grad_(True)
        mixed = operator.readout(output)
        (grad,) = torch.autograd.grad(mixed, output, grad_output.to(mixed.dtype))
    return grad


class _CastMixin:
    def to(self, dtype: torch.dtype):
        """The same operator with every floating tensor cast to ``dtype`` and detached (the conv taps may be a view of
        the model's weight)."""
        changes = {f.name: getattr(self, f.name).detach().to(dtype) for f in fields(self)
                   if torch.is_tensor(getattr(self, f.name)) and getattr(self, f.name).is_floating_point()}
        return replace(self, **changes)


@dataclass
class SelectiveOperator(_CastMixin):
    """Mamba-1 layout: H_c = diag(row_c) · α_c · diag(col_c) · M_c, α the S6 kernel (hidden: row = col = 1, M = I)."""

    delta: torch.Tensor  # (B, L, D)
    A: torch.Tensor  # (D, N)
    B: torch.Tensor  # (B, L, N)
    C: torch.Tensor  # (B, L, N)
    mask: torch.Tensor | None  # (B, L)
    row_weight: torch.Tensor | None = None  # (B, L, D) gate silu(z)
    col_weight: torch.Tensor | None = None  # (B, L, D) activation gain σ(conv pre-activation) · mask
    conv_weight: torch.Tensor | None = None  # (D, K) bias-free causal conv taps
    s6: bool = True
    values: torch.Tensor | None = None  # (B, L, D) what the operator acts on (unified: conv input x; hidden: u)
    output: torch.Tensor | None = None  # (B, L, D) H x (unified: out_proj input without the D skip; hidden: scan)
    readout: Callable | None = field(default=None, repr=False)  # output (float64) -> mixer output

    @property
    def channels(self) -> int:
        return self.delta.shape[-1]

    @property
    def value_channels(self) -> int:
        return self.delta.shape[-1]

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c grad_c[i] · H_c[i, j] · values_c[j]: (B, L, L), or (B, R, L) with ``rows``. grad: (B, L, D)."""
        ones = torch.ones_like(self.delta)
        row = grad.to(self.delta.dtype) * (ones if self.row_weight is None else self.row_weight)
        values = self.values.to(self.delta.dtype)
        if self.s6:  # the kernel folds the conv into its keys and weights the conv'd columns by the values
            out = selective_maps(self.delta, self.A, self.B, self.C, row_weight=row, col_weight=self.col_weight,
                                 conv_weight=self.conv_weight, value_weight=values, rows=rows, reduce="sum")
        else:
            col = ones if self.col_weight is None else self.col_weight
            out = post_conv_columns(lambda r, c: banded_maps(r, c, None, rows, "sum"), row, col, values,
                                    self.conv_weight, self.delta.shape[1])
        return _mask_rows_cols(out, self.mask, rows)

    def diagonal(self) -> torch.Tensor:
        """The per-channel diagonal H_c[i, i] (B, L, D): row · α[i, i] · col · w[K−1], α[i, i] = Δ_i (C_i · B_i)."""
        diag = torch.ones_like(self.delta)
        if self.s6:
            diag = self.delta * (self.C * self.B).sum(-1, keepdim=True)
        for weight in (self.row_weight, self.col_weight):
            if weight is not None:
                diag = diag * weight
        if self.conv_weight is not None:
            diag = diag * self.conv_weight[:, -1]
        return diag if self.mask is None else diag * self.mask[:, :, None]

    def maps(self, reduce="mean", rows=None):
        if self.s6:
            out = selective_maps(self.delta, self.A, self.B, self.C, row_weight=self.row_weight,
                                 col_weight=self.col_weight, conv_weight=self.conv_weight, rows=rows, reduce=reduce)
        else:
            ones = torch.ones_like(self.delta)
            out = banded_maps(ones if self.row_weight is None else self.row_weight,
                              ones if self.col_weight is None else self.col_weight, self.conv_weight, rows, reduce)
        return _mask_rows_cols(out, self.mask, rows)


@dataclass
class BidirectionalOperator:
    """A causal operator and one run over the reversed sequence (Vim's bimamba v2 mixer), summed:
    ``H = H_fwd + J H_bwd J`` with J the token reversal. Non-causal: H_fwd fills the lower triangle, J H_bwd J the
    upper one, both the diagonal.

    ``backward`` holds its tensors in reversed token order (it is the causal operator of the reversed sequence);
    every result is returned in the sequence's order. The operator's output stacks the two directions' outputs in
    the sequence's order, (B, L, 2, D), and ``readout`` maps that stack (float64) to the mixer output.
    """

    forward: SelectiveOperator
    backward: SelectiveOperator
    readout: Callable | None = field(default=None, repr=False)

    def to(self, dtype: torch.dtype):
        return replace(self, forward=self.forward.to(dtype), backward=self.backward.to(dtype))

    @property
    def output(self) -> torch.Tensor:
        return torch.stack([self.forward.output, self.backward.output.flip(1)], dim=2)

    @property
    def channels(self) -> int:
        return self.forward.channels

    @property
    def value_channels(self) -> int:
        return self.forward.value_channels

    @property
    def length(self) -> int:
        return self.forward.delta.shape[1]

    def _rows(self, rows):
        return None if rows is None else torch.as_tensor(rows, dtype=torch.long, device=self.forward.delta.device)

    def _reversed_rows(self, rows):
        return None if rows is None else self.length - 1 - rows

    def _unreverse(self, backward_result: torch.Tensor, rows) -> torch.Tensor:
        """J H_bwd J from H_bwd's rows ``L − 1 − rows``: columns (and, for all rows, rows) back in sequence order."""
        return backward_result.flip(-1) if rows is not None else backward_result.flip(-2, -1)

    def maps(self, reduce="mean", rows=None):
        rows = self._rows(rows)
        forward = self.forward.maps(reduce, rows)
        backward = self._unreverse(self.backward.maps(reduce, self._reversed_rows(rows)), rows)
        out = forward + backward
        if reduce == "abs_mean":
            # The two triangles meet on the diagonal, where the channels' entries add before |·|: replace the sum
            # of the two means of |·| there by the mean of |sum| (exact; the diagonals are cheap, (B, L, D)).
            front, back = self.forward.diagonal(), self.backward.diagonal().flip(1)
            fix = (front + back).abs().mean(-1) - front.abs().mean(-1) - back.abs().mean(-1)  # (B, L)
            index = torch.arange(self.length, device=fix.device) if rows is None else rows
            out[:, torch.arange(len(index), device=fix.device), index] += fix[:, index].to(out.dtype)
        return out

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c g_c[i] · H_c[i, j] · x_c[j] over both directions: (B, L, L) or (B, R, L). grad: (B, L, 2, D), the
        gradient with respect to :attr:`output`."""
        rows = self._rows(rows)
        forward = self.forward.contributions(grad[:, :, 0], rows)
        backward = self.backward.contributions(grad[:, :, 1].flip(1), self._reversed_rows(rows))
        return forward + self._unreverse(backward, rows)


@dataclass
class SSDOperator(_CastMixin):
    """Mamba-2 layout: per channel (h, p) H = diag(row) · α_h · diag(col) · M; per head α_h when all weights are None."""

    delta: torch.Tensor  # (B, L, H)
    A: torch.Tensor  # (H,)
    B: torch.Tensor  # (B, L, G, N)
    C: torch.Tensor  # (B, L, G, N)
    mask: torch.Tensor | None
    row_weight: torch.Tensor | None = None  # (B, L, H, P) norm scale ν · gate silu(z)
    col_weight: torch.Tensor | None = None  # (B, L, H, P) activation gain · mask
    conv_weight: torch.Tensor | None = None  # (H, P, K)
    head_dim: int = 1
    s6: bool = True
    values: torch.Tensor | None = None  # (B, L, H, P) unified: x before the conv; hidden: x after it
    output: torch.Tensor | None = None  # (B, L, H, P) H x (unified: out_proj input without the D skip; hidden: SSD)
    readout: Callable | None = field(default=None, repr=False)  # output (float64) -> mixer output

    @property
    def per_channel(self) -> bool:
        return any(w is not None for w in (self.row_weight, self.col_weight, self.conv_weight))

    @property
    def channels(self) -> int:
        heads = self.delta.shape[-1]
        return heads * self.head_dim if self.per_channel else heads

    @property
    def value_channels(self) -> int:
        return self.delta.shape[-1] * self.head_dim

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c grad_c[i] · H_c[i, j] · values_c[j] over the H·P channels: (B, L, L) or (B, R, L). grad: (B, L, H, P)."""
        values = self.values.to(self.delta.dtype)
        ones = torch.ones_like(values)
        row = grad.to(self.delta.dtype) * (ones if self.row_weight is None else self.row_weight)
        col = ones if self.col_weight is None else self.col_weight
        if self.s6:  # the kernel weights the conv'd columns by the values itself: one call, not one per conv tap
            out = ssd_maps(self.delta, self.A, self.B, self.C, row_weight=row, col_weight=self.col_weight,
                           conv_weight=self.conv_weight, rows=rows, reduce="sum", value_weight=values)
        else:
            out = post_conv_columns(lambda r, c: banded_maps(r.flatten(2), c.flatten(2), None, rows, "sum"), row,
                                    col, values, self.conv_weight, self.delta.shape[1])
        return _mask_rows_cols(out, self.mask, rows)

    def maps(self, reduce="mean", rows=None):
        if self.s6:
            out = ssd_maps(self.delta, self.A, self.B, self.C, row_weight=self.row_weight,
                           col_weight=self.col_weight, conv_weight=self.conv_weight, rows=rows, reduce=reduce)
        else:
            batch, length, heads = self.delta.shape
            flat = lambda w: (torch.ones(batch, length, heads * self.head_dim, dtype=self.delta.dtype,
                                         device=self.delta.device) if w is None else w.flatten(2))
            conv = None if self.conv_weight is None else self.conv_weight.flatten(0, 1)
            out = banded_maps(flat(self.row_weight), flat(self.col_weight), conv, rows, reduce)
        return _mask_rows_cols(out, self.mask, rows)


@dataclass
class DecayOperator:
    """Diagonal-decay recurrences (RWKV-4 WKV, Griffin RG-LRU): H_c = diag(row_c) · α_c · diag(col_c) · M_c with
    ``α_c[i, j] = exp(log_q_i + log_k_j − Σ_{k=j+1..i} log_decay_k)`` below the diagonal, ``exp(log_diag_i)`` on it,
    zero across ``segments`` (state resets); see :mod:`mamba_captum.kernels.decay`.

    The log-space pieces stay float64 whatever the maps' dtype (``out_dtype``): RWKV's keys and normalisers are
    large numbers whose float32 rounding alone would move α by ~1e-6.
    """

    log_decay: torch.Tensor  # (B, L, C) ≥ 0
    log_q: torch.Tensor | None
    log_k: torch.Tensor | None
    log_diag: torch.Tensor | None
    segments: torch.Tensor | None  # (B, L) integer ids: α is 0 across a reset
    mask: torch.Tensor | None  # (B, L)
    row_weight: torch.Tensor | None = None  # (B, L, C) RWKV: σ(receptance); Griffin: gelu(linear_y h)
    col_weight: torch.Tensor | None = None  # (B, L, C) Griffin: √(1 − a²) · input gate
    conv_weight: torch.Tensor | None = None  # (C, K) bias-free causal conv (Griffin unified)
    s6: bool = True  # False: the recurrence switched off (H = diag(row) · M, the "w/o S6" ablation)
    values: torch.Tensor | None = None  # (B, L, C) what H acts on
    output: torch.Tensor | None = None  # (B, L, C) H x
    readout: Callable | None = field(default=None, repr=False)  # output (float64) -> mixer output
    out_dtype: torch.dtype = torch.float64

    def to(self, dtype: torch.dtype):
        """The same operator, detached, giving ``dtype`` maps (the pieces themselves stay float64)."""
        changes = {f.name: getattr(self, f.name).detach() for f in fields(self)
                   if torch.is_tensor(getattr(self, f.name))}
        return replace(self, out_dtype=dtype, **changes)

    @property
    def channels(self) -> int:
        return self.log_decay.shape[-1]

    @property
    def value_channels(self) -> int:
        return self.log_decay.shape[-1]

    def _sum_maps(self, row, col, conv, rows, reduce):
        if not self.s6:
            return banded_maps(row, col, conv, rows, reduce)
        return decay_maps(self.log_decay, self.log_q, self.log_k, log_diag=self.log_diag, row_weight=row,
                          col_weight=col, conv_weight=conv, segments=self.segments, rows=rows, reduce=reduce,
                          out_dtype=torch.float64)

    def maps(self, reduce="mean", rows=None):
        ones = torch.ones_like(self.log_decay)
        row = ones if (self.row_weight is None and not self.s6) else self.row_weight
        col = ones if (self.col_weight is None and not self.s6) else self.col_weight
        out = self._sum_maps(row, col, self.conv_weight, rows, reduce)
        return _mask_rows_cols(out, self.mask, rows).to(self.out_dtype)

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c grad_c[i] · H_c[i, j] · values_c[j]: (B, L, L), or (B, R, L) with ``rows``. grad: (B, L, C)."""
        ones = torch.ones_like(self.log_decay)
        row = grad.to(torch.float64) * (ones if self.row_weight is None else self.row_weight)
        values = self.values.to(torch.float64)
        if self.s6:  # the kernel weights the conv'd columns by the values itself: one call, not one per conv tap
            out = decay_maps(self.log_decay, self.log_q, self.log_k, log_diag=self.log_diag, row_weight=row,
                             col_weight=self.col_weight, conv_weight=self.conv_weight, segments=self.segments,
                             rows=rows, reduce="sum", out_dtype=torch.float64, value_weight=values)
        else:
            col = ones if self.col_weight is None else self.col_weight
            out = post_conv_columns(lambda r, c: self._sum_maps(r, c, None, rows, "sum"), row, col, values,
                                     self.conv_weight, self.log_decay.shape[1])
        return _mask_rows_cols(out, self.mask, rows).to(self.out_dtype)


@dataclass
class SoftmaxOperator(_CastMixin):
    """A softmax attention layer: probabilities (B, H, L, L) over the values; reduced over heads."""

    probs: torch.Tensor
    mask: torch.Tensor | None
    values: torch.Tensor | None = None  # (B, H, L, d) value states, key/value heads repeated for the query heads
    output: torch.Tensor | None = None  # (B, L, H, d) P v, the attention interface's output
    readout: Callable | None = field(default=None, repr=False)  # identity: gradients are taken at that output

    @property
    def channels(self) -> int:
        return self.probs.shape[1]

    @property
    def value_channels(self) -> int:
        return self.values.shape[1] * self.values.shape[-1]

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_{h,d} grad[i, h, d] · P_h[i, j] · v[j, h, d]: (B, L, L) or (B, R, L). grad: (B, L, H, d)."""
        grad = grad.to(self.probs.dtype).transpose(1, 2)  # (B, H, L, d)
        probs = self.probs
        if rows is not None:
            grad, probs = grad[:, :, rows], probs[:, :, rows]
        out = (probs * (grad @ self.values.to(probs.dtype).transpose(-1, -2))).sum(1)
        return _mask_rows_cols(out, self.mask, rows)

    def maps(self, reduce="mean", rows=None):
        probs = self.probs if rows is None else self.probs[:, :, rows]
        return _mask_rows_cols(reduce_channels(probs, reduce), self.mask, rows)


@dataclass
class SumOperator:
    """Parallel mixers summed in one layer (FalconH1: Mamba-2 ∥ attention), each scaled by its output multiplier.

    Reduced maps add up; with ``reduce=None`` the scaled channels of the parts are concatenated along C.
    """

    parts: list = field(default_factory=list)  # [(scale, operator)]

    def to(self, dtype: torch.dtype):
        return SumOperator([(scale, op.to(dtype)) for scale, op in self.parts])

    @property
    def channels(self) -> int:
        return sum(op.channels for _, op in self.parts)

    @property
    def value_channels(self) -> int:
        return sum(op.value_channels for _, op in self.parts)

    def contributions(self, grads, rows=None) -> torch.Tensor:
        """Sum of the parts' contributions, one operator-output gradient per part (``grads`` in part order). No
        multipliers: each part's gradient already carries the layer's output multiplier."""
        return sum(op.contributions(grad, rows) for (_, op), grad in zip(self.parts, grads))

    def maps(self, reduce="mean", rows=None):
        outs = [scale * op.maps(reduce, rows) for scale, op in self.parts]
        return torch.cat(outs, dim=1) if reduce is None else sum(outs)


@dataclass
class ChannelBlocksOperator:
    """Operators on disjoint blocks of channels, side by side (Zamba's Mamba heads, each with its own B, C, Δ): the
    channels of ``parts`` concatenated in order. ``output`` is the parts' outputs concatenated along the last dim
    (B, L, Σ D_p) and ``readout`` maps that (float64) to the mixer output.

    Reductions: ``"sum"`` adds the parts' sums; ``"mean"`` / ``"abs_mean"`` weight each part's mean by its channel
    count (the mean over all channels); ``reduce=None`` concatenates the per-channel maps along C.
    """

    parts: list = field(default_factory=list)
    readout: Callable | None = field(default=None, repr=False)

    def to(self, dtype: torch.dtype):
        return replace(self, parts=[op.to(dtype) for op in self.parts])

    @property
    def output(self) -> torch.Tensor:
        return torch.cat([op.output for op in self.parts], dim=-1)

    @property
    def channels(self) -> int:
        return sum(op.channels for op in self.parts)

    @property
    def value_channels(self) -> int:
        return sum(op.value_channels for op in self.parts)

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ over the parts of their contributions, ``grad`` (shaped like :attr:`output`) split along its last dim."""
        widths = [op.output.shape[-1] for op in self.parts]
        return sum(op.contributions(g, rows) for op, g in zip(self.parts, grad.split(widths, dim=-1)))

    def maps(self, reduce="mean", rows=None):
        outs = [op.maps(reduce, rows) for op in self.parts]
        if reduce is None:
            return torch.cat(outs, dim=1)
        if reduce == "sum":
            return sum(outs)
        counts = [op.channels for op in self.parts]
        return sum(count * out for count, out in zip(counts, outs)) / sum(counts)


# ---------------------------------------------------------------------------------------------------------------
# One core per head: the delta rule, KDA, lightning attention, mLSTM, softmax with convolved values


class _Core:
    """A per-head core α_h (B, H, L, L) given by rows: ``rows(b, rows) -> (H, R, L)``."""

    def full(self) -> torch.Tensor:
        """The whole core, (B, H, L, L)."""
        batch, length = self.q.shape[:2] if hasattr(self, "q") else (self.probs.shape[0], self.probs.shape[-1])
        rows = torch.arange(length, device=(self.q if hasattr(self, "q") else self.probs).device)
        return torch.stack([self.rows(b, rows) for b in range(batch)])

    def to(self, dtype: torch.dtype):
        changes = {f.name: getattr(self, f.name).detach().to(dtype) for f in fields(self)
                   if f.name in self.CAST and getattr(self, f.name) is not None}
        return replace(self, **changes)


@dataclass
class DeltaRuleCore(_Core):
    """The (gated) delta rule, :mod:`kernels.delta_rule`: q, k (B, L, H, K) as the kernel uses them, beta (B, L, H),
    log_decay (B, L, H) or (B, L, H, K) (KDA). The whole α of one element is computed at once and kept for its
    next rows."""

    q: torch.Tensor
    k: torch.Tensor
    beta: torch.Tensor
    log_decay: torch.Tensor
    CAST = ("q", "k", "beta")  # the log decays stay float64: their cumsums feed exponentials
    _cached: tuple = field(default=(None, None), init=False, repr=False, compare=False)

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        if self._cached[0] != b:
            self._cached = (b, delta_rule_alpha(self.q[b:b + 1], self.k[b:b + 1], self.beta[b:b + 1],
                                                self.log_decay[b:b + 1])[0])
        return self._cached[1][:, rows]


@dataclass
class GatedScoresCore(_Core):
    """Decayed linear attention, :mod:`kernels.gated_scores`: α_h[i, j] = (q_i · k_j) exp(G_i − G_j + log_col_j +
    log_row_i). q, k (B, L, H, K); cumulative, log_col, log_row (B, L, H) float64 (log_col / log_row may be None)."""

    q: torch.Tensor
    k: torch.Tensor
    cumulative: torch.Tensor
    log_col: torch.Tensor | None = None
    log_row: torch.Tensor | None = None
    CAST = ("q", "k")

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        pick = lambda t: None if t is None else t[b]  # noqa: E731
        return gated_scores_alpha_rows(self.q[b], self.k[b], self.cumulative[b], pick(self.log_col),
                                       pick(self.log_row), rows)


@dataclass
class DenseCore(_Core):
    """A core given whole: softmax probabilities (B, H, L, L)."""

    probs: torch.Tensor
    CAST = ("probs",)

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        return self.probs[b][:, rows]


def gate_norm_rows(components, gate, norm_scale):
    """The unified row weight of an output gate and a norm scale (each a per-token, per-channel factor), as
    ``components`` keeps them: gate · scale, either alone, or None when both are switched off."""
    kept = [w for name, w in (("gate", gate), ("norm", norm_scale)) if name in components and w is not None]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept[0] * kept[1]


@dataclass
class HeadOperator:
    """One core per head, weighted per channel: H_c = diag(row_c) · α_h · diag(col_c) · M_c for channel c = (h, p)
    (:mod:`kernels.heads`); the per-head cores α_h when every weight is None (C = H). ``core=None`` or ``s6=False``:
    the core switched off (α = I, the banded "w/o core" ablation; LFM2's short conv is only this band, LFM3-VL's
    vision conv a 2-D band given by ``neighbours``)."""

    core: _Core | None
    mask: torch.Tensor | None  # (B, L)
    heads: int
    head_dim: int  # P, the value channels of one head
    row_weight: torch.Tensor | None = None  # (B, L, H, P) norm scale · output gate
    col_weight: torch.Tensor | None = None  # (B, L, H, P) activation gain · mask
    conv_weight: torch.Tensor | None = None  # (H, P, K) bias-free causal conv on the values, or (B, L, H, P, K) per-row
    input_weight: torch.Tensor | None = None  # (B, L, H, P) a weight before the conv (LFM2's input gate); band only
    neighbours: torch.Tensor | None = None  # (T, L) long: the token each of T conv taps reads (banded_maps); band only
    s6: bool = True  # False: the core switched off
    values: torch.Tensor | None = None  # (B, L, H, P) what H acts on
    output: torch.Tensor | None = None  # (B, L, H, P) H x
    readout: Callable | None = field(default=None, repr=False)  # output (float64) -> mixer output
    out_dtype: torch.dtype = torch.float64

    def to(self, dtype: torch.dtype):
        """The same operator giving ``dtype`` maps, detached (log-space decays stay float64)."""
        changes = {f.name: getattr(self, f.name).detach().to(dtype) for f in fields(self)
                   if torch.is_tensor(getattr(self, f.name)) and getattr(self, f.name).is_floating_point()}
        core = None if self.core is None else self.core.to(dtype)
        return replace(self, core=core, out_dtype=dtype, **changes)

    @property
    def _active_core(self):
        return self.core if self.s6 else None

    @property
    def per_channel(self) -> bool:
        return any(w is not None for w in (self.row_weight, self.col_weight, self.conv_weight, self.input_weight)) \
            or self._active_core is None

    @property
    def channels(self) -> int:
        return self.heads * self.head_dim if self.per_channel else self.heads

    @property
    def value_channels(self) -> int:
        return self.heads * self.head_dim

    def _shape(self):
        some = next(t for t in (self.values, self.row_weight, self.col_weight, self.output) if t is not None)
        return some.shape[0], some.shape[1], some.device

    def _maps(self, row, col, conv, rows, reduce, inputs=None):
        batch, length, device = self._shape()
        core = self._active_core
        if core is None:
            ones = torch.ones(batch, length, self.heads * self.head_dim, dtype=self.out_dtype, device=device)
            flat = lambda w: ones if w is None else w.flatten(2).to(self.out_dtype)  # noqa: E731
            return banded_maps(flat(row), flat(col), None if conv is None else conv.flatten(-3, -2).to(self.out_dtype),
                               rows, reduce, input_weight=None if inputs is None else flat(inputs),
                               neighbours=self.neighbours)
        if inputs is not None or self.neighbours is not None:
            raise ValueError("mamba_captum: input_weight (a weight before the conv) and neighbours (a conv that is "
                             "not the causal 1-D band) are defined for the band only.")
        if conv is not None and conv.dim() == 5:
            return self._per_row_conv_maps(core, row, col, conv, rows, reduce)
        return head_maps_blocked(core.rows, batch=batch, length=length, heads=self.heads, row_weight=row,
                                 col_weight=col, conv_weight=conv, rows=rows, reduce=reduce, dtype=self.out_dtype,
                                 device=device)

    def _per_row_conv_maps(self, core, row, col, conv, rows, reduce):
        """Maps with per-row conv taps (B, L, H, P, K): tap by tap, each a column weight of the core's maps shifted by
        τ columns (:func:`post_conv_columns`, linear in the channels); "abs_mean" head by head from per-channel
        slabs, so that |·| is taken after the taps are summed."""
        batch, length, device = self._shape()
        col = torch.ones(batch, length, self.heads, self.head_dim, dtype=self.out_dtype, device=device) \
            if col is None else col.to(self.out_dtype)
        ones = torch.ones_like(col)

        def maps(alpha_rows, heads, r, c, how):
            return head_maps_blocked(alpha_rows, batch=batch, length=length, heads=heads, row_weight=r, col_weight=c,
                                     rows=rows, reduce=how, dtype=self.out_dtype, device=device)

        if reduce != "abs_mean":
            return post_conv_columns(lambda r, c: maps(core.rows, self.heads, r, c, reduce), row, col, ones, conv,
                                     length)
        total = 0
        for h in range(self.heads):
            part = slice(h, h + 1)
            slab = post_conv_columns(
                lambda r, c, part=part: maps(lambda b, q: core.rows(b, q)[part], 1, r, c, None),
                None if row is None else row[:, :, part], col[:, :, part], ones[:, :, part], conv[:, :, part],
                length)  # (B, P, R, L)
            total = total + slab.abs().sum(1)
        return total / (self.heads * self.head_dim)

    def band(self) -> torch.Tensor:
        """The band's entries ``bands[b, i, c, τ] = H_c[i, i − τ]`` (B, L, C, K) of an operator without a core
        (masked rows and columns 0): what :class:`ComposedOperator` reads of a band that follows another mixer."""
        if self._active_core is not None or self.neighbours is not None:
            raise ValueError("mamba_captum: band() is defined for a causal 1-D band without a core.")
        batch, length, device = self._shape()
        ones = torch.ones(batch, length, self.heads * self.head_dim, dtype=self.out_dtype, device=device)
        flat = lambda w: ones if w is None else w.flatten(2).to(self.out_dtype)  # noqa: E731
        conv = None if self.conv_weight is None else self.conv_weight.flatten(-3, -2).to(self.out_dtype)
        inputs = flat(self.input_weight) if self.input_weight is not None else None
        if self.mask is not None:  # pads neither read nor are read
            mask = self.mask.to(self.out_dtype)[:, :, None]
            inputs = mask if inputs is None else inputs * mask
        bands = band_entries(flat(self.row_weight), flat(self.col_weight), conv, inputs)
        return bands if self.mask is None else bands * self.mask.to(bands.dtype)[:, :, None, None]

    def maps(self, reduce="mean", rows=None):
        out = self._maps(self.row_weight, self.col_weight, self.conv_weight, rows, reduce, self.input_weight)
        return _mask_rows_cols(out, self.mask, rows)

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c grad_c[i] · H_c[i, j] · values_c[j]: (B, L, L) or (B, R, L). grad: (B, L, H, P)."""
        values = self.values.to(self.out_dtype)
        ones = torch.ones_like(values)
        row = grad.to(self.out_dtype) * (ones if self.row_weight is None else self.row_weight)
        col = ones if self.col_weight is None else self.col_weight
        if self._active_core is None:  # the band takes the values as its input weight: one call
            inputs = values if self.input_weight is None else values * self.input_weight
            out = self._maps(row, col, self.conv_weight, rows, "sum", inputs)
            return _mask_rows_cols(out, self.mask, rows)
        out = post_conv_columns(lambda r, c: self._maps(r, c, None, rows, "sum"), row, col, values,
                                self.conv_weight, values.shape[1])
        return _mask_rows_cols(out, self.mask, rows)


# ---------------------------------------------------------------------------------------------------------------
# A mixer followed by a band with no residual between them: Inkling's attention and its post-attention convolution


@dataclass
class ComposedOperator:
    """A token mixer whose (projected) output is mixed again, per channel, by a causal band before it joins the
    residual stream: ``out = T(W(A x))`` (Inkling's ``attn_sconv(o_proj(attention))``).

    ``inner`` is the first operator (A per value channel c, over x), ``W`` the affine part of its readout (o_proj),
    ``outer`` the band operator T (one channel per hidden channel d, no core). T's taps differ per hidden channel, so
    T does not commute with W: the composition is a sum over paths d ← c, each with the token operator
    ``H_{d,c} = T_d · A_c`` and the scalar weight ``W[d, c]`` (channel mixing, which no map includes, as every
    out_proj): ``y_d = Σ_c W[d, c] · H_{d,c} x_c``.

    Maps are over the D·C paths: ``reduce=None`` gives them all, (B, D·C, L, L) with d major; the path mean is
    exactly ``mean_d T_d · mean_c A_c`` and the sum ``Σ_d T_d · Σ_c A_c`` (products of the parts' reduced maps);
    "abs_mean" takes |·| of every path. The band reaches K − 1 tokens back, so R query rows need at most R·K rows
    of the inner maps. ``contributions`` is the exact gradient × operator × input over the paths, K calls of the
    inner one. ``output`` is ``T W A x`` (B, L, D); ``readout`` adds what comes from no real token.
    """

    inner: object
    outer: HeadOperator
    output: torch.Tensor
    readout: Callable | None = field(default=None, repr=False)

    @classmethod
    def of(cls, inner, outer: HeadOperator) -> "ComposedOperator":
        """Compose ``inner`` (whose readout is affine and gives the band's input) with the band ``outer`` (whose
        ``readout(output)`` is the layer's real output, rebuilt)."""
        dtype = torch.float64
        inner_output = inner.output.detach().to(dtype)
        offset = inner.readout(torch.zeros_like(inner_output))
        projected = inner.readout(inner_output) - offset  # W (A x): the band's input from the real tokens
        bands = outer.band().to(dtype)  # (B, L, D, K)
        output = _apply_band(bands, projected)
        constant = outer.readout(outer.output.detach().to(dtype)).reshape(output.shape) - output
        return cls(inner, outer, output, readout=lambda out: out + constant.to(out.dtype))

    def to(self, dtype: torch.dtype):
        return replace(self, inner=self.inner.to(dtype), outer=self.outer.to(dtype),
                       output=self.output.detach().to(dtype))

    @property
    def mask(self):
        return self.outer.mask

    @property
    def values(self):
        return self.inner.values

    @property
    def channels(self) -> int:
        return self.outer.channels * self.inner.channels

    @property
    def value_channels(self) -> int:
        return self.inner.value_channels

    def _rows(self, rows):
        length = self.output.shape[1]
        return torch.arange(length, device=self.output.device) if rows is None \
            else torch.as_tensor(rows, dtype=torch.long, device=self.output.device)

    def _needed(self, query):
        """The inner rows the band reads for these query rows: i − τ for τ < K, from token 0 on (sorted)."""
        width = 1 if self.outer.conv_weight is None else self.outer.conv_weight.shape[-1]
        needed = (query[:, None] - torch.arange(width, device=query.device)).flatten()
        return torch.unique(needed[needed >= 0], sorted=True)

    def maps(self, reduce="mean", rows=None):
        query = self._rows(rows)
        needed = self._needed(query)
        outer = self.outer.maps(reduce if reduce != "abs_mean" else None, query)[..., needed]  # (B, [D,] R, R')
        inner = self.inner.maps(reduce if reduce != "abs_mean" else None, needed)  # (B, [C,] R', L)
        dtype = torch.promote_types(outer.dtype, inner.dtype)
        outer, inner = outer.to(dtype), inner.to(dtype)
        if reduce in ("mean", "sum"):
            out = outer @ inner
        elif reduce is None:
            out = torch.einsum("bdrn,bcnl->bdcrl", outer, inner).flatten(1, 2)
        else:  # mean over the paths of |T_d A_c|, a few hidden channels at a time
            out = 0
            step = max(1, (1 << 22) // max(1, inner[0].numel()))
            for first in range(0, outer.shape[1], step):
                block = torch.einsum("bdrn,bcnl->bdcrl", outer[:, first:first + step], inner)
                out = out + block.abs().sum((1, 2))
            out = out / (outer.shape[1] * inner.shape[1])
        return out

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_{d,c} g_d[i] · W[d, c] · H_{d,c}[i, j] · x_c[j]: (B, L, L) or (B, R, L); grad (B, L, D) with respect to
        :attr:`output`. Rows sum to Σ_d g_d[i] · y_d[i]."""
        query = self._rows(rows)
        dtype = torch.float64
        grad = grad.to(dtype).reshape(self.output.shape)
        bands = self.outer.band().to(dtype)  # (B, L, D, K): out[i, d] reads z[i − τ, d] with bands[.., τ]
        batch, length = grad.shape[:2]
        total = torch.zeros(batch, len(query), length, dtype=dtype, device=grad.device)
        for tau in range(min(bands.shape[-1], length)):
            valid = query >= tau
            if not bool(valid.any()):
                continue
            shifted = torch.zeros_like(grad)  # the band input's row r = i − τ, weighted by out row i = r + τ
            shifted[:, :length - tau] = grad[:, tau:] * bands[:, tau:, :, tau]
            inner_grad = operator_output_grad(self.inner, shifted)
            part = self.inner.contributions(inner_grad, query[valid] - tau)
            total[:, valid] += part.to(dtype)
        return total.to(self.outer.out_dtype)


def _apply_band(bands: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Σ_τ bands[:, i, d, τ] · values[:, i − τ, d]: a per-channel causal band (B, L, D, K) on (B, L, D)."""
    out = values * bands[..., 0]
    for tau in range(1, min(bands.shape[-1], values.shape[1])):
        out[:, tau:] += values[:, :-tau] * bands[:, tau:, :, tau]
    return out
