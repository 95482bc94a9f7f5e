"""A sum of causal operators, each run over its own ordering of the tokens, after a shared input band:
``H_c = Σ_k P_kᵀ H_{k,c} P_k · M_c`` (:class:`PermutedSumOperator`).

P_k is the permutation that lays the tokens in scan order k (``order_k[t]`` = the token at scan position t), H_{k,c}
a causal operator over that order (any operator with ``maps``, ``contributions`` and a ``values`` field, e.g. a
:class:`~mamba_captum.operators.SelectiveOperator` with its row and column weights already permuted), and M_c an
optional per-channel conv over the tokens in their own order (``neighbours`` (T, L) + ``taps`` (C, T): tap τ of token
t reads token ``neighbours[τ, t]``, −1 for none; a 2-D depthwise conv over an image grid). With M, the operator acts on
the conv's input; each tap τ is one pass of the parts with their column weight times ``taps[:, τ]``, whose columns
move from t to ``neighbours[τ, t]`` (distinct per τ, so a scatter). Without M (hidden forms) it is the identity.

Bidirectional Vim is K = 2 (identity, reversal) without M; VMamba's SS2D is K = 4 (row-major, column-major, and
both reversed, :func:`mamba_captum.kernels.grid_orders.cross_scan_orders`) with its 3×3 depthwise conv as M.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch


# ~elements of one per-channel block of maps when "abs_mean" goes through the channels in blocks
_ABS_BLOCK_ELEMENTS = 1 << 24


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """position[j] = the scan position of token j."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _select_channels(op, index: torch.Tensor):
    """``op`` restricted to the channels ``index`` (through its ``CHANNEL_FIELDS``)."""
    changes = {}
    for name, axis in op.CHANNEL_FIELDS.items():
        value = getattr(op, name)
        if torch.is_tensor(value):
            changes[name] = value.index_select(axis % value.dim(), index.to(value.device))
    return dataclasses.replace(op, **changes)


@dataclass
class PermutedSumOperator:
    """``H_c = Σ_k P_kᵀ H_{k,c} P_k · M_c`` over L tokens in their own order (module docstring).

    ``parts``: [(order (L,) long, operator over that scan order)], all with the same C channels; the parts' own
    ``values`` are not read (the tokens' values are :attr:`values`, permuted per part). ``output``: H x in token order
    (B, L, C), the conv bias' share included; ``readout`` maps it (float64) to the mixer output. ``conv_weight`` (C, T)
    and ``neighbours`` (T, L): the input band M, or None (M = I); ``conv_bias`` (C,): the band's bias (its share of
    the output comes from no token).
    """

    parts: list
    values: torch.Tensor  # (B, L, C) what H acts on, token order
    output: torch.Tensor | None = None  # (B, L, C)
    conv_weight: torch.Tensor | None = None  # (C, T)
    neighbours: torch.Tensor | None = None  # (T, L) long
    conv_bias: torch.Tensor | None = None  # (C,)
    readout: Callable | None = field(default=None, repr=False)

    def to(self, dtype: torch.dtype):
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return replace(self, parts=[(order, op.to(dtype)) for order, op in self.parts], values=cast(self.values),
                       output=cast(self.output), conv_weight=cast(self.conv_weight), conv_bias=cast(self.conv_bias))

    @property
    def channels(self) -> int:
        return self.parts[0][1].channels

    @property
    def value_channels(self) -> int:
        return self.values.shape[-1]

    @property
    def length(self) -> int:
        return self.values.shape[1]

    @property
    def mask(self):
        return None

    # -- the band, tap by tap -----------------------------------------------------------------------------------
    def _taps(self):
        """[(tap weight (C,) or None, reads (L,) long or None)]: the identity without a band."""
        if self.conv_weight is None:
            return [(None, None)]
        neighbours = self.neighbours.to(self.values.device)
        return [(self.conv_weight[:, tau], neighbours[tau]) for tau in range(neighbours.shape[0])]

    def _scatter(self, total, result, reads):
        """Add ``result`` (.., L) over conv-output columns t into ``total``'s columns ``reads[t]`` (the tokens read)."""
        if reads is None:
            return result if total is None else total + result
        if total is None:
            total = torch.zeros_like(result)
        valid = reads >= 0
        total[..., reads[valid]] += result[..., valid]
        return total

    def _rows(self, rows):
        return None if rows is None else torch.as_tensor(rows, dtype=torch.long, device=self.values.device)

    def _over_parts(self, per_part, rows):
        """Σ_k of ``per_part(op, scan_rows, order)`` (B, [C,] R, L) in scan order, back in token order."""
        total = None
        for order, op in self.parts:
            order = order.to(self.values.device)
            position = _inverse(order)
            scan_rows = None if rows is None else position[rows]
            result = per_part(op, scan_rows, order)
            result = result[..., position]  # columns to token order
            if rows is None:
                result = result[..., position, :]  # rows too
            total = result if total is None else total + result
        return total

    # -- maps -----------------------------------------------------------------------------------------------------
    def maps(self, reduce="mean", rows=None):
        rows = self._rows(rows)
        if reduce == "abs_mean":
            return self._abs_mean(rows)
        total = None
        for weight, reads in self._taps():
            def per_part(op, scan_rows, order, weight=weight):
                if weight is not None:
                    col = op.col_weight
                    col = weight.to(op.delta.dtype) * (torch.ones_like(op.delta) if col is None else col)
                    op = replace(op, col_weight=col)
                return op.maps(reduce, scan_rows)

            total = self._scatter(total, self._over_parts(per_part, rows), reads)
        return total

    def _abs_mean(self, rows):
        """mean_c |H_c| through blocks of channels (the parts overlap anywhere, not only on the diagonal)."""
        channels = self.channels
        length = self.length
        count = length if rows is None else len(rows)
        batch = self.values.shape[0]
        step = max(1, _ABS_BLOCK_ELEMENTS // max(1, batch * count * length))
        total = None
        for first in range(0, channels, step):
            index = torch.arange(first, min(first + step, channels), device=self.values.device)
            block = self._channel_block(index).maps(None, rows).abs().sum(1)
            total = block if total is None else total + block
        return total / channels

    def _channel_block(self, index):
        return replace(self, parts=[(order, _select_channels(op, index)) for order, op in self.parts],
                       values=self.values.index_select(-1, index),
                       output=None if self.output is None else self.output.index_select(-1, index),
                       conv_weight=None if self.conv_weight is None else self.conv_weight.index_select(0, index),
                       conv_bias=None if self.conv_bias is None else self.conv_bias.index_select(0, index))

    # -- contributions --------------------------------------------------------------------------------------------
    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c g_c[i] · H_c[i, j] · x_c[j]: (B, L, L), or (B, R, L) with ``rows``. grad: (B, L, C) with respect to
        :attr:`output`, token order."""
        rows = self._rows(rows)
        values = self.values
        total = None
        for weight, reads in self._taps():
            if reads is None:
                tapped = values
            else:  # the conv's output at t from this tap: weight · x[reads[t]]
                tapped = torch.zeros_like(values)
                valid = reads >= 0
                tapped[:, valid] = values[:, reads[valid]] * weight.to(values.dtype)

            def per_part(op, scan_rows, order, tapped=tapped):
                return replace(op, values=tapped[:, order]).contributions(grad[:, order], scan_rows)

            total = self._scatter(total, self._over_parts(per_part, rows), reads)
        return total

