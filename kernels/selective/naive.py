"""Reference (naive) Mamba-1 / S6 implicit-attention maps: the direct per-channel formula.

Shapes: B batch, L tokens, D channels, N state size, K conv taps, R query rows. All indices are 0-based.

Inputs: ``delta`` (B, L, D) ≥ 0 (after softplus), ``A`` (D, N) ≤ 0 (``-exp(A_log)``), ``B`` and ``C`` (B, L, N).
With ``seg_c(i, j) = Σ_{k=j+1..i} delta[k, c]`` (0 on the diagonal) the hidden map of channel c is

    α_c[i, j] = Σ_n C[i, n] · exp(A[c, n] · seg_c(i, j)) · delta[j, c] · B[j, n]    for j ≤ i, 0 for j > i,

and the full operator is ``H_c = diag(row_weight[:, c]) · α_c · diag(col_weight[:, c]) · M_c`` (times
``diag(value_weight[:, c])`` on the right when given) with ``M_c`` the
bias-free causal depthwise conv as a Toeplitz matrix, ``M_c[t, s] = conv_weight[c, K-1-(t-s)]`` for
0 ≤ t-s < K (what ``F.conv1d(x, w.unsqueeze(1), padding=K-1, groups=D)[..., :L]`` computes). A weight that is
None is 1 / the identity.

This module materialises the per-channel maps chunk by chunk over channels (memory ~ B·R·L·N per channel) and is
meant as the test reference; :mod:`.blocked` holds the fast exact algorithm.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..reductions import REDUCTIONS

_NAIVE_CHUNK_ELEMENTS = 1 << 24  # elements of the (B, R, L, chunk, N) decay tensor
# exp(x) for x below log(smallest normal) is subnormal or 0 (negligible) and takes a ~10× slower path on CPU.
_EXP_FLOOR = {dtype: math.log(torch.finfo(dtype).tiny) + 1.0 for dtype in (torch.float32, torch.float64)}


def validate_inputs(delta: Tensor, A: Tensor, B: Tensor, C: Tensor, row_weight: Optional[Tensor],
                    col_weight: Optional[Tensor], conv_weight: Optional[Tensor],
                    rows: Union[Tensor, Sequence[int], None], reduce,
                    value_weight: Optional[Tensor] = None) -> Optional[Tensor]:
    """Check shapes, dtypes and ``reduce``; return ``rows`` as a 1-D int64 tensor on delta's device (or None).

    Raises:
        ValueError: on a bad shape, dtype, row index or reduction.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    if delta.dim() != 3:
        raise ValueError(f"delta must be (B, L, D), got shape {tuple(delta.shape)}")
    if delta.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"delta must be float32 or float64, got {delta.dtype}")
    batch, length, channels = delta.shape
    if A.dim() != 2 or A.shape[0] != channels:
        raise ValueError(f"A must be (D, N) = ({channels}, N), got shape {tuple(A.shape)}")
    state = A.shape[1]
    for name, t in (("B", B), ("C", C)):
        if t.shape != (batch, length, state):
            raise ValueError(f"{name} must be (B, L, N) = {(batch, length, state)}, got shape {tuple(t.shape)}")
    for name, t in (("row_weight", row_weight), ("col_weight", col_weight), ("value_weight", value_weight)):
        if t is not None and t.shape != delta.shape:
            raise ValueError(f"{name} must be (B, L, D) = {tuple(delta.shape)}, got shape {tuple(t.shape)}")
    if conv_weight is not None and (conv_weight.dim() != 2 or conv_weight.shape[0] != channels
                                    or conv_weight.shape[1] < 1):
        raise ValueError(f"conv_weight must be (D, K) = ({channels}, K), got shape {tuple(conv_weight.shape)}")
    for name, t in (("A", A), ("B", B), ("C", C), ("row_weight", row_weight), ("col_weight", col_weight),
                    ("conv_weight", conv_weight), ("value_weight", value_weight)):
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if rows is None:
        return None
    rows = torch.as_tensor(rows, device=delta.device)
    if rows.numel() == 0:
        rows = rows.long()  # an empty list arrives as float32
    if rows.dim() != 1 or rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
        raise ValueError(f"rows must be a 1-D integer tensor of query indices, got {rows.dtype} {tuple(rows.shape)}")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= length):
        raise ValueError(f"rows must lie in [0, L) = [0, {length}), got min {int(rows.min())} max {int(rows.max())}")
    return rows.long()


def apply_conv_columns(maps: Tensor, conv_weight: Tensor) -> Tensor:
    """``maps @ M_c`` for the causal conv Toeplitz ``M_c[t, s] = w[c, K-1-(t-s)]`` (0 ≤ t-s < K), band by band.

    maps: (B, c, R, L) with columns t; conv_weight: (c, K). Returns (B, c, R, L) with columns s.
    """
    taps, length = conv_weight.shape[1], maps.shape[-1]
    out = torch.zeros_like(maps)
    for lag in range(min(taps, length)):  # band t = s + lag carries tap w[c, K-1-lag]
        out[..., :length - lag] += conv_weight[:, taps - 1 - lag, None, None] * maps[..., lag:]
    return out


def selective_maps_naive(delta: Tensor, A: Tensor, B: Tensor, C: Tensor, *, row_weight: Optional[Tensor] = None,
                         col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                         rows: Union[Tensor, Sequence[int], None] = None, reduce: Optional[str] = "mean",
                         value_weight: Optional[Tensor] = None) -> Tensor:
    """Channel maps of a Mamba-1 layer by the direct formula (reference implementation).

    Args:
        delta: (B, L, D) step sizes ≥ 0.  A: (D, N) ≤ 0.  B, C: (B, L, N).
        row_weight, col_weight: (B, L, D) or None.  conv_weight: (D, K) or None.
        value_weight: (B, L, D) or None: a column weight after the conv, ``H_c · diag(value_weight[:, c])`` (the
            values the operator acts on, for gradient × operator × input).
        rows: None or (R,) query indices (any order, repeats allowed).
        reduce: "mean" | "sum" | "abs_mean" over channels, or None for per-channel maps.
    Returns:
        (B, L, L) — or (B, D, L, L) with ``reduce=None``; L query rows become R with ``rows``. Same dtype and device
        as ``delta``. Segment sums use a float64 cumsum; the rest is computed in delta's dtype.
    """
    rows = validate_inputs(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce, value_weight)
    dtype = delta.dtype
    batch, length, channels = delta.shape
    state = A.shape[1]
    A, B, C = A.to(dtype), B.to(dtype), C.to(dtype)
    query = torch.arange(length, device=delta.device) if rows is None else rows
    n_rows = query.numel()

    cumsum = delta.double().cumsum(1)  # S[i, c] = Σ_{k ≤ i} delta[k, c]
    causal = query[:, None] >= torch.arange(length, device=delta.device)[None, :]  # (R, L): j ≤ i
    keys = delta[..., None] * B[:, :, None, :]  # (B, L, D, N): delta[j, c] · B[j, n]
    out = delta.new_zeros((batch, channels, n_rows, length) if reduce is None else (batch, n_rows, length))

    chunk = max(1, _NAIVE_CHUNK_ELEMENTS // max(1, batch * n_rows * length * state))
    for c0 in range(0, channels, chunk):
        c1 = min(channels, c0 + chunk)
        seg = cumsum[:, query, None, c0:c1] - cumsum[:, None, :, c0:c1]  # (B, R, L, c): S_i - S_j
        seg = seg.clamp(min=0).to(dtype)  # j > i is masked below; clamping keeps exp finite there
        exponent = (seg[..., None] * A[c0:c1]).clamp(min=_EXP_FLOOR[dtype])  # (B, R, L, c, N)
        decay = torch.exp(exponent)
        alpha = torch.einsum("brn,brjcn,bjcn->bcrj", C[:, query], decay, keys[:, :, c0:c1]) * causal
        if row_weight is not None:
            alpha = alpha * row_weight[:, query, c0:c1].to(dtype).permute(0, 2, 1)[..., None]
        if col_weight is not None:
            alpha = alpha * col_weight[:, :, c0:c1].to(dtype).permute(0, 2, 1)[:, :, None, :]
        if conv_weight is not None:
            alpha = apply_conv_columns(alpha, conv_weight[c0:c1].to(dtype))  # α_c · diag(col_c) · M_c
        if value_weight is not None:
            alpha = alpha * value_weight[:, :, c0:c1].to(dtype).permute(0, 2, 1)[:, :, None, :]
        if reduce is None:
            out[:, c0:c1] = alpha
        elif reduce == "abs_mean":
            out += alpha.abs().sum(1)
        else:
            out += alpha.sum(1)
    if reduce in ("mean", "abs_mean"):
        out /= channels
    return out
