"""One core per head, weighted per channel (:class:`HeadOperator`, through :mod:`mamba_captum.kernels.heads`), and
its cores: the delta rule and KDA, decayed linear attention (lightning attention, mLSTM; GLA-style per-channel decays:
:class:`GatedLinearCore`), the DPLR rule, softmax probabilities with convolved values, and one core per channel of a
gated single-head core beside a causal band (:class:`ParallelBandCore`, Rodimus). Without a core it is a band (LFM2's
short conv, LFM3-VL's vision conv)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch

from ..kernels.bands import band_entries, banded_maps
from ..kernels.delta_rule import delta_rule_alpha
from ..kernels.dplr.chunked import dplr_alpha_rows
from ..kernels.gated_linear import gated_linear_alpha_rows
from ..kernels.gated_scores import gated_scores_alpha_rows
from ..kernels.heads import head_maps_blocked
from ..kernels.taps import post_conv_columns
from .common import mask_rows_cols


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
class DeltaProductCore(DeltaRuleCore):
    """The gated delta product (fla's GatedDeltaProduct): the (gated) delta rule over L·n sub-steps, n = ``substeps``
    per token, read at each token's last sub-step. q, k (B, L·n, H, K), beta (B, L·n, H), log_decay (B, L·n, H[, K])
    laid out over the sub-steps (q zero but on the last sub-steps). One core per sub-step j and head h,
    α_(j,h)[t, s] = α_h[t·n + n − 1, s·n + j] (the weight of the value written at sub-step j of token s in token t's
    output): rows (n·H, R, L), core j·H + h."""

    substeps: int = 1

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        n = self.substeps
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.q.device)
        picked = super().rows(b, rows * n + n - 1)  # (H, R, L·n)
        heads, count = picked.shape[:2]
        return picked.reshape(heads, count, -1, n).permute(3, 0, 1, 2).reshape(n * heads, count, -1)

    def full(self) -> torch.Tensor:
        """The whole core, (B, n·H, L, L)."""
        batch, length = self.q.shape[0], self.q.shape[1] // self.substeps
        rows = torch.arange(length, device=self.q.device)
        return torch.stack([self.rows(b, rows) for b in range(batch)])


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
class GatedLinearCore(_Core):
    """Linear attention with data-controlled decays (GLA, HGRN-2, simple GLA, RetNet; RWKV-6 with its ``bonus``),
    :mod:`kernels.gated_linear`: α_h[t, s] = scale · Σ_k q_t,k k_s,k exp(Γ_t,k − Γ_s,k) for s ≤ t (RWKV-6: decays to
    t − 1 and the bonus u on the diagonal). q, k (B, L, H, K); log_decay (B, L, H, K) per key channel, (B, L, H) per
    head, or None; bonus (H, K) or None."""

    q: torch.Tensor
    k: torch.Tensor
    log_decay: torch.Tensor | None
    scale: float
    bonus: torch.Tensor | None = None
    CAST = ("q", "k", "bonus")  # the log decays stay float64: their cumsums feed exponentials

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        decay = None if self.log_decay is None else self.log_decay[b]
        return gated_linear_alpha_rows(self.q[b], self.k[b], decay, rows, scale=self.scale, bonus=self.bonus)


@dataclass
class DPLRCore(_Core):
    """The generalized delta rule with a diagonal-plus-low-rank transition (RWKV-7), :mod:`kernels.dplr`:
    α_h[t, s] = scale · q_tᵀ (D_t + b_t a_tᵀ) ⋯ (D_{s+1} + b_{s+1} a_{s+1}ᵀ) k_s for s ≤ t, D_t = diag(exp(g_t)) with
    g = log_decay, plus ``diagonal`` (B, L, H) on α_h[t, t] (RWKV-7's bonus of the current token) when given. q, k,
    a, b (B, L, H, K) as the kernel uses them (a reads the state, b writes it); log_decay (B, L, H, K) float64.

    ``channel_scale`` (B, L, H, P): one core per value channel c = (h, p) instead, α_c[t, s] = channel_scale_c[t] ·
    α_h[t, s] + δ_ts · diagonal_h[t], rows (H·P, R, L), for a :class:`HeadOperator` of H·P heads of one channel:
    a per-channel factor between the recurrence and the bonus (RWKV-7's group-norm weight) cannot be a row weight of
    a per-head core."""

    q: torch.Tensor
    k: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    log_decay: torch.Tensor
    scale: float = 1.0
    diagonal: torch.Tensor | None = None
    channel_scale: torch.Tensor | None = None
    CAST = ("q", "k", "a", "b", "diagonal", "channel_scale")  # the log decays stay float64

    def rows(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.q.device)
        alpha = dplr_alpha_rows(self.q[index], self.k[index], self.a[index], self.b[index], self.log_decay[index],
                                rows, scale=self.scale)  # (H, R, L)
        if self.channel_scale is not None:
            factor = self.channel_scale[index, rows].to(alpha.dtype).permute(1, 2, 0)  # (H, P, R)
            alpha = (factor[..., None] * alpha[:, None]).flatten(0, 1)  # (H·P, R, L)
        if self.diagonal is not None:
            heads = self.diagonal.shape[-1]
            bonus = self.diagonal[index, rows].to(alpha.dtype).T  # (H, R)
            bonus = bonus.repeat_interleave(alpha.shape[0] // heads, dim=0)  # per channel: its head's
            alpha[:, torch.arange(len(rows), device=alpha.device), rows] += bonus  # (alpha: a fresh tensor)
        return alpha


@dataclass
class DenseCore(_Core):
    """A core given whole: softmax probabilities (B, H, L, L)."""

    probs: torch.Tensor
    CAST = ("probs",)

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        return self.probs[b][:, rows]


@dataclass
class ParallelBandCore(_Core):
    """One core per value channel (C "heads" of one channel): ``α · diag(σ(i_c)) + band_c``, a single-head gated
    linear core weighted per channel by the input gate, plus a causal band beside it (Rodimus' SiLU-conv path).

    alpha: the single-head core (:class:`GatedLinearCore`, H = 1), or None for α = I (the core switched off).
    input_gate: (B, L, C) the column weight of the core's path. band: (B, L, C, T) the band's entries
    ``band[b, i, c, τ] = band_c[i, i − τ]`` (:func:`band_entries`), or None.
    """

    alpha: GatedLinearCore | None
    input_gate: torch.Tensor
    band: torch.Tensor | None
    CAST = ("input_gate", "band")

    def to(self, dtype: torch.dtype):
        cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        return replace(self, alpha=None if self.alpha is None else self.alpha.to(dtype),
                       input_gate=cast(self.input_gate), band=cast(self.band))

    def full(self) -> torch.Tensor:
        """The whole core, (B, C, L, L)."""
        batch, length = self.input_gate.shape[:2]
        rows = torch.arange(length, device=self.input_gate.device)
        return torch.stack([self.rows(b, rows) for b in range(batch)])

    def rows(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        """(C, R, L): rows ``rows`` of every channel's core of batch element b."""
        gate = self.input_gate[b].T  # (C, L)
        rows = torch.as_tensor(rows, device=gate.device)
        picked = torch.arange(len(rows), device=gate.device)
        if self.alpha is None:
            out = gate.new_zeros(gate.shape[0], len(rows), gate.shape[1])
            out[:, picked, rows] = gate[:, rows]
        else:
            out = self.alpha.rows(b, rows).to(gate.dtype) * gate[:, None, :]  # (1, R, L) · (C, 1, L)
        if self.band is not None:
            for tau in range(self.band.shape[-1]):
                reach = rows >= tau
                out[:, picked[reach], rows[reach] - tau] += self.band[b, rows[reach], :, tau].T.to(out.dtype)
        return out


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
        return mask_rows_cols(out, self.mask, rows)

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c grad_c[i] · H_c[i, j] · values_c[j]: (B, L, L) or (B, R, L). grad: (B, L, H, P)."""
        values = self.values.to(self.out_dtype)
        ones = torch.ones_like(values)
        row = grad.to(self.out_dtype) * (ones if self.row_weight is None else self.row_weight)
        col = ones if self.col_weight is None else self.col_weight
        if self._active_core is None:  # the band takes the values as its input weight: one call
            inputs = values if self.input_weight is None else values * self.input_weight
            out = self._maps(row, col, self.conv_weight, rows, "sum", inputs)
            return mask_rows_cols(out, self.mask, rows)
        out = post_conv_columns(lambda r, c: self._maps(r, c, None, rows, "sum"), row, col, values,
                                self.conv_weight, values.shape[1])
        return mask_rows_cols(out, self.mask, rows)
