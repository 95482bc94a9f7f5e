"""The DPLR recurrence by the chunked WY (UT) form, as flash-linear-attention's ``chunk_dplr_delta_rule``; plain
torch, so autograd gives the gradients of every input (q, k, v, a, b, log_decay, initial_state).

Recurrence and conventions: :mod:`.naive` (``S_t = D_t S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ``,
``o_t = scale · S_tᵀ q_t``). Within a chunk of C tokens entered with the state S_0, with the in-chunk cumulative
log decays Γ_i = Σ_{r≤i} g_r (per key channel, ≤ 0; Γ_{i−1} = 0 for i = 1) and the low-rank pseudo-values
``u_i = a_iᵀ S_{i−1}`` (1 × V), the state is ``S_i = e^{Γ_i} S_0 + Σ_{j≤i} e^{Γ_i − Γ_j} (b_j u_j + k_j v_jᵀ)``
(e^{…} diagonal over the key channels), so u solves the unit lower-triangular system::

    (I − A_ab) u = (e^{Γ_{i−1}} a) S_0 + A_ak v,      A_xy[i, j] = x_iᵀ e^{Γ_{i−1} − Γ_j} y_j  (j < i)

that is ``u = W S_0 + M v`` with ``W = (I − A_ab)⁻¹ e^{Γ_{i−1}} a`` and ``M = (I − A_ab)⁻¹ A_ak``. With
``A_qy[i, j] = q_iᵀ e^{Γ_i − Γ_j} y_j`` (j ≤ i) every chunk reduces to four state-free operators::

    o = Q S_0 + P v,        S_next = T S_0 + G v
    Q = e^{Γ} q + A_qb W (C × K),   P = A_qk + A_qb M (C × C),   T = e^{Γ_C} + (e^{Γ_C − Γ} b)ᵀ W (K × K),
    G = (e^{Γ_C − Γ} k)ᵀ + (e^{Γ_C − Γ} b)ᵀ M (K × C)

(q already multiplied by scale). They are formed for all chunks at once; only the hand-over of the state is
sequential (one K × K by K × V product per chunk), and P is the diagonal block of the operator α (``o = α v``).

Stability: the pairwise products A_xy need e^{Γ_i − Γ_j} per key channel. The chunk is cut into sub-chunks of s
tokens; for a pair in sub-chunks I > J the factor is split at the sub-chunk borders,
``e^{Γ_i − ρ_I} · e^{ρ_I − ρ_{J+1}} · e^{ρ_{J+1} − Γ_j}`` with ρ_I = Γ just before sub-chunk I: three factors
≤ 1, so those products are GEMMs and nothing overflows. Pairs within one sub-chunk are one GEMM of
``e^{Γ_i − ρ_I} q_i`` (≥ e^{−span}) and ``e^{ρ_I − Γ_j} k_j`` (≤ e^{span}) when the sub-chunk's largest decay
``span = max (ρ_I − Γ_end)`` is far from the dtype's overflow (``_FACTORED_SPAN``): s is the largest of C, C/2,
C/4, … ≥ ``sub_chunk`` for which that holds (for RWKV-7, |g| < 0.61: s = C = 64). Otherwise s = ``sub_chunk`` and
the pairs within a sub-chunk are formed pairwise (an s × s × K tensor). Every other exponent (Γ_i, Γ_{i−1},
Γ_C − Γ_j) is ≤ 0, masked entries are −∞ before the exponential, and cumulative sums, their differences and the
exponentials are formed in float64 (one rounding to the compute dtype), so log decays of any magnitude (−30 per
token and beyond) give the recurrence's result to rounding. A sequence whose length is not a multiple of C is padded
with tokens of q = k = v = a = b = g = 0, which leave the state as it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .naive import prepare_inputs

CHUNK_SIZE = 32  # the fastest on CPU for K = 64 (benchmarks/bench_dplr.py), with RWKV-7's decays one GEMM per chunk
SUB_CHUNK = 16
# The largest decay across one sub-chunk (max of Γ_{start} − Γ_{end}) for which its pairs are formed as one GEMM of
# factors e^{Γ_i − ρ} ≥ e^{−span} and e^{ρ − Γ_j} ≤ e^{span}: far from the dtype's overflow and underflow (float32:
# e^{±88}), with room for the magnitudes of q, k, a, b. Above it they are formed pairwise.
_FACTORED_SPAN = {torch.float32: 60.0, torch.float64: 600.0}


def _chunks(x, size):
    """(B, H, L, ·) → (B, H, N, size, ·), zero-padded to N · size tokens."""
    pad = -x.shape[2] % size
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:2], -1, size, x.shape[-1])


def _cumulative_chunks(log_decay, size):
    """Γ (B, H, N, C, K) float64: the cumulative log decays within each chunk, from log_decay (B, H, L, K)."""
    return _chunks(log_decay.to(torch.float64), size).cumsum(3)


def _span(cumulative, sub):
    """The largest decay across one sub-chunk of ``sub`` tokens: max of Γ_{start} − Γ_{end} (≥ 0), a float."""
    if cumulative.numel() == 0:
        return 0.0
    cumulative = cumulative.detach()
    exclusive = F.pad(cumulative[..., :-1, :], (0, 0, 1, 0))
    return float((exclusive[..., ::sub, :] - cumulative[..., sub - 1::sub, :]).max())


def _plan(cumulative, size, sub, dtype):
    """(s, factored): the largest sub-chunk s = C, C/2, C/4, … ≥ ``sub`` whose span is within the dtype's bound
    (its pairs one GEMM of bounded factors), else s = ``sub`` (C when it does not divide C) with pairs formed
    pairwise."""
    bound = _FACTORED_SPAN.get(dtype, _FACTORED_SPAN[torch.float32])
    candidate = size
    while True:
        if _span(cumulative, candidate) <= bound:
            return candidate, True
        if candidate % 2 or candidate // 2 < sub:
            break
        candidate //= 2
    return (sub if size % sub == 0 else size), False


def _pair_products(q, k, a, b, cumulative, sub, factored, dtype):
    """The chunk's pairwise products A_qk, A_qb (j ≤ i) and A_ak, A_ab (j < i), each (…, C, C).

    q, k, a, b: (…, C, K) in ``dtype``; cumulative Γ: (…, C, K) float64; sub: the sub-chunk size s (divides C);
    factored: whether pairs within a sub-chunk are one GEMM (see :func:`_plan`) or formed pairwise.
    """
    size, dim = q.shape[-2:]
    blocks = size // sub
    batch_shape = q.shape[:-2]
    blocked = lambda x: x.reshape(*batch_shape, blocks, sub, dim)  # noqa: E731
    exclusive = F.pad(cumulative[..., :-1, :], (0, 0, 1, 0))  # Γ_{i−1}
    start = exclusive[..., ::sub, :]  # ρ_I = Γ just before sub-chunk I: (…, n, K)
    end = cumulative[..., sub - 1::sub, :]  # Γ at the last token of sub-chunk J = ρ_{J+1}
    local = blocked(cumulative) - start[..., None, :]  # Γ_i − ρ_I ≤ 0, float64
    local_exclusive = blocked(exclusive) - start[..., None, :]  # Γ_{i−1} − ρ_I ≤ 0
    factor = lambda exponent: exponent.exp().to(dtype)  # noqa: E731  (exp in float64: one rounding)
    lefts = torch.stack([blocked(q) * factor(local), blocked(a) * factor(local_exclusive)], dim=-3)  # (…, n, 2, s, K)
    rights = torch.stack([blocked(k), blocked(b)], dim=-3)  # (…, n, 2, s, K)

    # within a sub-chunk
    position = torch.arange(sub, device=q.device)
    masks = torch.stack([position[:, None] >= position[None, :], position[:, None] > position[None, :]])  # x, i, j
    if factored:
        # e^{Γ_i − ρ_I} · e^{ρ_I − Γ_j}: the second factor is at most e^{span}, safe in this dtype; one GEMM
        raised = rights * factor(-local)[..., None, :, :]
        within = lefts.reshape(*batch_shape, blocks, 2 * sub, dim) @ \
            raised.reshape(*batch_shape, blocks, 2 * sub, dim).transpose(-1, -2)
        within = within.reshape(*batch_shape, blocks, 2, sub, 2, sub).masked_fill(~masks[:, :, None, :], 0.0)
    else:
        # pairwise exponents Γ_i − Γ_j (s × s × K per sub-chunk, float64), masked before the exponential
        exponent = torch.stack([local, local_exclusive], dim=-3)[..., :, None, :] - local[..., None, None, :, :]
        raw_lefts = torch.stack([blocked(q), blocked(a)], dim=-3)[..., None, :]  # (…, n, 2, s, 1, K)
        weighted = raw_lefts * factor(exponent.masked_fill(~masks[..., None], float("-inf")))
        within = torch.einsum("...xijk,...yjk->...xiyj", weighted, rights)  # (…, n, 2, s, 2, s)
    if blocks == 1:
        products = within[..., None, :]  # (…, 1, 2, s, 2, 1, s)
    else:  # on the diagonal blocks: (…, n_I, 2, s, 2, n_J, s)
        products = torch.diag_embed(within.movedim(-5, -1), dim1=-6, dim2=-2)

    if blocks > 1:
        # sub-chunks I > J: GEMMs against the rights carried to the end of J (e^{ρ_{J+1} − Γ_j}), then from there to
        # the start of I (e^{ρ_I − ρ_{J+1}}): every factor ≤ 1
        later = torch.arange(blocks, device=q.device)
        between = (start[..., :, None, :] - end[..., None, :, :]).masked_fill(
            ~(later[:, None] > later[None, :])[..., None], float("-inf"))  # (…, n_I, n_J, K)
        to_end = factor(end[..., None, :] - blocked(cumulative))  # (…, n_J, s, K)
        carried = (rights * to_end[..., :, None, :, :]).movedim(-4, -3)  # (…, 2, n_J, s, K)
        carried = carried[..., None, :, :, :, :] * factor(between)[..., :, None, :, None, :]  # (…, n_I, 2, n_J, s, K)
        across = lefts.reshape(*batch_shape, blocks, 2 * sub, dim) @ \
            carried.reshape(*batch_shape, blocks, 2 * size, dim).transpose(-1, -2)  # (…, n_I, 2s, 2C)
        products = products + across.reshape(products.shape)
    products = products.movedim(-6, -5).reshape(*batch_shape, 2, size, 2, size)  # rows (x, i), columns (y, j)
    # unbind, not indexing: the backward of each index would be a zero tensor of the whole products
    (qk, qb), (ak, ab) = (rows.unbind(-2) for rows in products.unbind(-4))
    return qk, qb, ak, ab


def _chunk_operators(q, k, a, b, log_decay, size, sub):
    """Per chunk (module docstring): Q (B, H, N, C, K), P (B, H, N, C, C), T (B, H, N, K, K), G (B, H, N, K, C).

    Inputs laid out (B, H, L, K) in the compute dtype (q multiplied by scale); log_decay (B, H, L, K).
    """
    dtype = q.dtype
    q, k, a, b = (_chunks(x, size) for x in (q, k, a, b))
    cumulative = _cumulative_chunks(log_decay, size)
    sub, factored = _plan(cumulative, size, sub, dtype)
    qk, qb, ak, ab = _pair_products(q, k, a, b, cumulative, sub, factored, dtype)
    identity = torch.eye(size, dtype=dtype, device=q.device)
    # (I − A_ab)⁻¹ once (C columns), then GEMMs for W and M
    inverse = torch.linalg.solve_triangular(identity - ab, identity, upper=False, unitriangular=True)
    exclusive = F.pad(cumulative[..., :-1, :], (0, 0, 1, 0))
    last = cumulative[..., -1:, :]
    to_start, before, to_end, whole = (x.exp().to(dtype) for x in (cumulative, exclusive, last - cumulative, last))
    w_chunks = inverse @ (a * before)  # W (…, C, K)
    m_chunks = inverse @ ak  # M (…, C, C)
    queries = q * to_start + qb @ w_chunks
    pairs = qk + qb @ m_chunks
    betas_to_end = (b * to_end).transpose(-1, -2)  # (…, K, C)
    transition = torch.diag_embed(whole.squeeze(-2)) + betas_to_end @ w_chunks
    drive = (k * to_end).transpose(-1, -2) + betas_to_end @ m_chunks
    return queries, pairs, transition, drive


def _sizes(chunk_size, sub_chunk):
    """(C, smallest sub-chunk), checked."""
    size, sub = int(chunk_size), int(sub_chunk)
    if size < 1 or sub < 1:
        raise ValueError(f"chunk_size and sub_chunk must be positive, got {chunk_size} and {sub_chunk}")
    return size, min(sub, size)


def dplr_chunked(q, k, v, a, b, log_decay, *, scale=None, initial_state=None, output_final_state=False,
                 chunk_size=CHUNK_SIZE, sub_chunk=SUB_CHUNK):
    """The DPLR recurrence's output and final state by the chunked WY form (module docstring); equal to
    :func:`.naive.dplr_recurrent` up to rounding, for every input and gradient.

    Args:
        q, k, a, b, log_decay: (B, L, H, K); log_decay ≤ 0, any magnitude. v: (B, L, H, V). scale: multiplies q,
            default K^−½. initial_state: (B, H, K, V) or None (zero). chunk_size: tokens per chunk C (L / C
            sequential steps). sub_chunk: the smallest sub-chunk, whose pairs are formed pairwise (C · s · K per
            chunk) when the decays are too strong for a GEMM (module docstring); C when it does not divide C.
    Returns:
        (o, final_state): o (B, L, H, V) in v's dtype; final_state (B, H, K, V) in the compute dtype (q's dtype,
        float32 for half types) when ``output_final_state``, else None.
    """
    out_dtype = v.dtype
    q, k, v, a, b, log_decay, state = prepare_inputs(q, k, v, a, b, log_decay, scale, initial_state)
    batch, heads, length, dim = q.shape
    size, sub = _sizes(chunk_size, sub_chunk)
    queries, pairs, transition, drive = _chunk_operators(q, k, a, b, log_decay, size, sub)
    v = _chunks(v, size)  # (B, H, N, C, V)
    driven = drive @ v  # G v: (B, H, N, K, V)
    if state is None:
        state = q.new_zeros(batch, heads, dim, v.shape[-1])
    entered = []  # the state each chunk starts from
    # unbind, not indexing per chunk: the backward of an index is a zero tensor of the whole input per chunk
    for transition_n, driven_n in zip(transition.unbind(2), driven.unbind(2)):
        entered.append(state)
        state = transition_n @ state + driven_n
    output = queries @ torch.stack(entered, dim=2) + pairs @ v  # (B, H, N, C, V)
    output = output.reshape(batch, heads, -1, v.shape[-1])[:, :, :length].transpose(1, 2).to(out_dtype)
    return output, (state if output_final_state else None)


def dplr_alpha(q, k, a, b, log_decay, *, scale=None, chunk_size=CHUNK_SIZE, sub_chunk=SUB_CHUNK):
    """α (B, H, L, L) in the compute dtype, zero above the diagonal: with a zero initial state the output of head
    h is ``o_t = Σ_{s≤t} α[h, t, s] v_s``, one number per token pair shared by the head's value channels::

        α[t, s] = scale · q_tᵀ (D_t + b_t a_tᵀ) ⋯ (D_{s+1} + b_{s+1} a_{s+1}ᵀ) k_s

    By the chunk operators: the diagonal blocks are P; the state the values of earlier chunks leave is carried
    as a K × L matrix X (X_{n+1} = T_n X_n + [G_n at chunk n's columns]) and read by the chunk's Q.

    Args:
        q, k, a, b, log_decay: (B, L, H, K). scale: multiplies q, default K^−½.
    """
    batch, length, heads, dim = q.shape
    empty_values = q.new_zeros(batch, length, heads, 0)
    q, k, _, a, b, log_decay, _ = prepare_inputs(q, k, empty_values, a, b, log_decay, scale, None)
    size, sub = _sizes(chunk_size, sub_chunk)
    queries, pairs, transition, drive = _chunk_operators(q, k, a, b, log_decay, size, sub)
    chunks = queries.shape[2]
    carried = q.new_zeros(batch, heads, dim, 0)  # X: columns of the chunks before this one
    row_blocks = []
    for index, (queries_n, pairs_n, transition_n, drive_n) in enumerate(
            zip(*(x.unbind(2) for x in (queries, pairs, transition, drive)))):
        after = q.new_zeros(batch, heads, size, (chunks - index - 1) * size)
        row_blocks.append(torch.cat([queries_n @ carried, pairs_n, after], dim=-1))
        carried = torch.cat([transition_n @ carried, drive_n], dim=-1)
    return torch.cat(row_blocks, dim=-2)[:, :, :length, :length]


def dplr_alpha_rows(q_b, k_b, a_b, b_b, log_decay_b, rows, *, scale=None, chunk_size=CHUNK_SIZE,
                    sub_chunk=SUB_CHUNK):
    """α[h, rows, :] of one batch element: (H, R, L) in the compute dtype, equal to those rows of
    :func:`dplr_alpha`.

    The chunk operators are formed for the tokens up to the last row only; the rows' queries are then carried
    backwards (Z ← Z T_m, each row joining at its own chunk: Z_t = Q_t), so the cost is O(N · R · K²) for R rows
    rather than the O(N · L · K²) of the whole α.

    Args:
        q_b, k_b, a_b, b_b, log_decay_b: (L, H, K). rows: (R,) int64 token indices, any order.
    """
    length, heads, dim = q_b.shape
    rows = torch.as_tensor(rows, dtype=torch.long, device=q_b.device)
    if rows.numel() == 0:
        return q_b.new_zeros(heads, 0, length, dtype=torch.promote_types(q_b.dtype, torch.float32))
    if int(rows.min()) < 0 or int(rows.max()) >= length:
        raise ValueError(f"rows must lie in [0, {length}), got {rows.min().item()} .. {rows.max().item()}")
    needed = int(rows.max()) + 1  # tokens after the last row do not enter its α
    inputs = [x[None, :needed] for x in (q_b, k_b, a_b, b_b, log_decay_b)]
    q, k, _, a, b, log_decay, _ = prepare_inputs(*inputs[:2], q_b.new_zeros(1, needed, heads, 0), *inputs[2:], scale, None)
    size, sub = _sizes(chunk_size, sub_chunk)
    queries, pairs, transition, drive = (x[0] for x in _chunk_operators(q, k, a, b, log_decay, size, sub))
    chunks = queries.shape[1]
    row_chunk, row_offset = rows // size, rows % size
    adjoint = q.new_zeros(heads, rows.numel(), dim)  # Z: row t's Q_t T_{n(t)−1} ⋯ T_{m+1} (0 until it joins)
    column_blocks = [None] * chunks
    for m in range(chunks - 1, -1, -1):
        here = row_chunk == m
        block = adjoint @ drive[:, m]  # (H, R, C): rows in later chunks
        block[:, here] = pairs[:, m][:, row_offset[here]]  # rows in this chunk: its diagonal block (Z is 0 there)
        column_blocks[m] = block
        adjoint = adjoint @ transition[:, m]
        adjoint[:, here] = queries[:, m][:, row_offset[here]]
    out = torch.cat(column_blocks, dim=-1)[:, :, :needed]
    return F.pad(out, (0, length - needed))
