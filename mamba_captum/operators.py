"""The operator of one layer -> its implicit-attention maps.

Each operator holds the data-controlled pieces of one token mixer (Δ, A, B, C, gate, activation gain, conv taps,
norm scale, or softmax probabilities) rebuilt by a family adapter, and turns them into maps through
:mod:`mamba_captum.kernels`. Shapes: B batch, L tokens, D channels, N state size, H heads, P head dim, K conv taps.

``maps(reduce, rows)`` returns (B, L, L) for a reduced map, (B, C, L, L) with ``reduce=None``; with ``rows`` the
L query rows become R. Rows and columns of padding tokens are zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from .kernels.reductions import REDUCTIONS, reduce_channels  # noqa: F401 (REDUCTIONS re-exported)
from .kernels.selective import selective_maps
from .kernels.ssd import ssd_maps

def _mask_rows_cols(maps: torch.Tensor, mask: torch.Tensor | None, rows) -> torch.Tensor:
    if mask is None:
        return maps
    row_mask = mask if rows is None else mask[:, rows]
    row_mask = row_mask[:, :, None] * mask[:, None, :]
    return maps * (row_mask if maps.dim() == 3 else row_mask[:, None])


def banded_maps(row_weight, col_weight, conv_weight, rows=None, reduce="mean"):
    """Per-channel maps without the S6 part (the "w/o S6" ablation): H_c = diag(row_c · col_c) · M_c.

    Only the conv band (K diagonals) is non-zero, so reduced maps are reduced band by band, without a per-channel
    (D, L, L) stack.

    Args:
        row_weight, col_weight: (B, L, D).  conv_weight: (D, K) or None (identity).
    Returns:
        (B, L, L) reduced or (B, D, L, L) per channel; R rows with ``rows``.
    """
    diag = row_weight * col_weight  # (B, L, D)
    batch, length, channels = diag.shape
    taps = conv_weight.flip(-1) if conv_weight is not None else diag.new_ones(channels, 1)  # taps[c, τ] = w[c, K-1-τ]
    bands = diag[:, :, :, None] * taps  # (B, L, D, K): H_c[i, i - τ]
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


class _CastMixin:
    def to(self, dtype: torch.dtype):
        """The same operator with every floating tensor cast to ``dtype`` (maps are computed in that dtype)."""
        changes = {f.name: getattr(self, f.name).to(dtype) for f in fields(self)
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

    @property
    def channels(self) -> int:
        return self.delta.shape[-1]

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

    @property
    def per_channel(self) -> bool:
        return any(w is not None for w in (self.row_weight, self.col_weight, self.conv_weight))

    @property
    def channels(self) -> int:
        heads = self.delta.shape[-1]
        return heads * self.head_dim if self.per_channel else heads

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
class SoftmaxOperator(_CastMixin):
    """A softmax attention layer: probabilities (B, H, L, L) over the values; reduced over heads."""

    probs: torch.Tensor
    mask: torch.Tensor | None

    @property
    def channels(self) -> int:
        return self.probs.shape[1]

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

    def maps(self, reduce="mean", rows=None):
        outs = [scale * op.maps(reduce, rows) for scale, op in self.parts]
        return torch.cat(outs, dim=1) if reduce is None else sum(outs)
