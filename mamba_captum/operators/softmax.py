"""The operator of a softmax attention layer: its probabilities, reduced over heads."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..kernels.reductions import reduce_channels
from .common import CastMixin, mask_rows_cols


@dataclass
class SoftmaxOperator(CastMixin):
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
        return mask_rows_cols(out, self.mask, rows)

    def maps(self, reduce="mean", rows=None):
        probs = self.probs if rows is None else self.probs[:, :, rows]
        return mask_rows_cols(reduce_channels(probs, reduce), self.mask, rows)
