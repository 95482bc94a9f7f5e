"""Maps of a per-head core with channel weights, from row tiles of the core (see :mod:`kernels.heads`).

**Channel sum.** ``Σ_c H_c[i, s] = Σ_τ Σ_h α_h[i, s+τ] · Σ_p row[i,h,p] w_τ[h,p] col[s+τ,h,p]``: per tile of T
query rows, the per-head rank-P products of the tap features (one batched GEMM, the same features as Mamba-2's
diagonal blocks, :mod:`kernels.ssd.blocked`) times the tile of α, shifted back by τ columns.

**Per channel** (``reduce=None``, "abs_mean"): for each head, the (P, T, L) slab
``row · Σ_τ shift_τ(α_h ∘ col·w_τ)``.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..ssd.blocked import add_shifted_taps, summed_products, tap_features

TILE_SIZE = 128  # query rows per tile
CHANNEL_BLOCK_ELEMENTS = 1 << 20  # elements of one per-channel slab


def head_maps_blocked(alpha_rows, *, batch, length, heads, row_weight=None, col_weight=None, conv_weight=None,
                      rows=None, reduce="mean", dtype=torch.float32, device=None):
    """Maps of ``diag(row) α_h diag(col) M`` per channel (C = H·P), or of α_h per head when no weight is given.

    Args:
        alpha_rows: ``alpha_rows(b, rows) -> (H, R, L)``, the core's rows of batch element b (rows: (R,) int64,
            sorted).
        batch, length, heads: B, L, H.
        row_weight, col_weight: (B, L, H, P) or None. conv_weight: (H, P, K) or None.
        rows: None or (R,) query rows (any order, repeats allowed). reduce: "mean" | "sum" | "abs_mean" | None.
    Returns:
        (B, L, L) / (B, R, L) reduced, (B, C, L, L) / (B, C, R, L) with ``reduce=None``, in ``dtype``.
    """
    weights = [w for w in (row_weight, col_weight) if w is not None]
    per_head = not weights and conv_weight is None
    head_dim = 1 if per_head else (weights[0].shape[-1] if weights else conv_weight.shape[1])
    channels = heads * head_dim if not per_head else heads
    if rows is None:
        query_rows, inverse = torch.arange(length, device=device), None
    else:
        query_rows, inverse = torch.unique(torch.as_tensor(rows, device=device), sorted=True, return_inverse=True)
    n_rows = len(query_rows)
    if reduce is None:
        out = torch.zeros(batch, channels, n_rows, length, dtype=dtype, device=device)
    else:
        out = torch.zeros(batch, n_rows, length, dtype=dtype, device=device)
    taps = 1 if conv_weight is None else conv_weight.shape[-1]
    shapes = SimpleNamespace(length=length, heads=heads, taps=taps, head_dim=head_dim)
    tap_weights = None if per_head else (torch.ones(heads, head_dim, 1, dtype=dtype, device=device)
                                         if conv_weight is None else conv_weight.to(dtype).flip(-1))
    cast = lambda w: None if w is None else w.to(dtype)  # noqa: E731
    row_weight, col_weight = cast(row_weight), cast(col_weight)
    tile = TILE_SIZE if reduce in ("mean", "sum") else max(1, CHANNEL_BLOCK_ELEMENTS // (head_dim * max(length, 1)))

    for b in range(batch):
        if reduce in ("mean", "sum") and not per_head:
            query_features, key_features = tap_features(
                shapes, torch.empty(0, dtype=dtype, device=device),
                None if row_weight is None else row_weight[b], None if col_weight is None else col_weight[b],
                None if conv_weight is None else conv_weight.to(dtype))
        for first in range(0, n_rows, tile):
            rows_slice = slice(first, min(first + tile, n_rows))
            q = query_rows[rows_slice]
            alpha = alpha_rows(b, q).to(dtype)  # (H, T, L)
            if per_head:
                if reduce is None:
                    out[b, :, rows_slice] = alpha
                elif reduce == "abs_mean":
                    out[b, rows_slice] = alpha.abs().sum(0)
                else:
                    out[b, rows_slice] = alpha.sum(0)
                continue
            if reduce in ("mean", "sum"):
                products = summed_products(query_features[q], key_features, heads)  # (H, K, T, L)
                add_shifted_taps(out[b, rows_slice], (products * alpha[:, None]).sum(0), 0)
                continue
            col = torch.ones(length, heads, head_dim, dtype=dtype, device=device) if col_weight is None \
                else col_weight[b]
            for h in range(heads):
                col_taps = (col[:, h, :, None] * tap_weights[h]).permute(2, 1, 0)  # (K, P, L)
                slab = out[b, h * head_dim:(h + 1) * head_dim, rows_slice] if reduce is None else None
                slab = torch.mul(alpha[h, None], col_taps[0, :, None, :], out=slab)
                for tau in range(1, min(taps, length)):  # tap τ: α[i, s+τ] · col[s+τ] · w_τ lands on column s
                    slab[:, :, :length - tau].addcmul_(alpha[h, None, :, tau:], col_taps[tau, :, None, tau:])
                if row_weight is not None:
                    slab *= row_weight[b, q, h].T[:, :, None]
                if reduce == "abs_mean":
                    out[b, rows_slice] += slab.abs().sum(0)
    if reduce in ("mean", "abs_mean"):
        out = out / channels
    if inverse is not None:
        out = out[:, inverse] if reduce is not None else out[:, :, inverse]
    return out
