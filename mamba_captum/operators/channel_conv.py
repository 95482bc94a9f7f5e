"""Full (channel-mixing) 2-D convolutions as a token operator over an image grid (:class:`ChannelConvOperator`): a
conv, a per-token per-channel gate, and optionally a second conv — the branch of a residual conv block such as
MambaVision's ``conv2(act(norm(conv1(x))))`` with the activation's gain and the norms' scales fixed at their real
values.

Over the grid's L tokens (row-major) and C_in input channels, a 'same' zero-padded k × k conv with taps
``W[:, :, a, b]`` is ``Σ_τ S_τ ⊗ W_τ``, S_τ the shift of tap τ; the operator is
``H = (Σ_τ S_τ ⊗ W2_τ) · diag(g) · (Σ_τ S_τ ⊗ W1_τ)``: for each token pair (i, j) a C_out × C_in block H[i, j],
non-zero only for |i − j| ≤ r on both grid axes (r = k1 // 2 + k2 // 2: a 5 × 5 neighbourhood for two 3 × 3 convs).

- contributions (gradient × operator × input, what the gradient methods use) are exact:
  ``Σ_o Σ_c grad_o[i] · H[i, j]_{o,c} · x_c[j]``;
- maps are per output channel o the sum over input channels of the block, ``m_o[i, j] = Σ_c H[i, j]_{o,c}`` (the
  response at i, channel o, to ones on every channel of token j); for a per-channel (diagonal) operator this is
  H_o itself. ``reduce``: "mean" / "sum" over o, "abs_mean" the mean over o of |m_o|, None every m_o.

Both come from (2r + 1)² applications of H (the operator is linear and reaches r tokens): each injects the input at
the tokens of one lattice of period 2r + 1 on both axes, whose responses do not overlap, so every output token reads
exactly one source of that lattice.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F


@dataclass
class ChannelConvOperator:
    """``H = conv(second) · diag(gate) · conv(first)`` over the tokens of a (rows × cols) grid (module docstring).

    ``first`` (C_mid, C_in, k1, k1) and ``second`` (C_out, C_mid, k2, k2) or None (the first conv alone): bias-free
    'same' zero-padded stride-1 taps (any per-channel scale folded in). ``gate`` (B, C_mid, rows, cols) or None.
    ``values`` (B, L, C_in): what H acts on, token order; ``output`` (B, L, C_out) = H x; ``readout`` maps it
    (float64) to the block's output (biases, shifts, the residual).
    """

    first: torch.Tensor
    gate: torch.Tensor | None
    second: torch.Tensor | None
    values: torch.Tensor
    rows: int
    cols: int
    output: torch.Tensor | None = None
    readout: Callable | None = field(default=None, repr=False)

    def to(self, dtype: torch.dtype):
        cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        return replace(self, first=cast(self.first), gate=cast(self.gate), second=cast(self.second),
                       values=cast(self.values), output=cast(self.output))

    @property
    def mask(self):
        return None

    @property
    def channels(self) -> int:
        return (self.first if self.second is None else self.second).shape[0]

    @property
    def value_channels(self) -> int:
        return self.first.shape[1]

    @property
    def length(self) -> int:
        return self.rows * self.cols

    @property
    def reach(self) -> int:
        """r: how many tokens away (on each axis) a token's output reads."""
        return self.first.shape[-1] // 2 + (0 if self.second is None else self.second.shape[-1] // 2)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """H on a channel-first grid: (B, C_in, rows, cols) -> (B, C_out, rows, cols)."""
        out = F.conv2d(x, self.first.to(x.dtype), padding=self.first.shape[-1] // 2)
        if self.gate is not None:
            out = out * self.gate.to(x.dtype)
        if self.second is not None:
            out = F.conv2d(out, self.second.to(x.dtype), padding=self.second.shape[-1] // 2)
        return out

    def _lattices(self, grid_rows: torch.Tensor):
        """Per lattice (offset a, b of period p = 2r + 1): its source mask (rows, cols) and, for the query tokens
        ``grid_rows`` (R,), the source each reads (R,) long (−1: none inside the grid)."""
        reach, device = self.reach, self.values.device
        period = 2 * reach + 1
        r, c = grid_rows // self.cols, grid_rows % self.cols
        grid_r = torch.arange(self.rows, device=device)[:, None]
        grid_c = torch.arange(self.cols, device=device)[None, :]
        for a in range(period):
            for b in range(period):
                sources = ((grid_r % period) == a) & ((grid_c % period) == b)
                source_r = r + (a - r + reach) % period - reach  # the lattice row within ±reach of r
                source_c = c + (b - c + reach) % period - reach
                inside = (source_r >= 0) & (source_r < self.rows) & (source_c >= 0) & (source_c < self.cols)
                yield sources, torch.where(inside, source_r * self.cols + source_c, -1)

    def _grid(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L, C) -> (B, C, rows, cols)."""
        return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[-1], self.rows, self.cols)

    def _assemble(self, per_lattice: Callable, rows, mid: tuple) -> torch.Tensor:
        """(B, *mid, R, L): entry (i, source of i) of each lattice from ``per_lattice(sources)`` (B, *mid, L)."""
        device = self.values.device
        grid_rows = torch.arange(self.length, device=device) if rows is None \
            else torch.as_tensor(rows, dtype=torch.long, device=device)
        batch = self.values.shape[0]
        out = None
        picked = torch.arange(grid_rows.numel(), device=device)
        for sources, reads in self._lattices(grid_rows):
            response = per_lattice(sources)[..., grid_rows]  # (B, *mid, R)
            if out is None:
                out = response.new_zeros(batch, *mid, grid_rows.numel(), self.length)
            valid = reads >= 0
            out[..., picked[valid], reads[valid]] += response[..., valid]
        return out

    def maps(self, reduce="mean", rows=None):
        """(B, R, L), or (B, C_out, R, L) for ``reduce=None``: m_o[i, j] = Σ_c H[i, j]_{o,c} reduced over o."""
        dtype = self.values.dtype
        batch = self.values.shape[0]

        def per_lattice(sources):
            ones = sources.to(dtype).expand(batch, self.value_channels, self.rows, self.cols)
            response = self.apply(ones).flatten(2)  # (B, C_out, L)
            if reduce is None:
                return response
            if reduce == "abs_mean":
                return response.abs().mean(1)
            if reduce == "sum":
                return response.sum(1)
            if reduce == "mean":
                return response.mean(1)
            raise ValueError(f"mamba_captum: unknown reduction {reduce!r}.")

        return self._assemble(per_lattice, rows, (self.channels,) if reduce is None else ())

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_o Σ_c grad_o[i] · H[i, j]_{o,c} · x_c[j]: (B, L, L) or (B, R, L). grad: (B, L, C_out), token order."""
        values = self._grid(self.values)
        grad = grad.to(values.dtype)

        def per_lattice(sources):
            response = self.apply(values * sources.to(values.dtype)).flatten(2)  # (B, C_out, L)
            return (response.transpose(1, 2) * grad).sum(-1)  # (B, L)

        return self._assemble(per_lattice, rows, ())
