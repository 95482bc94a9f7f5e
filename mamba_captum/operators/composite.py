"""Operators made of operators: parallel mixers summed in one layer (:class:`SumOperator`), operators on disjoint
blocks of channels (:class:`ChannelBlocksOperator`), and a mixer followed by a band with no residual between them
(:class:`ComposedOperator`)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..kernels.bands import apply_band
from .common import operator_output_grad
from .heads import HeadOperator


@dataclass
class SumOperator:
    """Parallel mixers summed in one layer (FalconH1: Mamba-2 ∥ attention), each scaled by its output multiplier.

    Reduced maps add up; with ``reduce=None`` the scaled channels of the parts are concatenated along C.
    """

    CHANNEL_SEPARABLE = True  # each part's channels may be sampled on their own (the run-time map check)

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

    CHANNEL_SEPARABLE = True  # each part's channels may be sampled on their own (the run-time map check)

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
# A mixer followed by a band with no residual between them: Inkling's attention and its post-attention convolution


@dataclass
class ComposedOperator:
    """A token mixer whose (projected) output is mixed again, per channel, by a causal band before it joins the
    residual stream: ``out = T(W(A x))`` (Inkling's ``attn_sconv(o_proj(attention))``).

    ``inner`` is the first operator (A per value channel c, over x), ``W`` the affine part of its readout (o_proj),
    ``outer`` the band operator T (one channel per hidden channel d, no core). T's taps differ per hidden channel, so
    T does not commute with W: the composition is a sum over paths d ← c, each with the token operator
    ``H_{d,c} = T_d · A_c`` and the scalar weight ``W[d, c]`` (channel mixing, which no map includes, as every
    out_proj): ``y_d = Σ_c W[d, c] · H_{d,c} x_c``.

    Maps are over the D·C paths: ``reduce=None`` gives them all, (B, D·C, L, L) with d major; the path mean is
    exactly ``mean_d T_d · mean_c A_c`` and the sum ``Σ_d T_d · Σ_c A_c`` (products of the parts' reduced maps);
    "abs_mean" takes |·| of every path. The band reaches K − 1 tokens back, so R query rows need at most R·K rows
    of the inner maps. ``contributions`` is the exact gradient × operator × input over the paths, K calls of the
    inner one. ``output`` is ``T W A x`` (B, L, D); ``readout`` adds what comes from no real token.
    """

    inner: object
    outer: HeadOperator
    output: torch.Tensor
    readout: Callable | None = field(default=None, repr=False)

    @classmethod
    def of(cls, inner, outer: HeadOperator) -> "ComposedOperator":
        """Compose ``inner`` (whose readout is affine and gives the band's input) with the band ``outer`` (whose
        ``readout(output)`` is the layer's real output, rebuilt)."""
        dtype = torch.float64
        inner_output = inner.output.detach().to(dtype)
        offset = inner.readout(torch.zeros_like(inner_output))
        projected = inner.readout(inner_output) - offset  # W (A x): the band's input from the real tokens
        bands = outer.band().to(dtype)  # (B, L, D, K)
        output = apply_band(bands, projected)
        constant = outer.readout(outer.output.detach().to(dtype)).reshape(output.shape) - output
        return cls(inner, outer, output, readout=lambda out: out + constant.to(out.dtype))

    def to(self, dtype: torch.dtype):
        return replace(self, inner=self.inner.to(dtype), outer=self.outer.to(dtype),
                       output=self.output.detach().to(dtype))

    @property
    def mask(self):
        return self.outer.mask

    @property
    def values(self):
        return self.inner.values

    @property
    def channels(self) -> int:
        return self.outer.channels * self.inner.channels

    @property
    def value_channels(self) -> int:
        return self.inner.value_channels

    def _rows(self, rows):
        length = self.output.shape[1]
        return torch.arange(length, device=self.output.device) if rows is None \
            else torch.as_tensor(rows, dtype=torch.long, device=self.output.device)

    def _needed(self, query):
        """The inner rows the band reads for these query rows: i − τ for τ < K, from token 0 on (sorted)."""
        width = 1 if self.outer.conv_weight is None else self.outer.conv_weight.shape[-1]
        needed = (query[:, None] - torch.arange(width, device=query.device)).flatten()
        return torch.unique(needed[needed >= 0], sorted=True)

    def maps(self, reduce="mean", rows=None):
        query = self._rows(rows)
        needed = self._needed(query)
        outer = self.outer.maps(reduce if reduce != "abs_mean" else None, query)[..., needed]  # (B, [D,] R, R')
        inner = self.inner.maps(reduce if reduce != "abs_mean" else None, needed)  # (B, [C,] R', L)
        dtype = torch.promote_types(outer.dtype, inner.dtype)
        outer, inner = outer.to(dtype), inner.to(dtype)
        if reduce in ("mean", "sum"):
            out = outer @ inner
        elif reduce is None:
            out = torch.einsum("bdrn,bcnl->bdcrl", outer, inner).flatten(1, 2)
        else:  # mean over the paths of |T_d A_c|, a few hidden channels at a time
            out = 0
            step = max(1, (1 << 22) // max(1, inner[0].numel()))
            for first in range(0, outer.shape[1], step):
                block = torch.einsum("bdrn,bcnl->bdcrl", outer[:, first:first + step], inner)
                out = out + block.abs().sum((1, 2))
            out = out / (outer.shape[1] * inner.shape[1])
        return out

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_{d,c} g_d[i] · W[d, c] · H_{d,c}[i, j] · x_c[j]: (B, L, L) or (B, R, L); grad (B, L, D) with respect to
        :attr:`output`. Rows sum to Σ_d g_d[i] · y_d[i]."""
        query = self._rows(rows)
        dtype = torch.float64
        grad = grad.to(dtype).reshape(self.output.shape)
        bands = self.outer.band().to(dtype)  # (B, L, D, K): out[i, d] reads z[i − τ, d] with bands[.., τ]
        batch, length = grad.shape[:2]
        total = torch.zeros(batch, len(query), length, dtype=dtype, device=grad.device)
        for tau in range(min(bands.shape[-1], length)):
            valid = query >= tau
            if not bool(valid.any()):
                continue
            shifted = torch.zeros_like(grad)  # the band input's row r = i − τ, weighted by out row i = r + τ
            shifted[:, :length - tau] = grad[:, tau:] * bands[:, tau:, :, tau]
            inner_grad = operator_output_grad(self.inner, shifted)
            part = self.inner.contributions(inner_grad, query[valid] - tau)
            total[:, valid] += part.to(dtype)
        return total.to(self.outer.out_dtype)
