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

def _mask_rows_cols(maps: torch.Tensor, mask: torch.Tensor | None, rows) -> torch.Tensor:
    if mask is None:
        return maps
    row_mask = mask if rows is None else mask[:, rows]
    row_mask = row_mask[:, :, None] * mask[:, None, :]
    return maps * (row_mask if maps.dim() == 3 else row_mask[:, None])


def banded_maps(row_weight, col_weight, conv_weight, rows=None, reduce="mean", input_weight=None):
    """Per-channel maps without the S6 part (the "w/o S6" ablation): H_c = diag(row_c · col_c) · M_c · diag(in_c).

    Only the conv band (K diagonals) is non-zero, so reduced maps are reduced band by band, without a per-channel
    (D, L, L) stack.

    Args:
        row_weight, col_weight: (B, L, D).  conv_weight: (D, K) or None (identity).  input_weight: (B, L, D) or
            None: a weight on the conv's input (LFM2's input gate).
    Returns:
        (B, L, L) reduced or (B, D, L, L) per channel; R rows with ``rows``.
    """
    diag = row_weight * col_weight  # (B, L, D)
    batch, length, channels = diag.shape
    taps = conv_weight.flip(-1) if conv_weight is not None else diag.new_ones(channels, 1)  # taps[c, τ] = w[c, K-1-τ]
    bands = diag[:, :, :, None] * taps  # (B, L, D, K): H_c[i, i - τ]
    if input_weight is not None:
        shifted = torch.zeros_like(bands)
        for tau in range(min(taps.shape[1], length)):
            shifted[:, tau:, :, tau] = input_weight[:, :length - tau]
        bands = bands * shifted
    if reduce is not None:
        bands = reduce_channels(bands.permute(0, 2, 1, 3), reduce)[:, None]  # (B, 1, L, K)
    else:
        bands = bands.permute(0, 2, 1, 3)  # (B, D, L, K)
    maps = diag.new_zeros(*bands.shape[:2], length, length)
    index = torch.arange(length, device=diag.device)
    for tau in range(min(taps.shape[1], length)):
        maps[:, :, index[tau:], index[tau:] - tau] = bands[:, :, tau:, tau]
    if rows is not None:
        maps = maps[:, :, rows]
    return maps if reduce is None else maps[:, 0]


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
        if self.s6:
            def sum_maps(r, c):
                return ssd_maps(self.delta, self.A, self.B, self.C, row_weight=r, col_weight=c, rows=rows,
                                reduce="sum")
        else:
            def sum_maps(r, c):
                return banded_maps(r.flatten(2), c.flatten(2), None, rows, "sum")
        out = post_conv_columns(sum_maps, row, col, values, self.conv_weight, self.delta.shape[1])
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
        col = ones if self.col_weight is None else self.col_weight
        out = post_conv_columns(lambda r, c: self._sum_maps(r, c, None, rows, "sum"), row, col,
                                 self.values.to(torch.float64), self.conv_weight, self.log_decay.shape[1])
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
    the core switched off (α = I, the banded "w/o core" ablation; LFM2's short conv is only this band)."""

    core: _Core | None
    mask: torch.Tensor | None  # (B, L)
    heads: int
    head_dim: int  # P, the value channels of one head
    row_weight: torch.Tensor | None = None  # (B, L, H, P) norm scale · output gate
    col_weight: torch.Tensor | None = None  # (B, L, H, P) activation gain · mask
    conv_weight: torch.Tensor | None = None  # (H, P, K) bias-free causal conv on the values
    input_weight: torch.Tensor | None = None  # (B, L, H, P) a weight before the conv (LFM2's input gate); band only
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
            return banded_maps(flat(row), flat(col), None if conv is None else conv.flatten(0, 1).to(self.out_dtype),
                               rows, reduce, input_weight=None if inputs is None else flat(inputs))
        if inputs is not None:
            raise ValueError("mamba_captum: input_weight (a weight before the conv) is defined for the band only.")
        return head_maps_blocked(core.rows, batch=batch, length=length, heads=self.heads, row_weight=row,
                                 col_weight=col, conv_weight=conv, rows=rows, reduce=reduce, dtype=self.out_dtype,
                                 device=device)

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
