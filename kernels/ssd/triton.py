"""Mamba-2 (SSD) implicit-attention maps by the shared Triton tile kernel (:mod:`kernels.triton_maps`).

Same contract as :func:`.naive.ssd_maps_naive`. The SSD map is the channel-decay map with one decay head per
Mamba-2 head (``S = cumsum(delta)`` in float64, rate ``A_h`` for every n), queries ``C`` and keys ``B`` per group,
and ``delta`` folded into the column weight. Without row/col/conv weights the maps are per head (P = 1); with
any, per channel (h, p). Runs on CUDA tensors, or on CPU under ``TRITON_INTERPRET=1``. Result in float32, cast to
delta's dtype.
"""
from __future__ import annotations

import torch

from ..triton_maps import channel_decay_maps_triton
from .naive import check_ssd_inputs


def ssd_maps_triton(delta, A, B, C, *, row_weight=None, col_weight=None, conv_weight=None, rows=None,
                    reduce="mean", precision="ieee") -> torch.Tensor:
    """Mamba-2 maps with Triton.

    Args:
        delta: (B, L, H). A: (H,). B, C: (B, L, G, N). row_weight, col_weight: (B, L, H, P) or None.
        conv_weight: (H, P, K) or None. rows: None or (R,). reduce: "mean" | "sum" | "abs_mean" | None.
        precision: "ieee" (fp32-exact products, default) or "tf32".
    Returns:
        (B, L, L) / (B, R, L), or (B, C, L, L) / (B, C, R, L) with ``reduce=None`` (C = H, or H·P with weights).
    """
    shapes = check_ssd_inputs(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce)
    batch, length, heads = delta.shape
    per_channel = row_weight is not None or col_weight is not None or conv_weight is not None
    head_dim = shapes.head_dim if per_channel else 1
    # (B, L, H, P) -> (B, L, H·P): channel c = h·P + p reads head c // P
    keys_weight = delta[..., None].expand(batch, length, heads, head_dim)
    if col_weight is not None:
        keys_weight = keys_weight * col_weight
    flat = lambda t: None if t is None else t.reshape(batch, length, heads * head_dim)  # noqa: E731
    maps = channel_decay_maps_triton(
        delta.to(torch.float64).cumsum(1), A[:, None].expand(heads, B.shape[3]), CQ=C, BK=B,
        row_weight=flat(row_weight), col_weight=flat(keys_weight),
        conv_weight=None if conv_weight is None else conv_weight.reshape(heads * head_dim, -1),
        channels_per_head=head_dim, heads_per_group=heads // B.shape[2], shared_rate=True, rows=shapes.rows, reduce=reduce,
        precision=precision)
    return maps.to(delta.dtype)
