"""Fast, memory-bounded Mamba-2 (SSD) implicit-attention maps in plain torch (the CPU path).

Same maps, arguments and shapes as :mod:`.naive` (whose docstring states the formula)::

    alpha_h[i, j] = (C_i · B_j)_{g(h)} · exp(A_h · (S_i - S_j)) · delta_{j,h}   (j ≤ i),   S = cumsum(delta)
    H_c[i, s]     = row[i,h,p] · Σ_j alpha_h[i, j] · col[j,h,p] · M_{h,p}[j, s],   c = h·P + p

**Channel sum ("mean", "sum").** Write the conv as taps ``τ = j - s`` with ``w_τ = conv_weight[..., K-1-τ]``:
``Σ_c H_c[i, s] = Σ_τ Y_τ[i, s + τ]`` with ``Y_τ[i, j] = Σ_g (C_i·B_j)_g · Σ_{h∈g, p} q_τ[i,h,p] · k[j,h,p]``,
where the decay splits at any reference token r with ``j ≤ r ≤ i``::

    q_τ[i,h,p] = row[i,h,p] · w_τ[h,p] · exp(A_h (S_i - S_r))        (≤ |row·w|: the exponent is ≤ 0)
    k[j,h,p]   = col[j,h,p] · delta_{j,h} · exp(A_h (S_r - S_j))     (≤ |col·delta|)

So a tile of T query rows ``[i0, i0 + T)`` against every earlier key ``j < i0`` (r = i0 - 1) is one GEMM per group
with inner dimension (H/G)·P and K·T rows (the taps stacked), then one elementwise product with ``C·Bᵀ``: no
per-head L×L work and only O(L·H) exponentials. The diagonal tile (``i0 ≤ j ≤ i``) cannot be split safely (a key
factor would grow like ``exp(|A|·Σ delta)``), so it is built per head by the direct formula (masked
``exp(A_h·seg)``) times the per-head rank-P products. When only one side is weighted the sum over p is taken first
(inner dimension H/G). Nothing of size (channels × L × L) is allocated: the largest temporaries are (G, K, T, L),
(H, K, T, T) and the (L, H, P, K) tap features of one batch element.

**Per channel (reduce=None, "abs_mean").** Channel block by channel block: for a block of query rows and one head,
the (P, rows, L) slab ``row · Σ_τ shift_τ(alpha_h ∘ col·w_τ)``, bounded by ``CHANNEL_BLOCK_ELEMENTS``.

Exponents come from a float64 cumsum of delta (long float32 cumsums lose the differences S_i - S_j); the causal
mask is applied before every exp. Everything else runs in the inputs' dtype.
"""
from __future__ import annotations

import torch

from .naive import check_ssd_inputs

TILE_SIZE = 128  # query rows per tile; the diagonal (per-head, direct) blocks are TILE_SIZE × TILE_SIZE
CHANNEL_BLOCK_ELEMENTS = 1 << 20  # elements of one per-channel slab (reduce=None / "abs_mean")


def ssd_maps_blocked(delta, A, B, C, *, row_weight=None, col_weight=None, conv_weight=None, rows=None,
                     reduce="mean", value_weight=None) -> torch.Tensor:
    """Mamba-2 implicit-attention maps, tiled (module docstring); same contract as ``ssd_maps_naive``.

    Args:
        delta: (B, L, H) step sizes, softplus'ed and clamped. A: (H,) ≤ 0. B, C: (B, L, G, N).
        row_weight, col_weight: (B, L, H, P) or None. conv_weight: (H, P, K) or None. All None: per-head maps.
        rows: None or (R,) integer query rows (any order, repeats allowed).
        reduce: "mean" | "sum" | "abs_mean" over the channels, or None.
        value_weight: (B, L, H, P) or None, "mean" / "sum" only: a column weight after the conv,
            ``H_c · diag(value_weight[:, c])`` (gradient × operator × input in one call: the taps go to the keys,
            ``col[j] · w_τ · v[j − τ]``, instead of one call per tap).

    Returns:
        (B, L, L) / (B, R, L) reduced, (B, C, L, L) / (B, C, R, L) with ``reduce=None``; C = H or H·P.
        Same dtype and device as delta.
    """
    shapes = check_ssd_inputs(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce)
    if value_weight is not None:
        if reduce not in ("mean", "sum"):
            raise ValueError(f"value_weight needs reduce 'mean' or 'sum', got {reduce!r}")
        if value_weight.shape[:3] != delta.shape or value_weight.dtype != delta.dtype:
            raise ValueError(f"value_weight must be (B, L, H, P) in delta's dtype, got {tuple(value_weight.shape)} "
                             f"{value_weight.dtype}")
    cumulative = delta.to(torch.float64).cumsum(1)  # (B, L, H)
    A64 = A.to(torch.float64)
    if reduce in ("mean", "sum"):
        out = _channel_sum_maps(shapes, delta, cumulative, A64, B, C, row_weight, col_weight, conv_weight,
                                value_weight)
        return out / shapes.channels if reduce == "mean" else out
    return _per_channel_maps(shapes, delta, cumulative, A64, B, C, row_weight, col_weight, conv_weight, reduce)


# ---------------------------------------------------------------------------------------------------------------
# Channel sum


def _value_tap_features(shapes, like, row_weight, col_weight, conv_weight, value_weight):
    """Query and key features with a column weight after the conv, for one batch element: query ``row`` (L, H, P, 1)
    and key ``col[j] · w_τ · v[j − τ]`` (L, H, P, K), v = 0 before token 0 (the conv's zero padding)."""
    length, heads, head_dim, taps = shapes.length, shapes.heads, value_weight.shape[-1], shapes.taps
    tap_weights = like.new_ones(heads, head_dim, 1) if conv_weight is None else conv_weight.flip(-1)
    shifted = like.new_zeros(length, heads, head_dim, tap_weights.shape[-1])
    for tau in range(min(tap_weights.shape[-1], length)):
        shifted[tau:, :, :, tau] = value_weight[:length - tau]
    key = shifted * tap_weights if col_weight is None else shifted * tap_weights * col_weight[..., None]
    query = like.new_ones(1, 1, 1, 1).expand(length, heads, head_dim, 1) if row_weight is None else row_weight[..., None]
    return query, key


def tap_features(shapes, like, row_weight, col_weight, conv_weight):
    """Split ``Σ_p row[i,h,p] · col[j,h,p] · w_τ[h,p]`` into query and key features, for one batch element.

    row_weight, col_weight: (L, H, P) or None. Returns ``query`` (L, H, P', Kq) and ``key`` (L, H, P', Kk), one of
    Kq, Kk being K and the other 1, with ``Σ_p' query[i,h,p',τ] · key[j,h,p',τ]`` equal to that sum (τ indexing
    whichever side has the K taps). P' = P when both row and col weights are given; otherwise the sum over p is
    taken in advance and P' = 1. Size-1 dims may be broadcast views. ``like`` gives dtype and device.
    """
    length, heads, taps = shapes.length, shapes.heads, shapes.taps
    if conv_weight is None:
        tap_weights = like.new_ones(heads, shapes.head_dim or 1, 1)
    else:
        tap_weights = conv_weight.flip(-1)  # tap_weights[h, p, τ] = conv_weight[h, p, K-1-τ]
    ones = like.new_ones(1, 1, 1, 1).expand(length, heads, 1, 1)
    if row_weight is not None and col_weight is not None:
        return row_weight[..., None] * tap_weights, col_weight[..., None]
    if row_weight is not None:
        return torch.einsum("lhp,hpt->lht", row_weight, tap_weights)[:, :, None, :], ones
    if col_weight is not None:
        return ones, torch.einsum("lhp,hpt->lht", col_weight, tap_weights)[:, :, None, :]
    return ones, tap_weights.sum(1)[None, :, None, :].expand(length, heads, 1, taps)


def summed_products(query, key, blocks: int) -> torch.Tensor:
    """``Σ_{h in block, p} query[i,h,p,τ] · key[j,h,p,τ]`` per block of H/blocks heads: (blocks, K, I, J).

    query (I, H, P', Kq), key (J, H, P', Kk), one of Kq, Kk being 1: one batched GEMM with inner dim (H/blocks)·P'.
    """
    rows, heads, feat, query_taps = query.shape
    cols, key_taps = key.shape[0], key.shape[3]
    inner = heads // blocks * feat
    lhs = query.reshape(rows, blocks, inner, query_taps).permute(1, 3, 0, 2).reshape(blocks, query_taps * rows, inner)
    rhs = key.reshape(cols, blocks, inner, key_taps).permute(1, 2, 3, 0).reshape(blocks, inner, key_taps * cols)
    products = torch.bmm(lhs, rhs)  # (blocks, Kq·I, Kk·J)
    if key_taps == 1:
        return products.view(blocks, query_taps, rows, cols)
    return products.view(blocks, rows, key_taps, cols).transpose(1, 2)


def add_shifted_taps(out_rows: torch.Tensor, per_tap: torch.Tensor, first_col: int) -> None:
    """out_rows[:, j - τ] += per_tap[τ, :, j - first_col]: tap τ of the conv reads the input τ tokens back."""
    width = per_tap.shape[-1]
    for tau in range(per_tap.shape[0]):
        start = first_col - tau
        skip = max(0, -start)  # columns that would land before token 0 (their input is the conv's zero padding)
        if skip < width:
            out_rows[:, start + skip:start + width] += per_tap[tau, :, skip:]


def _alpha_block(delta, cumulative, A64, B, C, query_rows, keys: slice) -> torch.Tensor:
    """alpha_h[i, j] for the query rows and the keys in ``keys``, every head, direct formula: (H, I, J).

    One batch element: delta (L, H), cumulative (L, H) float64, B and C (L, G, N).
    """
    heads, groups = delta.shape[1], B.shape[1]
    seg = cumulative[query_rows][:, None, :] - cumulative[keys][None, :, :]  # (I, J, H), float64
    key_positions = torch.arange(keys.start, keys.stop, device=delta.device)
    causal = key_positions[None, :] <= query_rows[:, None]
    # mask before the exp: above the diagonal A·seg > 0 and could overflow
    log_decay = (A64 * seg).to(delta.dtype).masked_fill(~causal[:, :, None], float("-inf"))
    decay = log_decay.exp() * delta[keys]  # (I, J, H)
    scores = torch.einsum("ign,jgn->gij", C[query_rows], B[keys])  # (G, I, J)
    return scores.repeat_interleave(heads // groups, dim=0) * decay.permute(2, 0, 1)


def _channel_sum_maps(shapes, delta, cumulative, A64, B, C, row_weight, col_weight, conv_weight,
                      value_weight=None) -> torch.Tensor:
    """Σ_c H_c (times ``diag(value_weight)`` after the conv when given): (B, L, L) or (B, R, L)."""
    length, heads, groups, dtype = shapes.length, shapes.heads, shapes.groups, delta.dtype
    if shapes.rows is None:
        query_rows, inverse = torch.arange(length, device=delta.device), None
    else:
        query_rows, inverse = torch.unique(shapes.rows, sorted=True, return_inverse=True)
    tile = max(1, int(TILE_SIZE))
    tile_of_row = query_rows // tile
    tile_ids, rows_per_tile = torch.unique_consecutive(tile_of_row, return_counts=True)

    out = delta.new_zeros(shapes.batch, len(query_rows), length)
    for b in range(shapes.batch):
        row, col = (None if w is None else w[b] for w in (row_weight, col_weight))
        if value_weight is None:
            query_features, key_features = tap_features(shapes, delta, row, col, conv_weight)
        else:
            query_features, key_features = _value_tap_features(shapes, delta, row, col, conv_weight, value_weight[b])
        first = 0
        for tile_id, count in zip(tile_ids.tolist(), rows_per_tile.tolist()):
            rows_slice = slice(first, first + count)
            first += count
            q = query_rows[rows_slice]
            tile_start, last_row = tile_id * tile, int(q[-1])
            out_rows = out[b, rows_slice]  # (I, L) view

            if tile_start > 0:  # every key before the tile: factorised decay, one GEMM per group
                ref = cumulative[b, tile_start - 1]  # S_r with r = tile_start - 1
                query_decay = torch.exp(A64 * (cumulative[b, q] - ref)).to(dtype)  # (I, H) ≤ 1
                key_decay = (torch.exp(A64 * (ref - cumulative[b, :tile_start])).to(dtype)
                             * delta[b, :tile_start])  # (J, H), exp ≤ 1
                query = query_features[q] * query_decay[:, :, None, None]
                key = key_features[:tile_start] * key_decay[:, :, None, None]
                products = summed_products(query, key, groups)  # (G, K, I, J)
                scores = torch.einsum("ign,jgn->gij", C[b, q], B[b, :tile_start])  # (G, I, J)
                add_shifted_taps(out_rows, (products * scores[:, None]).sum(0), 0)

            # diagonal block: keys tile_start ≤ j ≤ last_row, direct per head
            keys = slice(tile_start, last_row + 1)
            alpha = _alpha_block(delta[b], cumulative[b], A64, B[b], C[b], q, keys)  # (H, I, J)
            products = summed_products(query_features[q], key_features[keys], heads)  # (H, K, I, J)
            add_shifted_taps(out_rows, (products * alpha[:, None]).sum(0), tile_start)

    return out if inverse is None else out[:, inverse]


# ---------------------------------------------------------------------------------------------------------------
# Per channel


def _per_channel_maps(shapes, delta, cumulative, A64, B, C, row_weight, col_weight, conv_weight, reduce):
    """(B, C, R, L) for reduce=None, mean_c |H_c| (B, R, L) for "abs_mean"; one (P, rows, L) slab at a time."""
    batch, length, heads = shapes.batch, shapes.length, shapes.heads
    head_dim, taps = shapes.head_dim or 1, shapes.taps
    query_rows = torch.arange(length, device=delta.device) if shapes.rows is None else shapes.rows
    n_rows = len(query_rows)
    if reduce is None:
        out = delta.new_zeros(batch, shapes.channels, n_rows, length)
    else:
        out = delta.new_zeros(batch, n_rows, length)
    tap_weights = delta.new_ones(heads, head_dim, 1) if conv_weight is None else conv_weight.flip(-1)
    # a (P, rows, L) slab that fits in cache: the tap loop below is memory-bound
    block_rows = max(1, CHANNEL_BLOCK_ELEMENTS // (max(head_dim, heads) * max(length, 1)))

    for b in range(batch):
        if not shapes.per_head:
            # col_taps[h, τ, p, j] = col[j, h, p] · w_τ[h, p]; keys last so the broadcasts below read contiguously
            col = delta.new_ones(1, 1, 1) if col_weight is None else col_weight[b]
            col_taps = (col[..., None] * tap_weights).expand(length, heads, head_dim, taps).permute(1, 3, 2, 0)
            col_taps = col_taps.contiguous()
        for first in range(0, n_rows, block_rows):
            rows_slice = slice(first, min(first + block_rows, n_rows))
            q = query_rows[rows_slice]
            width = int(q.max()) + 1  # alpha is 0 for keys after the last query row
            alpha = _alpha_block(delta[b], cumulative[b], A64, B[b], C[b], q, slice(0, width))  # (H, I, J)
            if shapes.per_head:
                if reduce is None:
                    out[b, :, rows_slice, :width] = alpha
                else:
                    out[b, rows_slice, :width] += alpha.abs().sum(0)
                continue

            for h in range(heads):
                # slab[p, i, s] = H_{h,p}[i, s], built in place (in the output itself when reduce=None)
                slab = out[b, h * head_dim:(h + 1) * head_dim, rows_slice, :width] if reduce is None else None
                slab = torch.mul(alpha[h, None], col_taps[h, 0, :, None, :width], out=slab)
                for tau in range(1, min(taps, width)):  # tap τ: alpha[i, s+τ] · col[s+τ] · w_τ lands on column s
                    slab[:, :, :width - tau].addcmul_(alpha[h, None, :, tau:], col_taps[h, tau, :, None, tau:width])
                if row_weight is not None:
                    slab *= row_weight[b, q, h].T[:, :, None]
                if reduce == "abs_mean":
                    out[b, rows_slice, :width] += slab.abs_().sum(0)

    return out if reduce is None else out / shapes.channels
