"""Reference Mamba-2 (SSD) implicit-attention maps: the direct formula, for tests.

Per batch element, with 0-based indices and ``g(h) = h // (H // G)`` the group head ``h`` reads::

    seg_h(i, j)   = Σ_{k=j+1..i} delta[k, h]                                   (0 on the diagonal)
    alpha_h[i, j] = (Σ_n C[i, g(h), n] · B[j, g(h), n]) · exp(A[h] · seg_h(i, j)) · delta[j, h]   for j ≤ i
                  = 0                                                                              for j > i

* "hidden" form (no weights given): one map per head, ``H_h = alpha_h``, C = H channels.
* "unified" form (any of ``row_weight``, ``col_weight``, ``conv_weight`` given): one map per channel
  ``c = h·P + p`` (HF's d_inner layout), C = H·P channels::

      H_c[i, s] = row_weight[i, h, p] · Σ_j alpha_h[i, j] · col_weight[j, h, p] · M_{h,p}[j, s]

  with ``M_{h,p}[t, s] = conv_weight[h, p, K-1-(t-s)]`` for ``0 ≤ t-s < K`` (the bias-free causal depthwise conv
  of ``F.conv1d(x, w.unsqueeze(1), padding=K-1, groups=H*P)[..., :L]``); missing weights mean 1 / identity.

Shapes: delta (B, L, H) ≥ 0, A (H,) ≤ 0, B and C (B, L, G, N), row_weight and col_weight (B, L, H, P),
conv_weight (H, P, K). Result: (B, L, L) for ``reduce`` "mean" / "sum" / "abs_mean" (over the C channels),
(B, C, L, L) for ``reduce=None``; with ``rows`` (R,) the L query rows become R.

This module computes everything in float64 and materialises (B, C, L, L); it is the yardstick for the fast
versions, so it stays short and literal. :func:`check_ssd_inputs` is shared with them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reductions import REDUCTIONS as REDUCE_MODES, reduce_channels



@dataclass(frozen=True)
class SSDShapes:
    """Sizes of one validated call."""

    batch: int
    length: int  # L
    heads: int  # H
    groups: int  # G
    state: int  # N
    head_dim: int | None  # P, None for the per-head ("hidden") form
    taps: int  # K, 1 without conv_weight
    rows: torch.Tensor | None  # (R,) int64 query rows on the inputs' device, None = all L

    @property
    def per_head(self) -> bool:
        return self.head_dim is None

    @property
    def channels(self) -> int:
        return self.heads if self.per_head else self.heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups


def check_ssd_inputs(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce) -> SSDShapes:
    """Validate the arguments of the ``ssd_maps_*`` functions; raise ``ValueError`` on any mismatch."""
    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {reduce!r}")
    named = {"delta": delta, "A": A, "B": B, "C": C, "row_weight": row_weight, "col_weight": col_weight,
             "conv_weight": conv_weight}
    given = {name: t for name, t in named.items() if t is not None}
    for name in ("delta", "A", "B", "C"):
        if name not in given:
            raise ValueError(f"{name} is required")
    for name, t in given.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{name} must be float32 or float64, got {t.dtype}")
        if t.dtype != delta.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but delta has {delta.dtype}; pass one dtype")
        if t.device != delta.device:
            raise ValueError(f"{name} is on {t.device} but delta is on {delta.device}")

    if delta.dim() != 3:
        raise ValueError(f"delta must be (B, L, H), got shape {tuple(delta.shape)}")
    batch, length, heads = delta.shape
    if A.shape != (heads,):
        raise ValueError(f"A must be (H,) = ({heads},), got shape {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, length):
        raise ValueError(f"B must be (B, L, G, N) = ({batch}, {length}, G, N), got shape {tuple(B.shape)}")
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    groups, state = B.shape[2], B.shape[3]
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"the number of heads ({heads}) must be a multiple of the number of groups ({groups})")

    head_dim = None
    for name in ("row_weight", "col_weight"):
        w = given.get(name)
        if w is None:
            continue
        if w.dim() != 4 or w.shape[:3] != (batch, length, heads):
            raise ValueError(f"{name} must be (B, L, H, P) = ({batch}, {length}, {heads}, P), "
                             f"got shape {tuple(w.shape)}")
        if head_dim is not None and w.shape[3] != head_dim:
            raise ValueError(f"{name} has P = {w.shape[3]} but another weight has P = {head_dim}")
        head_dim = w.shape[3]
    taps = 1
    if conv_weight is not None:
        if conv_weight.dim() != 3 or conv_weight.shape[0] != heads or conv_weight.shape[2] == 0:
            raise ValueError(f"conv_weight must be (H, P, K) = ({heads}, P, K), got shape {tuple(conv_weight.shape)}")
        if head_dim is not None and conv_weight.shape[1] != head_dim:
            raise ValueError(f"conv_weight has P = {conv_weight.shape[1]} but the row/col weights have P = {head_dim}")
        head_dim, taps = conv_weight.shape[1], conv_weight.shape[2]
    if head_dim == 0:
        raise ValueError("the head dimension P must be positive")

    if rows is not None:
        rows = torch.as_tensor(rows, device=delta.device)
        if rows.dim() != 1 or rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
            raise ValueError(f"rows must be a 1-D integer tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
        rows = rows.long()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= length):
            raise ValueError(f"rows must lie in [0, {length}), got values in [{int(rows.min())}, {int(rows.max())}]")
    return SSDShapes(batch, length, heads, groups, state, head_dim, taps, rows)


def ssd_hidden_maps_naive(delta, A, B, C) -> torch.Tensor:
    """alpha_h for every head: (B, H, L, L), in the inputs' dtype (use float64 inputs for a reference)."""
    length, heads = delta.shape[1:]
    heads_per_group = heads // B.shape[2]
    cumulative = delta.cumsum(1)  # S[t, h] = Σ_{k ≤ t} delta[k, h]
    seg = cumulative[:, :, None, :] - cumulative[:, None, :, :]  # (B, i, j, H): S_i - S_j = seg_h(i, j) for j ≤ i
    causal = torch.ones(length, length, dtype=torch.bool, device=delta.device).tril()
    # mask before the exp: A·seg > 0 above the diagonal and could overflow
    log_decay = (A * seg).masked_fill(~causal[None, :, :, None], float("-inf"))
    decay = log_decay.exp().permute(0, 3, 1, 2)  # (B, H, i, j)
    scores = torch.einsum("bign,bjgn->bgij", C, B).repeat_interleave(heads_per_group, dim=1)  # (B, H, i, j)
    return scores * decay * delta.transpose(1, 2)[:, :, None, :]


def conv_toeplitz(conv_weight: torch.Tensor, length: int) -> torch.Tensor:
    """M[..., t, s] = conv_weight[..., K-1-(t-s)] for 0 ≤ t-s < K, else 0: (..., L, L) for conv_weight (..., K)."""
    taps = conv_weight.shape[-1]
    positions = torch.arange(length, device=conv_weight.device)
    lag = positions[:, None] - positions[None, :]
    toeplitz = conv_weight.new_zeros(*conv_weight.shape[:-1], length, length)
    for k in range(min(taps, length)):
        toeplitz += conv_weight[..., taps - 1 - k, None, None] * (lag == k)
    return toeplitz


def ssd_maps_naive(delta, A, B, C, *, row_weight=None, col_weight=None, conv_weight=None, rows=None,
                   reduce="mean") -> torch.Tensor:
    """Mamba-2 implicit-attention maps by the direct formula (module docstring), computed in float64.

    Args:
        delta: (B, L, H) step sizes, softplus'ed and clamped. A: (H,) ≤ 0. B, C: (B, L, G, N).
        row_weight, col_weight: (B, L, H, P) or None. conv_weight: (H, P, K) or None. All None: per-head maps.
        rows: None or (R,) integer query rows (any order, repeats allowed).
        reduce: "mean" | "sum" | "abs_mean" over the channels, or None.

    Returns:
        (B, L, L) / (B, R, L) reduced, (B, C, L, L) / (B, C, R, L) with ``reduce=None``; C = H or H·P.
        Same dtype and device as delta.
    """
    shapes = check_ssd_inputs(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce)
    as64 = lambda t: None if t is None else t.to(torch.float64)
    alpha = ssd_hidden_maps_naive(as64(delta), as64(A), as64(B), as64(C))  # (B, H, L, L)

    if shapes.per_head:
        maps = alpha
    else:
        batch, length, heads, head_dim = shapes.batch, shapes.length, shapes.heads, shapes.head_dim
        ones = alpha.new_ones(batch, length, heads, head_dim)
        row = ones if row_weight is None else as64(row_weight)
        col = ones if col_weight is None else as64(col_weight)
        conv = alpha.new_ones(heads, head_dim, 1) if conv_weight is None else as64(conv_weight)
        per_head = []
        for h in range(heads):  # one head at a time keeps the Toeplitz stack at (P, L, L)
            toeplitz = conv_toeplitz(conv[h], length)  # (P, L, L)
            weighted = alpha[:, h, None] * col[:, :, h].transpose(1, 2)[:, :, None, :]  # (B, P, i, j): alpha·col_j
            per_head.append(row[:, :, h].transpose(1, 2)[..., None] * (weighted @ toeplitz))  # (B, P, i, s)
        maps = torch.cat(per_head, dim=1)  # (B, H·P, L, L), channel c = h·P + p

    if shapes.rows is not None:
        maps = maps[:, :, shapes.rows]
    return reduce_channels(maps, reduce).to(delta.dtype)
