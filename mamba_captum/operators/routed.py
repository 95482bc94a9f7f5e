"""Routed operators: a layer whose tokens are routed to several memories, each memory a core run over the sub-sequence
of the tokens routed to it (flash-linear-attention's MoM, ``mamba_captum.families.fla_mom``).

A part is (positions (B, n) long, a :class:`~mamba_captum.operators.HeadOperator` over n slots): slot i of row b holds
token positions[b, i] (−1: an empty slot). The layer's maps are the per-channel sums over the parts in token
coordinates, H_c = Σ_m H^m_c; "abs_mean" is the mean of |Σ_m H^m_c| (not Σ_m of each part's |H^m_c|).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..kernels.reductions import reduce_channels
from .common import mask_rows_cols
from .heads import DeltaRuleCore


@dataclass
class RoutedCore:
    """A per-head core whose rows are scaled per token: ``rows(b, r) = weight[b, r] · inner.rows(b, r)`` (H, R, n),
    the routing weight of each token of a memory's sub-sequence. inner: a :class:`DeltaRuleCore` over the
    sub-sequence; weight (B, n)."""

    inner: DeltaRuleCore
    weight: torch.Tensor

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        alpha = self.inner.rows(b, rows)
        return alpha * self.weight[b, rows].to(alpha.dtype)[None, :, None]

    def to(self, dtype: torch.dtype):
        return RoutedCore(self.inner.to(dtype), self.weight.detach().to(dtype))


def _scatter_rows(out, part_maps, positions, targets, sub_rows):
    """Add a part's maps (B, [C,] R', n) over its sub-sequence into ``out`` (B, [C,] R, L) at token coordinates:
    column j to token ``positions[b, j]`` (−1: a pad slot, dropped), row r' (sub-sequence row ``sub_rows[r']``) to
    out row ``targets[b, sub_rows[r']]`` (−1: not asked for). A token appears once per part: no index repeats."""
    for b in range(out.shape[0]):
        target = targets[b, sub_rows]
        kept_rows = (target >= 0).nonzero().flatten()
        kept_cols = (positions[b] >= 0).nonzero().flatten()
        if not len(kept_rows) or not len(kept_cols):
            continue
        block = part_maps[b][..., kept_rows[:, None], kept_cols[None, :]]
        out[b][..., target[kept_rows][:, None], positions[b, kept_cols][None, :]] += block.to(out.dtype)


@dataclass
class RoutedMemoriesOperator:
    """A sum of per-memory operators over one layer's tokens (fla's MoM): ``parts`` [(positions (B, n) long, a
    :class:`HeadOperator` over that memory's sub-sequences of n slots)], positions[b, i] the token of slot i in row
    b (−1: an empty slot). Each part acts on its own values; the maps are the per-channel sums over the parts in token
    coordinates (module docstring). ``output`` (B, L, H, P) is Σ of the parts' outputs, scattered; ``readout`` maps it
    (float64) to the mixer output."""

    parts: list
    mask: torch.Tensor | None  # (B, L)
    heads: int
    head_dim: int
    output: torch.Tensor
    readout: Callable | None = field(default=None, repr=False)
    out_dtype: torch.dtype = torch.float64

    def to(self, dtype: torch.dtype):
        """The same operator giving ``dtype`` maps, detached."""
        mask = None if self.mask is None else self.mask.detach().to(dtype)
        return replace(self, parts=[(positions, op.to(dtype)) for positions, op in self.parts], mask=mask,
                       output=self.output.detach().to(dtype), out_dtype=dtype)

    @property
    def channels(self) -> int:
        return self.parts[0][1].channels

    @property
    def value_channels(self) -> int:
        return self.heads * self.head_dim

    def _rows(self, rows):
        length, device = self.output.shape[1], self.output.device
        return torch.arange(length, device=device) if rows is None \
            else torch.as_tensor(rows, dtype=torch.long, device=device).reshape(-1)

    def _targets(self, rows, positions):
        """(B, n) the out row of each slot (−1: its token is not among ``rows``, or an empty slot) and the slots any
        row needs, sorted."""
        length = self.output.shape[1]
        row_of_token = torch.full((length + 1,), -1, dtype=torch.long, device=positions.device)
        row_of_token[rows] = torch.arange(len(rows), device=positions.device)
        targets = row_of_token[positions]  # an empty slot (−1) reads the last entry: −1
        return targets, (targets >= 0).any(0).nonzero().flatten()

    def _summed(self, reduce, rows):
        """Σ over the parts of their maps (``reduce`` "mean", "sum" or None), (B, [C,] R, L) in token coordinates."""
        batch, length = self.output.shape[:2]
        out = None
        for positions, op in self.parts:
            targets, sub_rows = self._targets(rows, positions)
            if not len(sub_rows):
                continue
            part_maps = op.maps(reduce, sub_rows)
            if out is None:
                out = part_maps.new_zeros(*part_maps.shape[:-2], len(rows), length)
            _scatter_rows(out, part_maps, positions, targets, sub_rows)
        if out is None:
            shape = (batch, len(rows), length) if reduce is not None else (batch, self.channels, len(rows), length)
            out = torch.zeros(shape, dtype=self.out_dtype, device=self.output.device)
        return out

    def maps(self, reduce="mean", rows=None):
        """(B, R, L) for a reduction, (B, C, R, L) per channel, of H_c = Σ_m H^m_c; rows None: all L."""
        query = self._rows(rows)
        if reduce != "abs_mean":
            out = self._summed(reduce, query)
        else:  # |Σ_m H^m_c| needs the per-channel sums: a block of rows at a time
            step = max(1, (1 << 24) // max(1, self.channels * self.output.shape[1] * self.output.shape[0]))
            out = torch.cat([reduce_channels(self._summed(None, query[first:first + step]), "abs_mean")
                             for first in range(0, len(query), step)], dim=1)
        return mask_rows_cols(out, self.mask, None if rows is None else query)

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_m Σ_c grad_c[i] · H^m_c[i, j] · x^m_c[j], (B, L, L) or (B, R, L); grad (B, L, H, P) with respect to
        :attr:`output`. Rows sum to Σ_c grad_c[i] · output_c[i]."""
        query = self._rows(rows)
        batch, length = self.output.shape[:2]
        out = torch.zeros(batch, len(query), length, dtype=self.out_dtype, device=self.output.device)
        for positions, op in self.parts:
            targets, sub_rows = self._targets(query, positions)
            if not len(sub_rows):
                continue
            part_grad = gather_slots(grad.to(self.out_dtype), positions)
            _scatter_rows(out, op.contributions(part_grad, sub_rows), positions, targets, sub_rows)
        return mask_rows_cols(out, self.mask, None if rows is None else query)

    def part_maps(self):
        """Per part, its per-channel maps in token coordinates (B, C, L, L) and its values (B, L, C') scattered to
        token positions (zero where the memory's tokens are not): Σ over the parts of H_p x_p is ``output``."""
        length = self.output.shape[1]
        everything = torch.arange(length, device=self.output.device)
        result = []
        for positions, op in self.parts:
            targets, sub_rows = self._targets(everything, positions)
            per_channel = op.maps(None, sub_rows)
            out = per_channel.new_zeros(*per_channel.shape[:-2], length, length)
            _scatter_rows(out, per_channel, positions, targets, sub_rows)
            values = scatter_slots(op.values.flatten(2).to(self.out_dtype), positions, length)
            result.append((out, values))
        return result


def gather_slots(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """t (B, L, ...) at the slots' tokens positions (B, n): (B, n, ...), zero at empty slots (−1)."""
    index = positions.clamp(min=0).reshape(*positions.shape, *([1] * (t.dim() - 2)))
    picked = torch.gather(t, 1, index.expand(*positions.shape, *t.shape[2:]))
    keep = (positions >= 0).reshape(index.shape).to(picked.dtype)
    return picked * keep


def scatter_slots(t: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    """t (B, n, ...) over slots placed at their tokens: (B, L, ...), zero where no slot is (empty slots dropped)."""
    out = t.new_zeros(t.shape[0], length, *t.shape[2:])
    for b in range(t.shape[0]):
        kept = (positions[b] >= 0).nonzero().flatten()
        out[b, positions[b, kept]] = t[b, kept]
    return out
