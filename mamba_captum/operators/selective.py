"""The operators of selective state-space layers: Mamba-1's S6 (:class:`SelectiveOperator`), Vim's bidirectional
pair of them (:class:`BidirectionalOperator`) and Mamba-2's SSD (:class:`SSDOperator`), through
:mod:`mamba_captum.kernels.selective` and :mod:`mamba_captum.kernels.ssd`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..kernels.bands import banded_maps
from ..kernels.selective import selective_maps
from ..kernels.ssd import ssd_maps
from ..kernels.taps import post_conv_columns
from .common import CastMixin, mask_rows_cols


@dataclass
class SelectiveOperator(CastMixin):
    """Mamba-1 layout: H_c = diag(row_c) · α_c · diag(col_c) · M_c, α the S6 kernel (hidden: row = col = 1, M = I)."""

    # field -> its channel axis: the operator of a subset of channels keeps these fields' entries of those channels
    # (the run-time map check's sample, mamba_captum.verification)
    CHANNEL_FIELDS = {"delta": -1, "A": 0, "row_weight": -1, "col_weight": -1, "conv_weight": 0, "conv_bias": 0,
                      "values": -1, "output": -1}

    delta: torch.Tensor  # (B, L, D)
    A: torch.Tensor  # (D, N)
    B: torch.Tensor  # (B, L, N)
    C: torch.Tensor  # (B, L, N)
    mask: torch.Tensor | None  # (B, L)
    row_weight: torch.Tensor | None = None  # (B, L, D) gate silu(z)
    col_weight: torch.Tensor | None = None  # (B, L, D) activation gain σ(conv pre-activation) · mask
    conv_weight: torch.Tensor | None = None  # (D, K) bias-free causal conv taps
    conv_bias: torch.Tensor | None = None  # (D,) the conv's bias: its share of ``output`` comes from no token
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
        return mask_rows_cols(out, self.mask, rows)

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
        return mask_rows_cols(out, self.mask, rows)


@dataclass
class BidirectionalOperator:
    """A causal operator and one run over the reversed sequence (Vim's bimamba v2 mixer), summed:
    ``H = H_fwd + J H_bwd J`` with J the token reversal. Non-causal: H_fwd fills the lower triangle, J H_bwd J the
    upper one, both the diagonal.

    ``backward`` holds its tensors in reversed token order (it is the causal operator of the reversed sequence);
    every result is returned in the sequence's order. The operator's output stacks the two directions' outputs in
    the sequence's order, (B, L, 2, D), and ``readout`` maps that stack (float64) to the mixer output.
    """

    CHANNEL_SEPARABLE = True  # each direction's channels may be sampled on their own (the run-time map check)

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
class SSDOperator(CastMixin):
    """Mamba-2 layout: per channel (h, p) H = diag(row) · α_h · diag(col) · M; per head α_h when all weights are None."""

    # field -> its head axis (a subset of heads; with one group of B, C only: heads map to groups)
    CHANNEL_FIELDS = {"delta": -1, "A": 0, "row_weight": 2, "col_weight": 2, "conv_weight": 0, "conv_bias": 0,
                      "values": 2, "output": 2}

    delta: torch.Tensor  # (B, L, H)
    A: torch.Tensor  # (H,)
    B: torch.Tensor  # (B, L, G, N)
    C: torch.Tensor  # (B, L, G, N)
    mask: torch.Tensor | None
    row_weight: torch.Tensor | None = None  # (B, L, H, P) norm scale ν · gate silu(z)
    col_weight: torch.Tensor | None = None  # (B, L, H, P) activation gain · mask
    conv_weight: torch.Tensor | None = None  # (H, P, K)
    conv_bias: torch.Tensor | None = None  # (H, P) the conv's bias: its share of ``output`` comes from no token
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
        return mask_rows_cols(out, self.mask, rows)

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
        return mask_rows_cols(out, self.mask, rows)
