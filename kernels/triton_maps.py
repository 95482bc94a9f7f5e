"""One Triton kernel for every channel-decay implicit-attention map (Mamba-1, Mamba-2/SSD, RWKV-4 WKV, RG-LRU).

Shapes: B batch, L tokens, C channels, Hs decay heads (a channel c reads head ``c // P``), G groups (a head h
reads group ``h // HPG``), N state size, K conv taps, R query rows. For channel c, head h, group g:

    α_c[i, j] = Σ_n CQ[i, g, n] · BK[j, g, n] · exp(A[h, n] · (S[i, h] − S[j, h]) + LQ[i, c] + LK[j, c])  (j < i)
    α_c[i, i] = exp(LDIAG[i, c]) when LDIAG is given, else the formula above with j = i;  0 for j > i
    H_c       = diag(ROW[:, c]) · α_c · diag(COL[:, c]) · M_c     (M_c[t, s] = CONV[c, K−1−(t−s)], 0 ≤ t−s < K)

S is a float64 cumulative sum (a state reset adds a jump of 1e6 to it, which zeroes α across it); every exponent
is formed in float64 and only its exp taken in float32. The family wrappers (``selective/triton.py``,
``ssd/triton.py``, ``decay/triton.py``) map their inputs onto these.

Algorithm, per program = (tile of R query rows, tile of BJ output columns, batch element), like the blocked torch
kernels (DESIGN §5): with r the tile's smallest query row, when every S6 column j the tile reads
(s0 … s0+BJ+K−2) lies before r, ``exp(e_ij) = exp(e_ir + m) · exp(e_rj − m)`` and the channel-reduced tile is
``Σ_chunks tl.dot(queries (BI, X), keys (X, BJ))`` over the flattened (channel, n) axis X, the conv folded into
the keys by K shifted loads. m is the largest key exponent of the tile per (c, n), so the key factor is ≤ 1 and
the query factor is the largest α over the tile (≤ 1 for Mamba's decays ≤ 1, RWKV's normalised rows and RG-LRU's
gates ≤ 1): nothing overflows. Tiles touching the diagonal use the direct formula per channel. ``abs_mean`` and
``reduce=None`` use per-channel dots (inner dimension N). Products use ``tl.dot(..., input_precision=...)``:
"ieee" (default, fp32-exact) or "tf32" (faster on tensor cores, ~1e-3 relative).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

try:  # Triton is a dependency on Linux; keep the library importable where it is not.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

RESET_JUMP = 1.0e6  # added to S at a state reset: exp(A · jump) = 0 for any decay rate |A| ≥ 1e-4
MODES = {"sum": 0, "mean": 0, "abs_mean": 1, None: 2}
PRECISIONS = ("ieee", "tf32")


def triton_available() -> bool:
    """True when Triton is importable (CUDA tensors, or any tensor under ``TRITON_INTERPRET=1``)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _key_exponent(S, LK, b, j, ok, chan, head, a, s_r, L, C, Hs, HAS_LK: tl.constexpr):
        """(X, BJ) float64 exponents A·(S_r − S_j) + LK_j of the S6 columns j, before the tile's max is taken out."""
        e = a[:, None] * (s_r[:, None] - tl.load(S + (b * L + j[None, :]) * Hs + head[:, None], mask=ok, other=0.0))
        if HAS_LK:
            e += tl.load(LK + (b * L + j[None, :]) * C + chan[:, None], mask=ok, other=0.0)
        return e

    @triton.jit
    def _gemm_factors(S, A, CQ, BK, LQ, LK, ROW, COL, CONV, b, i, q_ok, r, s, chan, n, x_ok, L, C, Hs, G, N, P,
                      HPG, K: tl.constexpr, HAS_CB: tl.constexpr, HAS_LQ: tl.constexpr, HAS_LK: tl.constexpr,
                      HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr, HAS_CONV: tl.constexpr):
        """Queries (BI, X) and conv-folded keys (X, BJ) of a tile whose S6 columns all precede row r."""
        head = chan // P
        group = head // HPG
        s_r = tl.load(S + (b * L + r) * Hs + head, mask=x_ok, other=0.0)
        a = tl.load(A + head * N + n, mask=x_ok, other=0.0).to(tl.float64)
        # m: the largest key exponent over the tile's S6 columns, per (channel, n), so that keys are ≤ 1
        m = tl.full(s_r.shape, float("-inf"), tl.float64)
        for t in tl.static_range(K):
            j = s + t
            ok = x_ok[:, None] & (j < L)[None, :]
            e = _key_exponent(S, LK, b, j, ok, chan, head, a, s_r, L, C, Hs, HAS_LK)
            m = tl.maximum(m, tl.max(tl.where(ok, e, float("-inf")), axis=1))
        m = tl.where(m == float("-inf"), 0.0, m)
        keys = tl.zeros((s_r.shape[0], s.shape[0]), dtype=tl.float32)
        for t in tl.static_range(K):
            j = s + t
            ok = x_ok[:, None] & (j < L)[None, :]
            e = _key_exponent(S, LK, b, j, ok, chan, head, a, s_r, L, C, Hs, HAS_LK)
            k = tl.where(ok, tl.exp(tl.where(ok, e - m[:, None], 0.0).to(tl.float32)), 0.0)
            if HAS_CB:
                k *= tl.load(BK + ((b * L + j[None, :]) * G + group[:, None]) * N + n[:, None], mask=ok, other=0.0)
            if HAS_COL:
                k *= tl.load(COL + (b * L + j[None, :]) * C + chan[:, None], mask=ok, other=0.0)
            if HAS_CONV:
                k *= tl.load(CONV + chan * K + (K - 1 - t), mask=x_ok, other=0.0)[:, None]
            keys += k
        ok = q_ok[:, None] & x_ok[None, :]
        s_i = tl.load(S + (b * L + i[:, None]) * Hs + head[None, :], mask=ok, other=0.0)
        e = a[None, :] * (s_i - s_r[None, :]) + m[None, :]
        if HAS_LQ:
            e += tl.load(LQ + (b * L + i[:, None]) * C + chan[None, :], mask=ok, other=0.0)
        queries = tl.where(ok, tl.exp(tl.where(ok, e, 0.0).to(tl.float32)), 0.0)  # masked lanes: no inf
        if HAS_CB:
            queries *= tl.load(CQ + ((b * L + i[:, None]) * G + group[None, :]) * N + n[None, :], mask=ok, other=0.0)
        if HAS_ROW:
            queries *= tl.load(ROW + (b * L + i[:, None]) * C + chan[None, :], mask=ok, other=0.0)
        return queries, keys

    @triton.jit
    def _direct_tile(S, A, CQ, BK, LQ, LK, LDIAG, ROW, COL, CONV, b, i, q_ok, s, c, L, C, Hs, G, N, P, HPG,
                     K: tl.constexpr, NP: tl.constexpr, HAS_CB: tl.constexpr, HAS_LQ: tl.constexpr,
                     HAS_LK: tl.constexpr, HAS_LDIAG: tl.constexpr, HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
                     HAS_CONV: tl.constexpr, SHARED_RATE: tl.constexpr, PRECISION: tl.constexpr):
        """(BI, BJ) map of channel c by the direct formula (tiles that touch the diagonal)."""
        head = c // P
        group = head // HPG
        n = tl.arange(0, NP)
        n_ok = n < N
        a = tl.load(A + head * N + n, mask=n_ok, other=0.0).to(tl.float64)
        s_i = tl.load(S + (b * L + i) * Hs + head, mask=q_ok, other=0.0)
        if HAS_LQ:
            lq = tl.load(LQ + (b * L + i) * C + c, mask=q_ok, other=0.0)
        if HAS_CB:
            cq = tl.load(CQ + ((b * L + i[:, None]) * G + group) * N + n[None, :], mask=q_ok[:, None] & n_ok[None, :],
                         other=0.0)
        if HAS_LDIAG:
            diag_value = tl.exp(tl.load(LDIAG + (b * L + i) * C + c, mask=q_ok, other=0.0).to(tl.float32))
        tile = tl.zeros((i.shape[0], s.shape[0]), dtype=tl.float32)
        for t in tl.static_range(K):
            j = s + t
            j_ok = j < L
            s_j = tl.load(S + (b * L + j) * Hs + head, mask=j_ok, other=0.0)
            pair_ok = q_ok[:, None] & j_ok[None, :]
            if HAS_LDIAG:
                valid = pair_ok & (j[None, :] < i[:, None])
            else:
                valid = pair_ok & (j[None, :] <= i[:, None])
            if HAS_CB:
                bk = tl.load(BK + ((b * L + j[:, None]) * G + group) * N + n[None, :],
                             mask=j_ok[:, None] & n_ok[None, :], other=0.0)
            if SHARED_RATE:  # one rate for every n (SSD, WKV, RG-LRU): (C·Bᵀ) ∘ decay
                e = tl.sum(tl.where(n == 0, a, 0.0), axis=0) * (s_i[:, None] - s_j[None, :])
                if HAS_LQ:
                    e += lq[:, None]
                if HAS_LK:
                    e += tl.load(LK + (b * L + j) * C + c, mask=j_ok, other=0.0)[None, :]
                alpha = tl.where(valid, tl.exp(tl.where(valid, e, 0.0).to(tl.float32)), 0.0)
                if HAS_CB:
                    if NP >= 16:
                        alpha *= tl.dot(cq, tl.trans(bk), input_precision=PRECISION)
                    else:
                        alpha *= tl.sum(cq[:, None, :] * bk[None, :, :], axis=2)
            else:  # a rate per n (Mamba-1): the n-sum is inside the exponential's sum
                e = a[None, None, :] * (s_i[:, None, None] - s_j[None, :, None])
                if HAS_LQ:
                    e += lq[:, None, None]
                if HAS_LK:
                    e += tl.load(LK + (b * L + j) * C + c, mask=j_ok, other=0.0)[None, :, None]
                valid3 = valid[:, :, None] & n_ok[None, None, :]
                v = tl.where(valid3, tl.exp(tl.where(valid3, e, 0.0).to(tl.float32)), 0.0)
                if HAS_CB:
                    v *= cq[:, None, :] * bk[None, :, :]
                alpha = tl.sum(v, axis=2)
            if HAS_LDIAG:
                alpha += tl.where(pair_ok & (j[None, :] == i[:, None]), diag_value[:, None], 0.0)
            if HAS_COL:
                alpha *= tl.load(COL + (b * L + j) * C + c, mask=j_ok, other=0.0)[None, :]
            if HAS_CONV:
                alpha *= tl.load(CONV + c * K + (K - 1 - t))
            tile += alpha
        if HAS_ROW:
            tile *= tl.load(ROW + (b * L + i) * C + c, mask=q_ok, other=0.0)[:, None]
        return tile

    @triton.jit
    def _channel_decay_maps_kernel(
            S, A, CQ, BK, LQ, LK, LDIAG, ROW, COL, CONV, ROWS, OUT, L, R, C, Hs, G, N, P, HPG,
            K: tl.constexpr, NP: tl.constexpr, BCH: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr,
            HAS_CB: tl.constexpr, HAS_LQ: tl.constexpr, HAS_LK: tl.constexpr, HAS_LDIAG: tl.constexpr,
            HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr, HAS_CONV: tl.constexpr, SHARED_RATE: tl.constexpr,
            MODE: tl.constexpr, PRECISION: tl.constexpr):
        """One (BI query rows) × (BJ output columns) tile of batch element program_id(2); OUT is zero-filled."""
        b = tl.program_id(2).to(tl.int64)
        q = tl.program_id(1) * BI + tl.arange(0, BI)
        q_ok = q < R
        i = tl.load(ROWS + q, mask=q_ok, other=0)
        r_min = tl.min(tl.where(q_ok, i, L), axis=0)
        r_max = tl.max(tl.where(q_ok, i, -1), axis=0)
        s0 = tl.program_id(0) * BJ
        s = s0 + tl.arange(0, BJ)
        s_ok = s < L
        out_ok = q_ok[:, None] & s_ok[None, :]
        acc = tl.zeros((BI, BJ), dtype=tl.float32)
        if s0 <= r_max:  # otherwise every S6 column j ≥ s lies after every row: the tile stays 0
            if s0 + BJ + K - 2 < r_min:
                if MODE == 0:
                    x = tl.arange(0, BCH * NP)
                    for c0 in range(0, C, BCH):
                        chan = c0 + x // NP
                        n = x % NP
                        queries, keys = _gemm_factors(S, A, CQ, BK, LQ, LK, ROW, COL, CONV, b, i, q_ok, r_min, s,
                                                      chan, n, (chan < C) & (n < N), L, C, Hs, G, N, P, HPG, K,
                                                      HAS_CB, HAS_LQ, HAS_LK, HAS_ROW, HAS_COL, HAS_CONV)
                        acc += tl.dot(queries, keys, input_precision=PRECISION)
                else:
                    n = tl.arange(0, NP)
                    for c in range(0, C):
                        queries, keys = _gemm_factors(S, A, CQ, BK, LQ, LK, ROW, COL, CONV, b, i, q_ok, r_min, s,
                                                      c + n * 0, n, n < N, L, C, Hs, G, N, P, HPG, K, HAS_CB,
                                                      HAS_LQ, HAS_LK, HAS_ROW, HAS_COL, HAS_CONV)
                        if NP >= 16:
                            tile = tl.dot(queries, keys, input_precision=PRECISION)
                        else:
                            tile = tl.sum(queries[:, :, None] * keys[None, :, :], axis=1)
                        if MODE == 1:
                            acc += tl.abs(tile)
                        else:
                            tl.store(OUT + ((b * C + c) * R + q[:, None]) * L + s[None, :], tile, mask=out_ok)
            else:
                for c in range(0, C):
                    tile = _direct_tile(S, A, CQ, BK, LQ, LK, LDIAG, ROW, COL, CONV, b, i, q_ok, s, c, L, C, Hs, G,
                                        N, P, HPG, K, NP, HAS_CB, HAS_LQ, HAS_LK, HAS_LDIAG, HAS_ROW, HAS_COL,
                                        HAS_CONV, SHARED_RATE, PRECISION)
                    if MODE == 0:
                        acc += tile
                    elif MODE == 1:
                        acc += tl.abs(tile)
                    else:
                        tl.store(OUT + ((b * C + c) * R + q[:, None]) * L + s[None, :], tile, mask=out_ok)
            if MODE != 2:
                tl.store(OUT + (b * R + q[:, None]) * L + s[None, :], acc, mask=out_ok)


def channel_decay_maps_triton(S: Tensor, A: Tensor, *, CQ: Optional[Tensor] = None, BK: Optional[Tensor] = None,
                              LQ: Optional[Tensor] = None, LK: Optional[Tensor] = None,
                              LDIAG: Optional[Tensor] = None, row_weight: Optional[Tensor] = None,
                              col_weight: Optional[Tensor] = None, conv_weight: Optional[Tensor] = None,
                              channels_per_head: int = 1, heads_per_group: int = 1, shared_rate: bool = False,
                              rows: Optional[Tensor] = None,
                              reduce: Optional[str] = "mean", precision: str = "ieee", block: int = 32) -> Tensor:
    """Launch the kernel of the module docstring.

    Args:
        S: (B, L, Hs) float64 cumulative decay (resets already added).  A: (Hs, N) decay rates.
        CQ, BK: (B, L, G, N) or None (1; then N must be 1).  LQ, LK, LDIAG: (B, L, C) or None.
        row_weight, col_weight: (B, L, C) or None.  conv_weight: (C, K) or None.
        channels_per_head: P (C = Hs · P).  heads_per_group: HPG (Hs = G · HPG).
        shared_rate: A[h, n] is the same for every n (SSD, WKV, RG-LRU): diagonal tiles use (C·Bᵀ) ∘ decay.
        rows: (R,) int64 or None.
        reduce: "mean" | "sum" | "abs_mean" | None.  precision: "ieee" (fp32-exact) | "tf32".
    Returns:
        float32 (B, R, L) reduced or (B, C, R, L) per channel (R = L without ``rows``), on S's device.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed: pip install triton (or use the blocked torch kernels)")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if reduce not in MODES:
        raise ValueError(f"reduce must be one of {tuple(MODES)}, got {reduce!r}")
    batch, length, heads = S.shape
    state = A.shape[1]
    channels = heads * channels_per_head
    groups = 1 if CQ is None else CQ.shape[2]
    if CQ is None and state != 1:
        raise ValueError(f"without CQ/BK the state size must be 1, got A of shape {tuple(A.shape)}")
    device = S.device
    if rows is None:
        rows = torch.arange(length, device=device)
    rows = rows.to(device=device, dtype=torch.int64).contiguous()
    n_rows = rows.numel()

    def prep(t, dtype):
        return None if t is None else t.to(device=device, dtype=dtype).contiguous()

    dummy = torch.empty(1, device=device, dtype=torch.float32)
    f32, f64 = torch.float32, torch.float64
    args = [prep(S, f64), prep(A, f32), prep(CQ, f32), prep(BK, f32), prep(LQ, f64), prep(LK, f64),
            prep(LDIAG, f64), prep(row_weight, f32), prep(col_weight, f32), prep(conv_weight, f32)]
    flags = [t is not None for t in args[2:]]
    args = [dummy if t is None else t for t in args]
    mode = MODES[reduce]
    shape = (batch, n_rows, length) if mode != 2 else (batch, channels, n_rows, length)
    out = torch.zeros(shape, device=device, dtype=f32)
    if n_rows == 0 or length == 0 or channels == 0:
        return out
    taps = 1 if conv_weight is None else conv_weight.shape[1]
    state_pow2 = triton.next_power_of_2(state)
    channels_per_chunk = max(1, 64 // state_pow2)
    grid = (triton.cdiv(length, block), triton.cdiv(n_rows, block), batch)
    _channel_decay_maps_kernel[grid](
        *args, rows, out, length, n_rows, channels, heads, groups, state, channels_per_head, heads_per_group,
        K=taps, NP=state_pow2, BCH=channels_per_chunk, BI=block, BJ=block, HAS_CB=flags[0], HAS_LQ=flags[2],
        HAS_LK=flags[3], HAS_LDIAG=flags[4], HAS_ROW=flags[5], HAS_COL=flags[6], HAS_CONV=flags[7], SHARED_RATE=shared_rate, MODE=mode,
        PRECISION=precision)
    if reduce in ("mean", "abs_mean"):
        out /= channels
    return out
