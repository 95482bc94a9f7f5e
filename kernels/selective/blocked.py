"""Fast exact Mamba-1 / S6 implicit-attention maps in plain torch (blocked, recursive halving).

Shapes: B batch, L tokens, D channels, N state size, K conv taps, R query rows; X = (channels of a chunk) · N.
The maps are those of :mod:`.naive`:

    α_c[i, j] = Σ_n C[i, n] · exp(A[c, n] · (S_i − S_j)) · delta[j, c] · B[j, n]   (j ≤ i),  S = cumsum(delta),
    H_c = diag(row_weight[:, c]) · α_c · diag(col_weight[:, c]) · M_c           (M_c: causal conv, Toeplitz).

Algorithm (DESIGN §5). For any reference r with j ≤ r ≤ i,
``exp(A(S_i − S_j)) = exp(A(S_i − S_r)) · exp(A(S_r − S_j))`` and both factors are ≤ 1, so a block of the
channel-reduced map whose rows all lie after its columns is ONE GEMM over the flattened (c, n) axis:
queries ``row_i · C_i · exp(A(S_i − S_r))``, keys ``exp(A(S_r − S_j)) · delta_j · B_j · col_j`` (conv'd along j).
The sequence is padded to whole leaves (``leaf`` tokens) and cut by recursive halving: a block of leaves
[lo, hi) with midpoint mid contributes its quadrant rows [mid, hi) × S6 columns [lo, mid) as a GEMM with
r = mid − 1, and the two halves recurse; all equal blocks of one level are one ``torch.bmm`` (accumulated over
channel chunks with beta = 1). Only the diagonal leaves are computed per channel, by the scan recursion inside the
leaf. No factor is ever > 1, so large |A|·Σdelta cannot overflow (factoring around a fixed tile start would need
exp(+100s) and give inf/NaN).

Exponentials are O(L·X) for the whole map: the per-token decays ``a_k = exp(A·delta_k)`` ≤ 1 give, by products
of at most ``leaf`` factors, every query/key relative to its own leaf (``exp(A(S_i − S_{leafstart−1}))``,
``exp(A(S_{leafend} − S_j))``) and the pairs inside a leaf; each level then multiplies them by one per-leaf
factor ``exp(A·Σ delta over the leaves in between)`` ≤ 1, whose sums are differences of one float64 prefix sum
over leaves (all levels' factors of a channel chunk come from one exp). No long fp32 cumsum or
difference of cumsums is formed, so long fp32 sequences stay accurate (≤ 1e-5 relative at L = 2048).

The conv folds into the keys: output column s collects S6 columns j = s..s+K−1, so each leaf's keys are conv'd
once inside the leaf (zero outside it), giving leaf+K−1 output columns; a level scales those per leaf and
overlap-adds the K−1 spill columns, so a block with S6 columns [lo, mid) writes output columns [lo−K+1, mid).

Exponents below log(smallest normal) are clamped there (the result differs by < 1e-37 relative; exp() of
such arguments takes a ~10× slower path on CPU).

Memory: "mean"/"sum" never hold a per-channel (D, L, L) tensor; work is chunked over channels so that the
working set is O(L·X) + the (B, L, L+leaf) accumulators. ``reduce=None`` and ``"abs_mean"`` (which cannot be
factorised over channels) run the same recursion with per-channel GEMMs (inner dimension N) on channel blocks —
several times slower than the reduced maps (~6× for D = 1536). ``rows=...`` uses the direct formula on the
requested rows (cost Σ_r (rows[r] + 1)·D·N), or the full map and indexing when that is cheaper.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .naive import validate_inputs

LEAF = 8  # tokens per leaf (per-channel scan inside); raised to K − 1 when the conv is longer
_WORKING_ELEMENTS = 1 << 20  # elements of one (B, L, chunk·N) working tensor (L = 1024, N = 16: 64 channels)
_CHANNEL_BLOCK_ELEMENTS = 1 << 22  # per-channel accumulator (B, chunk, L, L + leaf) of reduce=None / "abs_mean"
_ROWS_PER_BLOCK = 16  # query rows per block of the direct rows path
# The direct rows path costs ~ Σ_blocks rows × columns; above this many full-length rows the full map is cheaper
# (measured on CPU; reduce=None always takes the rows path: its full map would be (B, D, L, L)).
_FULL_MAP_ROWS = {"mean": 8, "sum": 8, "abs_mean": 48}
_ROWS_CHUNK_ELEMENTS = 1 << 20  # budget of its (B, rows, L, chunk, N) decay tensor


def selective_maps_blocked(delta: Tensor, A: Tensor, B: Tensor, C: Tensor, *, row_weight: Optional[Tensor] = None,
                           col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                           rows: Union[Tensor, Sequence[int], None] = None,
                           reduce: Optional[str] = "mean", value_weight: Optional[Tensor] = None) -> Tensor:
    """Channel maps of a Mamba-1 layer, exact, by blocked GEMMs (see the module docstring).

    Args:
        delta: (B, L, D) step sizes ≥ 0.  A: (D, N) ≤ 0.  B, C: (B, L, N).
        row_weight, col_weight: (B, L, D) or None (1).  conv_weight: (D, K) or None (identity).
        value_weight: (B, L, D) or None: ``H_c · diag(value_weight[:, c])``, a column weight after the conv (it
            scales the conv'd keys, so gradient × operator × input costs one call, not one per conv tap).
        rows: None or (R,) query indices (any order, repeats allowed).
        reduce: "mean" | "sum" (fast path) | "abs_mean" (per-channel blocks, slower) over channels, or None.
    Returns:
        (B, L, L) — or (B, D, L, L) with ``reduce=None``; L query rows become R with ``rows``. Computed in and
        returned as delta's dtype (float32 or float64), on delta's device.
    """
    rows = validate_inputs(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce, value_weight)
    dtype = delta.dtype
    A, B, C = A.to(dtype), B.to(dtype), C.to(dtype)
    row_weight, col_weight, conv_weight, value_weight = (None if t is None else t.to(dtype) for t in
                                                         (row_weight, col_weight, conv_weight, value_weight))
    if rows is not None and (reduce is None or _rows_work(rows) <= _FULL_MAP_ROWS[reduce] * delta.shape[1]):
        return _rows_direct(delta, A, B, C, row_weight, col_weight, conv_weight, rows, reduce, value_weight)
    maps = _Blocked(delta, A, B, C, row_weight, col_weight, conv_weight, value_weight=value_weight).maps(reduce)
    return maps if rows is None else maps[:, rows]  # many rows: the full map is cheaper


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _pad_tokens(x: Optional[Tensor], pad: int) -> Optional[Tensor]:
    """Zero-pad (B, L, ...) at the end of the token axis."""
    if x is None or pad == 0:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], pad) + tuple(x.shape[2:]))], dim=1)


def _fold_conv(x: Tensor, taps: Optional[Tensor], dim: int, out: Optional[Tensor] = None) -> Tensor:
    """Apply the conv to S6 columns along ``dim``: y[u] = Σ_t w[K-1-t] · x[u+t] for u in [-(K-1), n), x = 0 outside.

    ``taps`` is (K, ...) with ``taps[k]`` broadcastable to x's trailing (channel) dims, or None (identity: returns
    x). The result has n + K − 1 entries along ``dim`` (entry u + K − 1 is column u relative to x's first column);
    ``out`` may hold a preallocated result.
    """
    if taps is None:
        return x
    n_taps, n = taps.shape[0], x.shape[dim]
    if out is None:
        out = x.new_empty(x.shape[:dim] + (n + n_taps - 1,) + x.shape[dim + 1:])
    # x[v] feeds entry v + K − 1 − t with tap w[K − 1 − t]; t = 0 covers the last n entries, the rest accumulate.
    torch.mul(x, taps[n_taps - 1], out=out.narrow(dim, n_taps - 1, n))
    out.narrow(dim, 0, n_taps - 1).zero_()
    for t in range(1, n_taps):
        out.narrow(dim, n_taps - 1 - t, n).addcmul_(x, taps[n_taps - 1 - t])
    return out


def _block_view(buf: Tensor, row0: int, col0: int, n_blocks: int, step: int, n_rows: int, n_cols: int) -> Tensor:
    """View of ``buf[..., row0 + b·step + r, col0 + b·step + u]`` as (..., n_blocks, n_rows, n_cols).

    ``buf`` is contiguous (..., H, W); blocks at one level never overlap, so ``view += x`` is a plain scatter.
    """
    width = buf.shape[-1]
    lead_sizes, lead_strides = tuple(buf.shape[:-2]), tuple(buf.stride()[:-2])
    return buf.as_strided(lead_sizes + (n_blocks, n_rows, n_cols), lead_strides + (step * (width + 1), width, 1),
                          buf.storage_offset() + row0 * width + col0)


def _exp_(exponent: Tensor) -> Tensor:
    """In-place exp of exponents ≤ 0, clamped at log(smallest normal) + 1: below that exp() is subnormal or 0
    (a difference < 1e-37 relative), and computing it takes a ~10× slower path on CPU."""
    return exponent.clamp_(min=math.log(torch.finfo(exponent.dtype).tiny) + 1.0).exp_()


def _decay(sums: Tensor, a: Tensor, dtype: torch.dtype) -> Tensor:
    """exp(A · sums): (..., c) float64 sums of delta (≥ 0), a (c, N) -> (..., c, N) in ``dtype``."""
    return _exp_(sums.to(dtype)[..., None] * a)


# ----------------------------------------------------------------------------------------------------------------
# Full maps: recursive halving


@dataclass(frozen=True)
class _BlockBatch:
    """Equal-sized off-diagonal quadrants of one level, in leaf units.

    Block b has query leaves [q_start + b·step, + n_query) and key (S6 column) leaves [k_start + b·step, + n_key);
    the reference point is the last token of the key leaves, which end where the query leaves begin.
    """

    q_start: int
    k_start: int
    n_blocks: int
    step: int
    n_query: int
    n_key: int


def _level_plan(n_leaves: int) -> list:
    """All quadrants of the recursive halving of [0, n_leaves) leaves, grouped into equal-sized batches."""
    plan = []
    half = 1 << ((n_leaves - 1).bit_length() - 1) if n_leaves > 1 else 0  # top level: 2·half ≥ n_leaves
    while half >= 1:
        n_full = n_leaves // (2 * half)
        if n_full:
            plan.append(_BlockBatch(half, 0, n_full, 2 * half, half, half))
        lo = n_full * 2 * half
        if lo + half < n_leaves:  # the last block is cut by the end of the sequence: fewer query leaves
            plan.append(_BlockBatch(lo + half, lo, 1, 2 * half, n_leaves - lo - half, half))
        half //= 2
    return plan


def _leaf_view(x: Tensor, start: int, n_blocks: int, step: int, count: int) -> Tensor:
    """View leaves [start + b·step, + count) of x (B, n_leaves, ...) as (B, n_blocks, count, ...)."""
    sizes, strides = tuple(x.shape), x.stride()
    return x.as_strided((sizes[0], n_blocks, count) + sizes[2:], (strides[0], step * strides[1]) + strides[1:],
                        x.storage_offset() + start * strides[1])


class _Workspace:
    """Named flat buffers reused across chunks and levels (fresh MB-sized tensors cost page faults on CPU)."""

    def __init__(self, like: Tensor):
        self.like, self.buffers, self.zeroed = like, {}, {}

    def get(self, name: str, shape) -> Tensor:
        numel = math.prod(shape)
        if name not in self.buffers or self.buffers[name].numel() < numel:
            self.buffers[name] = self.like.new_empty(numel)
        return self.buffers[name][:numel].view(shape)

    def zeros(self, name: str, shape) -> Tensor:
        """A buffer zeroed when first made for (name, shape), then reused as is: callers must leave zero the part
        they rely on being zero."""
        key = (name, tuple(shape))
        if key not in self.zeroed:
            self.zeroed[key] = self.like.new_zeros(shape)
        return self.zeroed[key]


class _Blocked:
    """The padded inputs and float64 leaf sums shared by all channel chunks of one call."""

    def __init__(self, delta, A, B, C, row_weight, col_weight, conv_weight, leaf: Optional[int] = None,
                 value_weight: Optional[Tensor] = None):
        leaf = LEAF if leaf is None else leaf
        self.dtype = delta.dtype
        self.batch, self.length, self.channels = delta.shape
        self.state = A.shape[1]
        self.taps_k = 1 if conv_weight is None else conv_weight.shape[1]
        self.leaf = max(leaf, self.taps_k - 1)  # the K−1 conv spill columns must fit in one neighbouring leaf
        self.n_leaves = -(-self.length // self.leaf)
        self.padded = self.n_leaves * self.leaf
        pad = self.padded - self.length
        shape = (self.batch, self.n_leaves, self.leaf)
        # Padding has delta = B = C = 0, so padded rows and columns are zero and do not disturb the sums.
        self.A_t = A.T.contiguous()  # (N, D): operands are laid out (..., N, c), X = flattened (n, c)
        self.C = _pad_tokens(C, pad).view(*shape, self.state, 1)
        self.B = _pad_tokens(B, pad).view(*shape, self.state, 1)
        self.delta = _pad_tokens(delta, pad).view(*shape, self.channels)
        self.row = None if row_weight is None else _pad_tokens(row_weight, pad).view(*shape, self.channels)
        # column j of α_c·diag(col) carries delta_j col_j (formed per chunk: a full-size product costs page faults)
        self.col = None if col_weight is None else _pad_tokens(col_weight, pad).view(*shape, self.channels)
        self.conv = conv_weight
        self.conv_taps = None if conv_weight is None else conv_weight.T.contiguous()  # (K, D): unit-stride taps
        # value weights by accumulator column (output column + K − 1), zero outside [0, L): the conv'd keys of leaf ℓ
        # cover accumulator columns [ℓ·leaf, ℓ·leaf + leaf + K − 1)
        self.value = None
        if value_weight is not None:
            self.value = value_weight.new_zeros(self.batch, self.padded + self.leaf, self.channels)
            self.value[:, self.taps_k - 1:self.taps_k - 1 + self.length] = value_weight
        # prefix[:, ℓ] = Σ delta over leaves [0, ℓ), float64 (monotone, so differences are ≥ 0): (B, n_leaves+1, D)
        self.prefix = self.delta.new_zeros((self.batch, self.n_leaves + 1, self.channels), dtype=torch.float64)
        totals = self.prefix[:, 1:]
        totals.copy_(self.delta[:, :, 0])
        for t in range(1, self.leaf):  # (no float64 copy of the whole of delta)
            totals.add_(self.delta[:, :, t])
        totals.cumsum_(1)
        self.spill = 1 if self.taps_k > 1 else 0  # key cells per block beyond its own leaves (conv spill)
        self.buf_width = self.padded + self.spill * self.leaf  # accumulator column = output column + K − 1
        self.plan = _level_plan(self.n_leaves)
        self._plan_factor_sums()

    def _plan_factor_sums(self):
        """Σ delta of every level's per-leaf factors, all channels (B, rows, D), so one exp per chunk gives them all.

        Query leaf ℓ of a block whose query leaves start at q0 gets Σ delta over leaves [q0, ℓ); key leaf ℓ of a block
        whose key leaves end at q0 gets Σ delta over leaves (ℓ, q0): differences of the float64 prefix, rounded to
        the dtype. Factors of batch i are rows [offsets[i], + n·(n_query + n_key)): the queries' (n, n_query), then
        the keys'. Batches of one query and one key leaf have both factors exp(0) = 1: no rows, offset None.
        """
        self.factor_offsets, rows = [], 0
        for batch in self.plan:
            single = batch.n_query == batch.n_key == 1
            self.factor_offsets.append(None if single else rows)
            rows += 0 if single else batch.n_blocks * (batch.n_query + batch.n_key)
        self.factor_sums = sums = self.delta.new_empty(self.batch, rows, self.channels)
        for batch, offset in zip(self.plan, self.factor_offsets):
            if offset is None:
                continue
            n, nq, nk = batch.n_blocks, batch.n_query, batch.n_key
            q0 = _leaf_view(self.prefix, batch.q_start, n, batch.step, 1)  # (B, n, 1, D)
            torch.sub(_leaf_view(self.prefix, batch.q_start, n, batch.step, nq), q0,
                      out=sums[:, offset:offset + n * nq].view(self.batch, n, nq, self.channels))
            torch.sub(q0, _leaf_view(self.prefix, batch.k_start + 1, n, batch.step, nk),
                      out=sums[:, offset + n * nq:offset + n * (nq + nk)].view(self.batch, n, nk, self.channels))

    def _level_factors(self, c0: int, c1: int) -> Tensor:
        """All per-leaf level factors exp(A · Σ delta) ≤ 1 of channels [c0, c1): (B, rows, X), X = (N, chunk)."""
        return _exp_(self.factor_sums[..., None, c0:c1] * self.A_t[:, c0:c1]).flatten(2)

    # -- per chunk pieces ------------------------------------------------------------------------------------------

    def _chunk_operands(self, c0: int, c1: int, ws: _Workspace):
        """Leaf-relative queries and conv'd keys of channels [c0, c1), and the leaves' own maps.

        Returns queries (B, nl, leaf, X) = row_i C_i Π_{k=leafstart..i} a_k, keys (B, nl, leaf+K−1, X) =
        conv of Π_{k=j+1..leafend} a_k · delta_j col_j B_j within the leaf, and the diagonal leaf blocks per channel
        before the conv (B, nl, leaf, leaf, c), where a_k = exp(A delta_k) ≤ 1 (products of ≤ leaf factors:
        accurate and stable). X is the flattened (n, c) axis (channels innermost).
        """
        leaf = self.leaf
        shape = (self.batch, self.n_leaves, leaf, self.state, c1 - c0)
        decay = ws.get("decay", shape)
        torch.mul(self.delta[..., None, c0:c1], self.A_t[:, c0:c1], out=decay)
        _exp_(decay)  # a_k
        queries = ws.get("queries", shape)
        if self.row is None:
            queries.copy_(self.C.expand(shape))
        else:
            torch.mul(self.row[..., None, c0:c1], self.C, out=queries)
        keys = ws.get("keys", shape)
        col_scale = self.delta[..., None, c0:c1]
        if self.col is not None:
            col_scale = torch.mul(col_scale, self.col[..., None, c0:c1], out=ws.get("col_scale", col_scale.shape))
        torch.mul(col_scale, self.B, out=keys)
        keys, leaf_maps = self._leaf_maps(decay, queries, keys, ws)  # keys · Π_{k=j+1..leafend} a_k
        for t in range(1, leaf):  # decay[t] = Π_{k=leafstart..t} a_k (cheaper than cumprod_ along a strided axis)
            decay[:, :, t].mul_(decay[:, :, t - 1])
        queries.mul_(decay)
        if self.conv is not None:
            keys = _fold_conv(keys, self.conv_taps[:, c0:c1], 2,
                              out=ws.get("slab", (self.batch, self.n_leaves, leaf + self.taps_k - 1) + shape[3:]))
        if self.value is not None:
            keys.mul_(self._leaf_values(c0, c1)[:, :, :, None, :])
        return queries.flatten(3), keys.flatten(3), leaf_maps

    def _leaf_values(self, c0: int, c1: int) -> Tensor:
        """Value weights of the leaves' conv'd columns: (B, nl, leaf + K − 1, c), a strided view."""
        value = self.value[..., c0:c1]
        strides = value.stride()
        return value.as_strided((self.batch, self.n_leaves, self.leaf + self.taps_k - 1, c1 - c0),
                                (strides[0], self.leaf * strides[1], strides[1], strides[2]), value.storage_offset())

    def _folded_leaf_maps(self, leaf_maps: Tensor, c0: int, c1: int) -> Tensor:
        """The diagonal leaf blocks conv'd per channel and value-weighted: (B, nl, leaf, leaf + K − 1, c)."""
        taps = None if self.conv is None else self.conv_taps[:, c0:c1]
        folded = _fold_conv(leaf_maps, taps, dim=3)
        if self.value is not None:
            folded = folded * self._leaf_values(c0, c1)[:, :, None]
        return folded

    def _leaf_maps(self, decay: Tensor, queries: Tensor, keys: Tensor, ws: _Workspace):
        """Diagonal leaf blocks per channel by the scan inside each leaf, before the conv: (B, nl, leaf, leaf, c),
        and the keys relative to their leaf's end, keys_j · Π_{k=j+1..leafend} a_k: (B, nl, leaf, N, c), computed
        in place in ``keys``.

        α'_c[j + d, j] = Σ_n q_{j+d}[n, c] · Z_d[j][n, c] with Z_0 = keys and Z_d[j] = a_{j+d} · Z_{d−1}[j]
        (j < leaf − d); step d leaves Z[leaf − 1 − d] final, so the end result is the relative keys. The sum over n
        runs across contiguous channel rows.
        """
        leaf, (batch, n_leaves, _, _, channels) = self.leaf, queries.shape
        maps = ws.zeros("leaf_maps", (batch, n_leaves, leaf, leaf, channels))  # only j ≤ t is ever written
        products = ws.get("product", keys.shape)
        for d in range(leaf):
            carried = keys.narrow(2, 0, leaf - d)
            if d:
                carried.mul_(decay.narrow(2, d, leaf - d))
            product = torch.mul(queries.narrow(2, d, leaf - d), carried, out=products.narrow(2, 0, leaf - d))
            diagonal = maps.diagonal(-d, 2, 3).transpose(2, 3)  # (B, nl, leaf − d, c): maps[:, :, j + d, j]
            torch.sum(product, -2, out=diagonal)
        return keys, maps

    def _leaf_band(self) -> Tensor:
        """The conv of the leaf maps as one matrix per channel: (leaf, D, width), width = leaf + K − 1 rounded up
        to a multiple of 8 (narrow GEMMs of other widths run several times slower in MKL).

        Leaf column j feeds entry u (output column leafstart − (K−1) + u) with tap w[c, u − j], 0 ≤ u − j < K;
        entries u ≥ leaf + K − 1 are zero. So Σ_c of the conv'd leaf maps is one GEMM over (j, c).
        """
        leaf, taps_k = self.leaf, self.taps_k
        weight = self.delta.new_ones(self.channels, 1) if self.conv is None else self.conv
        width = -(-(leaf + taps_k - 1) // 8) * 8
        lag = torch.arange(width, device=weight.device)[None, :] - torch.arange(leaf, device=weight.device)[:, None]
        band = weight[:, lag.clamp(0, taps_k - 1)] * ((lag >= 0) & (lag < taps_k))  # (D, leaf, width)
        return band.transpose(0, 1).contiguous()

    def _block_operands(self, index: int, queries: Tensor, keys: Tensor, factors: Tensor, ws: _Workspace):
        """Queries (B·nb, n_query·leaf, X) and keys (B·nb, n_cols, X) of block batch ``index``.

        Query leaf ℓ is scaled by exp(A · Σ delta over the query leaves before ℓ), key leaf ℓ by
        exp(A · Σ delta over the key leaves after ℓ) (``factors``, from :meth:`_level_factors`): with the
        leaf-relative factors this is exp(A (S_i − S_r)) and exp(A (S_r − S_j)) for r the last key token. The sums
        are float64, both factors ≤ 1. Key column u of the block is output column k_start·leaf − (K−1) + u; key
        leaf ℓ's leaf + K − 1 conv'd columns start at its own first column, overlapping the next leaf's by K − 1.
        With one query and one key leaf both factors are 1 and the operands are views of ``queries``, ``keys``
        (n_cols = leaf + K − 1); otherwise n_cols = (n_key + spill)·leaf, the columns past the last leaf's K − 1
        zero (whole cells keep the GEMMs' widths multiples of 8, which MKL runs faster).
        """
        batch, offset, leaf = self.plan[index], self.factor_offsets[index], self.leaf
        n, step, nq, nk = batch.n_blocks, batch.step, batch.n_query, batch.n_key
        width, spill_cols = queries.shape[-1], keys.shape[2] - leaf  # the K − 1 conv columns past a leaf
        key_leaves = _leaf_view(keys, batch.k_start, n, step, nk)
        if offset is None:
            return (_leaf_view(queries, batch.q_start, n, step, 1).reshape(self.batch * n, leaf, width),
                    key_leaves.reshape(self.batch * n, leaf + spill_cols, width))
        n_cols = (nk + self.spill) * leaf
        q_factor = factors[:, offset:offset + n * nq].view(self.batch, n, nq, 1, width)
        k_factor = factors[:, offset + n * nq:offset + n * (nq + nk)].view(self.batch, n, nk, 1, width)
        level_q = ws.get("level_q", (self.batch, n, nq, leaf, width))
        torch.mul(_leaf_view(queries, batch.q_start, n, step, nq), q_factor, out=level_q)
        cells = ws.get("level_k", (self.batch, n, n_cols, width))
        main = cells[:, :, :nk * leaf].view(self.batch, n, nk, leaf, width)
        torch.mul(key_leaves[:, :, :, :leaf], k_factor, out=main)
        if spill_cols:  # key leaf ℓ's last K − 1 columns overlap leaf ℓ + 1's first ones (the last leaf's: the tail)
            tail = cells[:, :, nk * leaf:]
            torch.mul(key_leaves[:, :, nk - 1, leaf:], k_factor[:, :, nk - 1], out=tail[:, :, :spill_cols])
            tail[:, :, spill_cols:].zero_()
            if nk > 1:
                main[:, :, 1:, :spill_cols].addcmul_(key_leaves[:, :, :nk - 1, leaf:], k_factor[:, :, :nk - 1])
        return level_q.view(self.batch * n, nq * leaf, width), cells.view(self.batch * n, n_cols, width)

    def _scatter(self, buf: Tensor, batch: _BlockBatch, n_rows: int, n_cols: int) -> Tensor:
        """The view of accumulator ``buf`` (..., padded, buf_width) where a block batch's results go."""
        leaf = self.leaf
        return _block_view(buf, batch.q_start * leaf, batch.k_start * leaf, batch.n_blocks, batch.step * leaf,
                           n_rows, n_cols)

    # -- drivers ---------------------------------------------------------------------------------------------------

    def _chunks(self):
        """Channel chunks so that one (B, L, chunk·N) working tensor holds about _WORKING_ELEMENTS elements."""
        chunk = max(1, min(self.channels, _WORKING_ELEMENTS // (self.batch * self.padded * self.state)))
        return [(c0, min(self.channels, c0 + chunk)) for c0 in range(0, self.channels, chunk)]

    def _crop(self, buf: Tensor) -> Tensor:
        shift = self.taps_k - 1
        return buf[..., :self.length, shift:shift + self.length]

    def maps(self, reduce) -> Tensor:
        if reduce in ("mean", "sum"):
            return self._reduced_maps(reduce)
        return self._channel_maps(reduce)

    def _reduced_maps(self, reduce) -> Tensor:
        """Σ_c (or mean_c) of H_c: GEMMs over the flattened (n, c) axis, accumulated over channel chunks."""
        leaf, ws = self.leaf, _Workspace(self.delta)
        band = self._leaf_band()
        leaf_acc = self.delta.new_zeros(self.batch * self.n_leaves * leaf, band.shape[-1])  # Σ_c conv'd leaf maps
        block_acc = [None] * len(self.plan)  # one contiguous accumulator per block batch: GEMMs with beta = 1
        for c0, c1 in self._chunks():
            queries, keys, leaf_maps = self._chunk_operands(c0, c1, ws)
            if self.value is None:  # Σ_c of the conv'd leaf maps is one GEMM over (j, c) with the band
                inner = leaf * (c1 - c0)
                leaf_acc.addmm_(leaf_maps.view(-1, inner), band[:, c0:c1].reshape(inner, -1))
            else:  # value weights differ per leaf and column: conv and weight per channel, then sum
                folded = self._folded_leaf_maps(leaf_maps, c0, c1).sum(-1)
                leaf_acc[:, :folded.shape[-1]] += folded.reshape(-1, folded.shape[-1])
            factors = self._level_factors(c0, c1)
            for index in range(len(self.plan)):
                level_q, level_k = self._block_operands(index, queries, keys, factors, ws)
                if block_acc[index] is None:
                    block_acc[index] = torch.bmm(level_q, level_k.mT)
                else:
                    block_acc[index].baddbmm_(level_q, level_k.mT)
        buf = self.delta.new_zeros(self.batch, self.padded, self.buf_width)
        n_cols = leaf + self.taps_k - 1
        leaf_acc = leaf_acc.view(self.batch, self.n_leaves, leaf, -1)[..., :n_cols]
        _block_view(buf, 0, 0, self.n_leaves, leaf, leaf, n_cols).copy_(leaf_acc)
        for batch, acc in zip(self.plan, block_acc):
            n_rows, n_cols = acc.shape[-2:]
            self._scatter(buf, batch, n_rows, n_cols).add_(acc.view(self.batch, batch.n_blocks, n_rows, n_cols))
        if reduce == "mean":  # in place: a fresh (B, L, L) quotient of the strided crop costs a slow extra pass
            buf.div_(self.channels)
        return self._crop(buf).contiguous()

    def _channel_maps(self, reduce) -> Tensor:
        """Per-channel H_c (reduce None) or mean_c |H_c| ("abs_mean"): per-channel GEMMs (inner dimension N)."""
        leaf, length, ws = self.leaf, self.length, _Workspace(self.delta)
        if reduce is None:
            out = self.delta.new_empty(self.batch, self.channels, length, length)
        else:
            out = self.delta.new_zeros(self.batch, length, length)
        # Channel blocks sized by the per-channel accumulator (B, chunk, L, L + leaf).
        chunk = max(1, min(self.channels, _CHANNEL_BLOCK_ELEMENTS // (self.batch * self.padded * self.buf_width)))
        block = self.delta.new_empty(self.batch, chunk, self.padded, self.buf_width)  # reused: stays in cache
        for c0 in range(0, self.channels, chunk):
            c1 = min(self.channels, c0 + chunk)
            buf = block[:, :c1 - c0].zero_()
            queries, keys, leaf_maps = self._chunk_operands(c0, c1, ws)
            leaf_maps = self._folded_leaf_maps(leaf_maps, c0, c1).permute(0, 4, 1, 2, 3)  # (B, c, nl, leaf, leaf+K−1)
            _block_view(buf, 0, 0, self.n_leaves, leaf, leaf, leaf_maps.shape[-1]).copy_(leaf_maps)
            factors = self._level_factors(c0, c1)
            for index, batch in enumerate(self.plan):
                level_q, level_k = self._block_operands(index, queries, keys, factors, ws)
                n_rows, n_cols = level_q.shape[1], level_k.shape[1]
                level_q = level_q.reshape(self.batch, batch.n_blocks, n_rows, self.state, c1 - c0)
                level_k = level_k.reshape(self.batch, batch.n_blocks, n_cols, self.state, c1 - c0)
                self._scatter(buf, batch, n_rows, n_cols).add_(torch.einsum("bxinc,bxjnc->bcxij", level_q, level_k))
            if reduce is None:
                out[:, c0:c1] = self._crop(buf)
            else:
                out += self._crop(buf.abs_()).sum(1)
        if reduce == "abs_mean":
            out /= self.channels
        return out


# ----------------------------------------------------------------------------------------------------------------
# Selected rows: direct formula


def _rows_work(rows: Tensor) -> int:
    """Σ over the direct path's row blocks of (rows in the block) × (columns it computes)."""
    unique = torch.unique(rows, sorted=True).tolist()
    return sum(len(unique[r0:r0 + _ROWS_PER_BLOCK]) * (unique[min(r0 + _ROWS_PER_BLOCK, len(unique)) - 1] + 1)
               for r0 in range(0, len(unique), _ROWS_PER_BLOCK))


def _rows_direct(delta, A, B, C, row_weight, col_weight, conv_weight, rows: Tensor, reduce,
                 value_weight: Optional[Tensor] = None) -> Tensor:
    """Rows ``rows`` of the maps by the direct formula: cost Σ_r (rows[r] + 1)·D·N, in blocks of rows and channels.

    Distinct rows are computed once, in sorted blocks limited to the columns j ≤ the block's last row.
    """
    dtype = delta.dtype
    batch, length, channels = delta.shape
    state = A.shape[1]
    unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    cumsum = delta.double().cumsum(1)
    col_scale = delta if col_weight is None else delta * col_weight
    n_unique = unique.numel()
    out = delta.new_zeros((batch, channels, n_unique, length) if reduce is None else (batch, n_unique, length))
    for r0 in range(0, n_unique, _ROWS_PER_BLOCK):
        block = unique[r0:r0 + _ROWS_PER_BLOCK]
        r1, n_cols = r0 + block.numel(), int(block[-1]) + 1  # columns j > every row of the block are 0
        causal = (block[:, None] >= torch.arange(n_cols, device=delta.device)[None, :]).to(dtype)  # (r, j)
        cb = C[:, block, None, :] * B[:, None, :n_cols, :]  # (B, r, j, N): C_i[n] B_j[n]
        chunk = max(1, min(channels, _ROWS_CHUNK_ELEMENTS // (batch * block.numel() * n_cols * state)))
        for c0 in range(0, channels, chunk):
            c1 = min(channels, c0 + chunk)
            seg = (cumsum[:, block, None, c0:c1] - cumsum[:, None, :n_cols, c0:c1]).clamp_(min=0)  # (B, r, j, c)
            maps = torch.einsum("brjcn,brjn->brjc", _decay(seg, A[c0:c1], dtype), cb)
            maps *= col_scale[:, None, :n_cols, c0:c1] * causal[None, :, :, None]
            if row_weight is not None:
                maps *= row_weight[:, block, None, c0:c1]
            if conv_weight is not None:  # output column s = Σ_t w[K-1-t] · maps[s+t]; drop the K−1 leading columns
                maps = _fold_conv(maps, conv_weight[c0:c1].T, dim=2)[:, :, conv_weight.shape[1] - 1:]
            if value_weight is not None:
                maps *= value_weight[:, None, :n_cols, c0:c1]
            if reduce is None:
                out[:, c0:c1, r0:r1, :n_cols] = maps.permute(0, 3, 1, 2)
            elif reduce == "abs_mean":
                out[:, r0:r1, :n_cols] += maps.abs().sum(-1)
            else:
                out[:, r0:r1, :n_cols] += maps.sum(-1)
    if reduce in ("mean", "abs_mean"):
        out /= channels
    return out[:, :, inverse] if reduce is None else out[:, inverse]
