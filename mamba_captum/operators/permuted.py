"""A sum of causal operators, each run over its own ordering of the tokens, after a shared input band:
``H_c = Σ_k P_kᵀ H_{k,c} P_k · M_c`` (:class:`PermutedSumOperator`).

P_k is the permutation that lays the tokens in scan order k (``order_k[t]`` = the token at scan position t), H_{k,c}
a causal operator over that order (any operator with ``maps``, ``contributions`` and a ``values`` field, e.g. a
:class:`~mamba_captum.operators.SelectiveOperator` with its row and column weights already permuted), and M_c an
optional per-channel conv over the tokens in their own order (``neighbours`` (T, L) + ``taps`` (C, T): tap τ of token
t reads token ``neighbours[τ, t]``, −1 for none; a 2-D depthwise conv over an image grid). With M, the operator acts on
the conv's input; each tap τ is one pass of the parts with their column weight times ``taps[:, τ]``, whose columns
move from t to ``neighbours[τ, t]`` (distinct per τ, so a scatter). Without M (hidden forms) it is the identity.

How it is computed (the results are the same up to float rounding): all rows of an S6 part on a grid go through the
blocked S6 kernel once per line shift of the band (:func:`_line_plan`: a 3×3 conv is three 1-D convs along a padded
scan, three kernel calls per scan, not nine), then one permutation back to token order; a few rows (the map check's)
from each part's per-channel rows, weighed tap by tap; anything else tap by tap, summed in scan order and permuted
once per part. No per-channel L × L stack is formed for reduced maps or contributions.

Bidirectional Vim is K = 2 (identity, reversal) without M; VMamba's SS2D is K = 4 (row-major, column-major, and
both reversed, :func:`mamba_captum.kernels.grid_orders.cross_scan_orders`) with its 3×3 depthwise conv as M.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..kernels.selective import selective_maps
from .common import select_channels


# ~elements of one per-channel block of maps when "abs_mean" goes through the channels in blocks
_ABS_BLOCK_ELEMENTS = 1 << 24
# few rows (the run-time map check's, a rollout's query rows): each part's per-channel rows (B, C, R, L) are computed
# once and every tap weighs and moves them, instead of one kernel call per tap, when they hold at most this many
_ROWS_PER_CHANNEL_ELEMENTS = 1 << 24


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """position[j] = the scan position of token j."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


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

    def _rows(self, rows):
        return None if rows is None else torch.as_tensor(rows, dtype=torch.long, device=self.values.device)

    def _over_parts(self, per_part, rows, tapped_rows=None, lined=None):
        """Σ_k Σ_τ of ``per_part(op, scan_rows, order, weight, valid, read_tokens)`` (B, [C,] R, L) in scan order k,
        each tap's columns moved to the tokens it reads, back in token order.

        ``valid`` (L,) bool in scan order: the scan positions whose conv-output token reads a token with tap τ
        (None without a band); ``per_part`` gives columns outside it as zeros. A tap moves the columns of scan k by
        one constant offset when the grid's neighbours are shifts in scan order (every cross-scan order of a 'same'
        conv: ±1 along the scan, ±(grid width) across it): then it is a slice add in scan order; otherwise a scatter.
        The taps of one order are summed in scan order, so each order is permuted back once, not once per tap.
        For few ``rows`` (:meth:`_rows_per_channel`), ``tapped_rows`` = (prepare, per_tap) replaces ``per_part``:
        ``prepare(per_channel, scan_rows, order)`` readies the part's per-channel rows (B, C, R, L) once, and
        ``per_tap(prepared, weight, valid, read_tokens)`` weighs them by each tap (GEMMs over the channels).
        For all rows of an S6 part on a grid (:func:`_line_plan`), ``lined(op, order, plan)`` gives the part's whole
        share in token order instead (:func:`_lined_maps`).
        """
        device = self.values.device
        total = None
        few_rows = tapped_rows is not None and self._rows_per_channel(rows)
        for order, op in self.parts:
            order = order.to(device)
            position = _inverse(order)
            scan_rows = None if rows is None else position[rows]
            if rows is None and lined is not None and self.conv_weight is not None:
                plan = _line_plan(op, [(weight, reads[order]) for weight, reads in self._taps()], position)
                if plan is not None:  # the band as K-tap 1-D convs over a padded scan: one kernel call per line shift
                    summed = lined(op, order, plan)
                    total = summed if total is None else total + summed
                    continue
            if few_rows:  # the part's per-channel rows (its row and column weights, no band), once for every tap
                prepared = tapped_rows[0](op.maps(None, scan_rows), scan_rows, order)
                def per_part(op, scan_rows, order, *tap, prepared=prepared):
                    return tapped_rows[1](prepared, *tap)
            summed = None
            for weight, reads in self._taps():
                if reads is None:
                    result = per_part(op, scan_rows, order, None, None, None)
                    summed = result if summed is None else summed + result
                    continue
                read_tokens = reads[order]  # the token read by the conv output at each scan position
                valid = read_tokens >= 0
                targets = torch.where(valid, position[read_tokens.clamp(min=0)], -1)  # scan position read
                result = per_part(op, scan_rows, order, weight, valid, read_tokens.clamp(min=0))
                summed = _add_columns(summed, result, targets, valid)
            summed = _to_token_order(summed, position, columns_only=rows is not None)
            total = summed if total is None else total + summed
        return total

    def _rows_per_channel(self, rows) -> bool:
        """Few rows of S6 parts with a band: their per-channel rows are small, so each part's are computed once."""
        if rows is None or self.conv_weight is None or not all(getattr(op, "s6", False) for _, op in self.parts):
            return False
        return self.values.shape[0] * self.channels * len(rows) * self.length <= _ROWS_PER_CHANNEL_ELEMENTS

    # -- maps -----------------------------------------------------------------------------------------------------
    def maps(self, reduce="mean", rows=None):
        rows = self._rows(rows)
        if reduce == "abs_mean":
            return self._abs_mean(rows)

        def per_part(op, scan_rows, order, weight, valid, read_tokens):
            if weight is not None:  # the tap's weight on the part's columns, 0 where the tap reads no token
                col = op.col_weight
                tap = weight.to(op.delta.dtype) * valid.to(op.delta.dtype)[:, None]  # (L, C)
                col = tap if col is None else col * tap
                op = replace(op, col_weight=col.expand_as(op.delta))
            return op.maps(reduce, scan_rows)

        def prepare(per_channel, scan_rows, order):
            return per_channel if reduce is None else per_channel.permute(3, 0, 2, 1).contiguous()  # (L, B, R, C)

        def per_tap(prepared, weight, valid, read_tokens):
            tap = weight.to(prepared.dtype)[:, None] * valid.to(prepared.dtype)  # (C, L)
            if reduce is None:
                return prepared * tap[:, None]
            out = _column_products(prepared, tap.T[:, None, :].expand(-1, prepared.shape[1], -1))
            return out / prepared.shape[-1] if reduce == "mean" else out

        def lined(op, order, plan):
            return _lined_maps(op, plan, reduce)

        return self._over_parts(per_part, rows, (prepare, per_tap), lined)

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
        return replace(self, parts=[(order, select_channels(op, index)) for order, op in self.parts],
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

        def per_part(op, scan_rows, order, weight, valid, read_tokens):
            tapped = values[:, order]
            if weight is not None:  # the conv's output at scan position t from this tap: weight · x[read token]
                tapped = values[:, read_tokens] * (weight.to(values.dtype) * valid.to(values.dtype)[:, None])
            return replace(op, values=tapped).contributions(grad[:, order], scan_rows)

        def prepare(per_channel, scan_rows, order):  # g_c[i] · H_c[i, t] without the band: (L, B, R, C)
            weighted = per_channel * grad[:, order][:, scan_rows].to(per_channel.dtype).mT[:, :, :, None]
            return weighted.permute(3, 0, 2, 1).contiguous()

        def per_tap(prepared, weight, valid, read_tokens):
            dtype = prepared.dtype
            tapped = values[:, read_tokens].to(dtype) * (weight.to(dtype) * valid.to(dtype)[:, None])  # (B, L, C)
            return _column_products(prepared, tapped.transpose(0, 1))

        def lined(op, order, plan):
            return _lined_maps(op, plan, "sum", grad=grad[:, order], values=values[:, order])

        return self._over_parts(per_part, rows, (prepare, per_tap), lined)


def _line_plan(op, taps, position):
    """How the band's taps over one scan order become 1-D convs along the scan, or None.

    On a grid scanned line by line (rows, or columns; forwards or reversed) a 'same' conv's tap moves scan position
    t by a constant δ = e·ℓ + f (ℓ the line length, |f| < ℓ/2), and reads a token exactly when ``t + δ`` lies in the
    scan and ``t mod ℓ + f`` in the line. With P = max |f| inactive tokens before each line (Δ = B = C = 0: the S6
    kernel between the real tokens is unchanged, the inactive ones neither read nor are read) the wrap of a line
    lands on them, so the taps of one e are one K = 2P + 1 tap 1-D conv whose output is moved by e·(ℓ + P): one map
    kernel call per e (3 for a 3×3 conv) instead of one per tap (9). The line length is found by trying the taps'
    own offsets and L, and checked against every tap's reads; anything else returns None (the tap-by-tap path).

    Args:
        op: the part's operator over its scan order; only an S6 part without its own conv or mask qualifies.
        taps: [(weight (C,), read tokens (L,) in scan order, −1 for none)].  position: (L,) token -> scan position.
    Returns:
        dict(line=ℓ, pad=P, convs={e: (C, 2P + 1) taps}, index=(L,) padded scan position of each token) or None.
    """
    if not getattr(op, "s6", False) or getattr(op, "conv_weight", None) is not None \
            or getattr(op, "mask", None) is not None or not hasattr(op, "delta"):
        return None
    length = position.numel()
    scan = torch.arange(length, device=position.device)
    shifts, valids = [], []
    for _, reads in taps:
        valid = reads >= 0
        offsets = torch.where(valid, position[reads.clamp(min=0)], 0) - scan
        offsets = offsets[valid]
        if offsets.numel() == 0 or not bool((offsets == offsets[0]).all()):
            return None
        shifts.append(int(offsets[0]))
        valids.append(valid)
    for line in sorted({abs(d) for d in shifts if d} | {length}):
        split = [(round(d / line), d - round(d / line) * line) for d in shifts]
        pad = max(abs(f) for _, f in split)
        if 2 * pad >= line:
            continue
        inside = lambda d, f: ((scan % line + f >= 0) & (scan % line + f < line)  # noqa: E731
                               & (scan + d >= 0) & (scan + d < length))
        if all(torch.equal(inside(d, f), valid) for d, (_, f), valid in zip(shifts, split, valids)):
            break
    else:
        return None
    convs = {}
    for (weight, _), (e, f) in zip(taps, split):
        conv = convs.setdefault(e, weight.new_zeros(weight.shape[0], 2 * pad + 1))
        conv[:, pad + f] += weight  # output column u reads S6 column u + P − f with tap w[P + f] (kernel's order)
    padded_scan = (scan // line) * (line + pad) + pad + scan % line
    return dict(line=line, pad=pad, convs=convs, index=padded_scan[position])


def _lined_maps(op, plan, reduce, grad=None, values=None):
    """The part's whole share ``P_kᵀ H_k M P_k`` in token order, (B, [C,] L, L): maps (``reduce``), or with ``grad``
    and ``values`` (B, L, C) in scan order the contributions Σ_c g_c[i] H_c[i, j] x_c[j] (reduce "sum"), through
    the S6 kernel on the padded scan of :func:`_line_plan` (one call per line shift e)."""
    line, pad, index = plan["line"], plan["pad"], plan["index"]
    batch, length, channels = op.delta.shape
    lines = -(-length // line)
    padded_length = lines * (line + pad)
    scan = torch.arange(length, device=op.delta.device)
    padded_scan = (scan // line) * (line + pad) + pad + scan % line

    def padded(t):
        if t is None:
            return None
        out = t.new_zeros((t.shape[0], padded_length) + tuple(t.shape[2:]))
        out[:, padded_scan] = t
        return out

    row = op.row_weight
    if grad is not None:
        grad = grad.to(op.delta.dtype)
        row = grad if row is None else grad * row
    delta, B, C, row, col = (padded(t) for t in (op.delta, op.B, op.C, row, op.col_weight))
    x = None if values is None else padded(values.to(op.delta.dtype))
    total = None
    for e, conv in plan["convs"].items():
        shift = e * (line + pad) + pad  # the kernel's output column u is padded column u + shift
        value_weight = None
        if x is not None:  # x at the column each output column lands on
            value_weight = torch.zeros_like(x)
            if shift >= 0:
                value_weight[:, :padded_length - shift] = x[:, shift:]
            else:
                value_weight[:, -shift:] = x[:, :padded_length + shift]
        result = selective_maps(delta, op.A, B, C, row_weight=row, col_weight=col, conv_weight=conv.to(delta.dtype),
                                value_weight=value_weight, reduce=reduce)
        if total is None:
            total = torch.zeros_like(result)
        if shift >= 0:
            total[..., shift:] += result[..., :padded_length - shift]
        else:
            total[..., :padded_length + shift] += result[..., -shift:]
    return total[..., index][..., index, :]  # the real tokens, in token order


def _column_products(prepared, weights):
    """``out[b, r, t] = Σ_c prepared[t, b, r, c] · weights[t, b, c]``: (B, R, L) from prepared (L, B, R, C) and
    weights (L, B, C), one batched GEMM over the columns t (and the batch)."""
    return torch.matmul(prepared, weights[..., None])[..., 0].permute(1, 2, 0)


def _add_columns(total, result, targets, valid):
    """``total`` plus ``result`` (.., L) with column t moved to column ``targets[t]`` (t with ``valid``; the others
    are zero in ``result``): a slice add when the move is one offset for every valid t, else a scatter."""
    length = result.shape[-1]
    if total is None:
        total = torch.zeros_like(result)
    index = torch.arange(length, device=result.device)
    offsets = (targets - index)[valid]
    if offsets.numel() == 0:
        return total
    shift = int(offsets[0])
    if bool((offsets == shift).all()):
        if shift >= 0:
            total[..., shift:] += result[..., :length - shift]
        else:
            total[..., :length + shift] += result[..., -shift:]
        return total
    total[..., targets[valid]] += result[..., valid]
    return total


def _to_token_order(result, position, columns_only: bool):
    """``result`` (.., [L,] L) over scan positions, in token order: ``out[.., i, j] = result[.., position[i],
    position[j]]`` (columns only with ``columns_only``). The identity, the reversal and a grid's transposition
    (column-major orders, reversed or not) are views or strided copies; any other order is gathered."""
    length = position.numel()
    index = torch.arange(length, device=position.device)
    dims = (-1,) if columns_only else (-2, -1)
    if torch.equal(position, index):
        return result
    if torch.equal(position, index.flip(0)):
        return result.flip(dims)
    for reversed_ in (False, True):
        scan = (length - 1 - position) if reversed_ else position  # scan[token] in the unreversed order
        height = int(scan[1]) if length > 1 else 1  # token 1 = (row 0, column 1) sits at scan position 1 · height
        if height < 1 or length % height:
            continue
        width = length // height
        expected = index.reshape(width, height).t().reshape(-1)  # column-major: token r·W + c at c·H + r
        if not torch.equal(scan, expected):
            continue
        out = result.flip(dims) if reversed_ else result
        if columns_only:
            return out.unflatten(-1, (width, height)).transpose(-1, -2).flatten(-2)
        out = out.unflatten(-1, (width, height)).unflatten(-3, (width, height))  # (.., W, H, W, H)
        return out.transpose(-4, -3).transpose(-2, -1).flatten(-4, -3).flatten(-2)
    out = result[..., position]
    return out if columns_only else out[..., position, :]
