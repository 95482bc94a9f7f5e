"""The operator of diagonal-decay recurrences (RWKV-4 WKV, Griffin RG-LRU), through
:mod:`mamba_captum.kernels.decay`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from ..kernels.bands import banded_maps
from ..kernels.decay import decay_maps
from ..kernels.taps import post_conv_columns
from .common import mask_rows_cols


@dataclass
class DecayOperator:
    """Diagonal-decay recurrences (RWKV-4 WKV, Griffin RG-LRU): H_c = diag(row_c) · α_c · diag(col_c) · M_c with
    ``α_c[i, j] = exp(log_q_i + log_k_j − Σ_{k=j+1..i} log_decay_k)`` below the diagonal, ``exp(log_diag_i)`` on it,
    zero across ``segments`` (state resets); see :mod:`mamba_captum.kernels.decay`.

    The log-space pieces stay float64 whatever the maps' dtype (``out_dtype``): RWKV's keys and normalisers are
    large numbers whose float32 rounding alone would move α by ~1e-6.
    """

    # field -> its channel axis (a subset of channels: the run-time map check's sample)
    CHANNEL_FIELDS = {"log_decay": -1, "log_q": -1, "log_k": -1, "log_diag": -1, "row_weight": -1, "col_weight": -1,
                      "conv_weight": 0, "conv_bias": 0, "values": -1, "output": -1}

    log_decay: torch.Tensor  # (B, L, C) ≥ 0
    log_q: torch.Tensor | None
    log_k: torch.Tensor | None
    log_diag: torch.Tensor | None
    segments: torch.Tensor | None  # (B, L) integer ids: α is 0 across a reset
    mask: torch.Tensor | None  # (B, L)
    row_weight: torch.Tensor | None = None  # (B, L, C) RWKV: σ(receptance); Griffin: gelu(linear_y h)
    col_weight: torch.Tensor | None = None  # (B, L, C) Griffin: √(1 − a²) · input gate
    conv_weight: torch.Tensor | None = None  # (C, K) bias-free causal conv (Griffin unified)
    conv_bias: torch.Tensor | None = None  # (C,) the conv's bias: its share of ``output`` comes from no token
    s6: bool = True  # False: the recurrence switched off (H = diag(row) · M, the "w/o S6" ablation)
    values: torch.Tensor | None = None  # (B, L, C) what H acts on
    output: torch.Tensor | None = None  # (B, L, C) H x
    readout: Callable | None = field(default=None, repr=False)  # output (float64) -> mixer output
    out_dtype: torch.dtype = torch.float64
    decay_source: str | None = None  # the parameter that sets log_decay (named when the maps are refused)

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
        return mask_rows_cols(out, self.mask, rows).to(self.out_dtype)

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
        return mask_rows_cols(out, self.mask, rows).to(self.out_dtype)
