"""Gated linear attention by chunks (the form of flash-linear-attention's ``chunk_*`` kernels), and its α.

Split the L tokens into chunks of C. Inside a chunk that starts from state S_0, with the in-chunk cumulative log
decays Γ_i = Σ_{r≤i} g_r (per key channel, or one per head) and the query-side cumulative Γ^q_i (= Γ_i for GLA,
= Γ_{i−1} = Γ_i − g_i for RWKV-6, whose read comes before the token's decay and write)::

    o_i = scale · [S_0ᵀ (e^{Γ^q_i} ⊙ q_i) + Σ_{j ∈ J(i)} (q_iᵀ diag(e^{Γ^q_i − Γ_j}) k_j) v_j + (q_iᵀ diag(u) k_i) v_i]
    S_C = diag(e^{Γ_C}) S_0 + Σ_j (e^{Γ_C − Γ_j} ⊙ k_j) v_jᵀ

with J(i) = {j ≤ i} for GLA (no bonus term) and {j < i} for RWKV-6 (bonus u). Every exponent is Γ^q_i (≤ 0),
Γ_C − Γ_j or Γ^q_i − Γ_j with j in J(i): all ≤ 0, so strong decays (−30 a step, cumulative sums far below −100)
underflow to exact zeros instead of overflowing; positions outside J(i) are set to −∞ before the exponential (no
inf · 0 in the forward or the backward). The cumulative sums are taken in float64 and the differences formed there
before the exponent is cast to the compute dtype, so a weak decay after a strong one keeps full float32 accuracy.

The intra-chunk term: with one decay per head the exponent is a C × C matrix per chunk (cheap); per key channel,
sub-chunks of C' = 8 tokens: pairwise C' × C' × K exponents inside a sub-chunk, and for an earlier sub-chunk ending
at token e the product ``e^{Γ^q_i − Γ_j} = e^{Γ^q_i − Γ_e} · e^{Γ_e − Γ_j}`` (both ≤ 0) turns the rest into matrix
products (:func:`_per_channel_intra`). The chunks' states are passed from chunk to chunk by a loop over the L / C
chunks (the only sequential part); without decays they are a cumulative sum. Everything is plain torch, so
autograd differentiates it (q, k, v, log decays, bonus, initial state); the per-channel exponential factors reach
the log decays' gradient through a stop-gradient identity (exact first derivatives, not second ones).

Forward + backward at B = 1, L = 1024, H = 4, K = 128, V = 256, float32, one CPU thread (CPU time): about 0.13 s
with per-channel decays and 0.05 s with one per head, 12× and 33× faster than fla's ``naive_recurrent_gla``
(benchmarks/bench_gated_linear.py).

:func:`gated_linear_alpha_rows` computes rows of α (o = α v at zero initial state) blocked by columns: for a row t
and a column block J that ends (at e_J) before t's own block, ``e^{Γ^q_t − Γ_s} = e^{Γ^q_t − Γ_{e_J}} ·
e^{Γ_{e_J} − Γ_s}`` (both factors ≤ 0, global cumulative sums), one matrix product per block; t's own block is
formed pairwise.
"""
from __future__ import annotations

import math

import torch

CHUNK_SIZE = 64  # tokens per chunk: the states passed along are L / C matrices K × V (CPU-tuned)
SUB_CHUNK_SIZE = 8  # per-channel decays: pairwise C' × C' × K exponents inside sub-chunks of C' tokens
GROUP_ELEMENTS = 2 ** 20  # entries of the largest per-channel temporary per group of chunks (4 MiB in float32)


def _compute_dtype(dtype):
    """At least float32; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(x, size, count, dtype):
    """(B, L, H, ...) → (B, H, N, C, ...) contiguous in ``dtype``, zero-padded to N · C tokens (a zero key adds
    nothing to the state, a zero log decay keeps it)."""
    x = x.to(dtype)
    pad = count * size - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    x = x.reshape(x.shape[0], count, size, *x.shape[2:])
    return x.movedim(3, 1).contiguous()


def gated_linear_chunked(q, k, v, log_decay=None, *, scale=None, bonus=None, initial_state=None,
                         output_final_state=False, chunk_size=CHUNK_SIZE):
    """Gated linear attention (GLA / simple GLA / retention / linear attention, or RWKV-6 with ``bonus``) by chunks.

    Same conventions and results as :func:`~.naive.gated_linear_recurrent` (see :mod:`kernels.gated_linear`).

    Args:
        q, k: (B, L, H, K). v: (B, L, H, V).
        log_decay: (B, L, H, K) per key channel, (B, L, H) one per head, or None (no decay); ≤ 0.
        scale: multiplies the queries; None → K^−½.
        bonus: (H, K) RWKV-6's u (read before write, current token through diag(u)); None → GLA (write, read).
        initial_state: (B, H, K, V) or None. output_final_state: return S_L as well.
        chunk_size: tokens per chunk C (per-channel decays: sub-chunks of 8 when C is a multiple of 8, else one
            sub-chunk of C).

    Returns:
        o (B, L, H, V) in the dtype of q, and S_L (B, H, K, V) in float32 (float64 for float64 inputs) when
        ``output_final_state``, else None. Computed in float32 at least (float64 for float64 inputs).
    """
    dtype = q.dtype
    compute = _compute_dtype(dtype)
    batch, length, heads, dim = q.shape
    width = v.shape[-1]
    scale = dim ** -0.5 if scale is None else scale
    per_channel = log_decay is not None and log_decay.dim() == 4
    sub_size = SUB_CHUNK_SIZE if per_channel and chunk_size % SUB_CHUNK_SIZE == 0 else chunk_size
    size = min(chunk_size, math.ceil(length / sub_size) * sub_size)  # a short input: one chunk of whole sub-chunks
    count = math.ceil(length / size)
    qc = _chunks(q, size, count, compute) * scale  # (B, H, N, C, K)
    kc = _chunks(k, size, count, compute)
    vc = _chunks(v, size, count, compute)  # (B, H, N, C, V)
    position = torch.arange(size, device=q.device)
    # which key j a query i reads inside its chunk: j ≤ i (GLA), j < i (RWKV-6: token i enters through the bonus)
    reads = position[:, None] >= position[None, :] if bonus is None else position[:, None] > position[None, :]

    if log_decay is None:
        out = (qc @ kc.transpose(-1, -2)).masked_fill(~reads, 0.0) @ vc  # (B, H, N, C, V)
        q_inter, k_inter = qc, kc
        chunk_decay = None
    else:
        g = _chunks(log_decay, size, count, torch.float64)  # (B, H, N, C[, K]); cumulative sums in float64
        cumulative = g.cumsum(3)
        query_cumulative = cumulative if bonus is None else cumulative - g  # Γ^q
        to_end = cumulative[:, :, :, -1:] - cumulative  # Γ_C − Γ_j
        chunk_decay = cumulative[:, :, :, -1].to(compute).exp()  # e^{Γ_C}: (B, H, N[, K])
        if per_channel:
            out = _per_channel_intra(qc, kc, vc, query_cumulative, cumulative, bonus is not None, sub_size)
            q_inter = qc * query_cumulative.to(compute).exp()
            k_inter = kc * to_end.to(compute).exp()
        else:
            exponent = query_cumulative[..., :, None] - cumulative[..., None, :]  # (B, H, N, C, C)
            exponent = exponent.masked_fill(~reads, float("-inf")).to(compute)
            out = ((qc @ kc.transpose(-1, -2)) * exponent.exp()) @ vc
            q_inter = qc * query_cumulative.to(compute).exp()[..., None]
            k_inter = kc * to_end.to(compute).exp()[..., None]
            chunk_decay = chunk_decay[..., None]  # broadcast over key channels
    if bonus is not None:  # RWKV-6: the current token, weighted by q_iᵀ diag(u) k_i
        out = out + (qc * bonus.to(compute)[None, :, None, None, :] * kc).sum(-1, keepdim=True) * vc

    chunk_kv = k_inter.transpose(-1, -2) @ vc  # (B, H, N, K, V): each chunk's contribution to its end state
    state = q.new_zeros(batch, heads, dim, width, dtype=compute)
    if initial_state is not None:
        state = state + initial_state.to(compute)
    if chunk_decay is None:  # no decay: the states are running sums
        running = chunk_kv.cumsum(2)
        starts = torch.cat([state[:, :, None], state[:, :, None] + running[:, :, :-1]], dim=2)
        state = state + running[:, :, -1]
    else:
        start_states = []
        # unbind, not indexing: the backward of each index would write a whole zero (B, H, N, K, V) gradient
        for decay, contribution in zip(chunk_decay.unbind(2), chunk_kv.unbind(2)):
            start_states.append(state)
            state = state * decay[..., None] + contribution
        starts = torch.stack(start_states, dim=2)  # (B, H, N, K, V): the state each chunk starts from
    out = out + q_inter @ starts
    o = out.movedim(1, 3).reshape(batch, count * size, heads, width)[:, :length].to(dtype)
    return o, (state if output_final_state else None)


def _per_channel_intra(qc, kc, vc, query_cumulative, cumulative, read_before_write, sub_size):
    """(B, H, N, C, V): Σ_{j ∈ J(i)} (q_iᵀ diag(e^{Γ^q_i − Γ_j}) k_j) v_j inside each chunk, decays per key channel.

    Sub-chunks of C' tokens: a key j in an earlier sub-chunk than the query i, ending at token e,
    ``e^{Γ^q_i − Γ_j} = e^{Γ^q_i − Γ_e} · e^{Γ_e − Γ_j}`` (both ≤ 0): a query factor per (token, earlier
    sub-chunk) and a key factor per token, then matrix products; inside the query's own sub-chunk the C' × C' × K
    exponent is formed pairwise. qc, kc: (B, H, N, C, K); vc: (B, H, N, C, V); the cumulative sums float64
    (B, H, N, C, K).

    The exponential factors are formed without autograd (differences in float64, the exponential in the compute
    dtype). The log decays' gradient reaches them through q̃_i = q_i e^{Γ^q_i − sg(Γ^q_i)} and
    k̃_j = k_j e^{sg(Γ_j) − Γ_j}, equal to q_i and k_j in value (sg: stop-gradient): every term is
    q_iᵀ diag(e^{Γ^q_i − Γ_j}) k_j whatever the factorisation, so those gradients are exactly the factors', and the
    backward skips the factors' own (first derivatives are exact; a second derivative would miss the factors'
    dependence on the decays). Chunks go in groups of about ``GROUP_ELEMENTS`` entries per temporary: on CPU,
    temporaries that stay in cache are several times faster.
    """
    compute = qc.dtype
    batch, heads, count, size, dim = qc.shape
    blocks = size // sub_size
    q_tilde = qc * (query_cumulative - query_cumulative.detach()).to(compute).exp()
    k_tilde = kc * (cumulative.detach() - cumulative).to(compute).exp()
    position = torch.arange(sub_size, device=qc.device)
    reads = position[:, None] >= position[None, :] if not read_before_write else position[:, None] > position[None, :]
    # (earlier sub-chunk J, query token i): J before i's own sub-chunk
    earlier = (torch.arange(blocks, device=qc.device)[:, None]
               < torch.arange(size, device=qc.device)[None, :] // sub_size)
    group = max(1, GROUP_ELEMENTS // (batch * heads * size * max(blocks, sub_size) * dim))
    outputs = []
    for start in range(0, count, group):
        chunks = slice(start, start + group)
        query_sums, key_sums = query_cumulative[:, :, chunks], cumulative[:, :, chunks]  # (B, H, G, C, K)
        queries, keys, values = q_tilde[:, :, chunks], k_tilde[:, :, chunks], vc[:, :, chunks]
        split = (lambda t: t.unflatten(3, (blocks, sub_size)))  # (B, H, G, C, ·) → (B, H, G, C/C', C', ·)
        with torch.no_grad():
            own = split(query_sums)[..., :, None, :] - split(key_sums)[..., None, :, :]  # (B, H, G, m, C', C', K)
            own = own.masked_fill_(~reads[..., None], float("-inf")).to(compute).exp_()
        out = ((split(queries)[..., :, None, :] * own * split(keys)[..., None, :, :]).sum(-1)
               @ split(values)).flatten(3, 4)
        if blocks > 1:
            with torch.no_grad():
                ends = split(key_sums)[..., -1, :]  # Γ_e at each sub-chunk's last token: (B, H, G, m, K)
                key_factor = (ends[..., None, :] - split(key_sums)).to(compute).exp_()  # (B, H, G, m, C', K)
                query_factor = query_sums[..., None, :, :] - ends[..., :, None, :]  # (B, H, G, m, C, K)
                query_factor = query_factor.masked_fill_(~earlier[..., None], float("-inf")).to(compute).exp_()
            scores = (queries[..., None, :, :] * query_factor) @ (split(keys) * key_factor).transpose(-1, -2)
            scores = scores.movedim(3, 4).flatten(4, 5)  # (B, H, G, C, C): key index (sub-chunk, token in it)
            out = out + scores @ values
        outputs.append(out)
    return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]


def gated_linear_alpha(q, k, log_decay=None, *, scale=None, bonus=None):
    """α (B, H, L, L) with o_t = Σ_s α[t, s] v_s (per head, zero initial state): lower triangular, diagonal included.

    α[t, s] = scale · q_tᵀ diag(e^{Γ_t − Γ_s}) k_s for s ≤ t (GLA); for RWKV-6 (``bonus`` u)
    α[t, s] = scale · q_tᵀ diag(e^{Γ_{t−1} − Γ_s}) k_s for s < t and α[t, t] = scale · q_tᵀ diag(u) k_t, where Γ is
    the cumulative sum of the log decays (per key channel or per head; none → all exponents 0).

    Args:
        q, k: (B, L, H, K). log_decay: (B, L, H, K), (B, L, H) or None. scale: None → K^−½. bonus: (H, K) or None.

    Returns:
        (B, H, L, L) in float32, or float64 for float64 inputs.
    """
    length = q.shape[1]
    rows = torch.arange(length, device=q.device)
    return torch.stack([
        gated_linear_alpha_rows(q[b], k[b], None if log_decay is None else log_decay[b], rows, scale=scale,
                                bonus=bonus)
        for b in range(q.shape[0])])


def gated_linear_alpha_rows(q_b, k_b, log_decay_b, rows, *, scale=None, bonus=None, block_size=None):
    """The rows ``rows`` of α (see :func:`gated_linear_alpha`) for one batch element, blocked by columns.

    Memory O(R · (L / C + C) · K + L · K) per head for R rows and column blocks of C (no L × L × K tensor).

    Args:
        q_b, k_b: (L, H, K). log_decay_b: (L, H, K), (L, H) or None. rows: R token indices (a sequence or a 1-d
            tensor, any order). scale: None → K^−½. bonus: (H, K) or None. block_size: column block C; None →
            about √L (between 16 and 128).

    Returns:
        (H, R, L) in float32, or float64 for float64 inputs.
    """
    compute = _compute_dtype(q_b.dtype)
    length, heads, dim = q_b.shape
    scale = dim ** -0.5 if scale is None else scale
    rows = torch.as_tensor(rows, dtype=torch.long, device=q_b.device).reshape(-1)
    q_rows = q_b[rows].to(compute).transpose(0, 1) * scale  # (H, R, K)
    keys = k_b.to(compute).transpose(0, 1)  # (H, L, K)

    if log_decay_b is None or log_decay_b.dim() == 2:
        columns = torch.arange(length, device=q_b.device)
        # which columns s a row t reads through the decays: s ≤ t (GLA), s < t (RWKV-6: s = t is the bonus)
        reads = columns[None, :] <= rows[:, None] if bonus is None else columns[None, :] < rows[:, None]
        alpha = q_rows @ keys.transpose(-1, -2)  # (H, R, L)
        if log_decay_b is None:
            alpha = alpha.masked_fill(~reads, 0.0)
        else:
            g = log_decay_b.to(torch.float64).transpose(0, 1)  # (H, L)
            cumulative = g.cumsum(-1)
            query_cumulative = (cumulative if bonus is None else cumulative - g)[:, rows]  # (H, R)
            exponent = (query_cumulative[:, :, None] - cumulative[:, None, :]).masked_fill(~reads, float("-inf"))
            alpha = alpha * exponent.to(compute).exp()
    else:
        if block_size is None:  # balances the L / C query factors against the C pairwise columns of a row
            block_size = min(128, max(16, 2 ** round(math.log2(max(length, 1)) / 2)))
        size = min(block_size, length)
        # rows in groups, so that the (H, R, L / C + C, K) factors stay below about 2^24 elements
        group = max(1, 2 ** 24 // (heads * dim * (math.ceil(length / size) + size)))
        alpha = torch.cat([_per_channel_rows(q_rows[:, start:start + group], keys, log_decay_b,
                                             rows[start:start + group], bonus is not None, size)
                           for start in range(0, len(rows), group)], dim=1)
    if bonus is not None:  # the diagonal: scale · q_tᵀ diag(u) k_t
        diagonal = (q_rows * bonus.to(compute)[:, None, :] * keys[:, rows]).sum(-1)  # (H, R)
        head_index = torch.arange(heads, device=q_b.device)[:, None]
        row_index = torch.arange(len(rows), device=q_b.device)[None, :]
        alpha = alpha.index_put((head_index, row_index, rows[None, :].expand(heads, -1)), diagonal, accumulate=True)
    return alpha


def _per_channel_rows(q_rows, keys, log_decay_b, rows, read_before_write, size):
    """(H, R, L) rows of α without its bonus term, for decays per key channel (the blocked form in the module doc).

    q_rows: (H, R, K) scaled queries of the rows; keys: (H, L, K); log_decay_b: (L, H, K); size: column block C."""
    compute = q_rows.dtype
    heads, length, dim = keys.shape
    count = math.ceil(length / size)
    pad = count * size - length
    g = log_decay_b.to(torch.float64).transpose(0, 1)  # (H, L, K)
    if pad:  # zero keys add nothing; zero log decays leave Γ flat
        g = torch.cat([g, g.new_zeros(heads, pad, dim)], dim=1)
        keys = torch.cat([keys, keys.new_zeros(heads, pad, dim)], dim=1)
    cumulative = g.cumsum(1)  # Γ (H, N·C, K), global
    query_cumulative = (cumulative if not read_before_write else cumulative - g)[:, rows]  # Γ^q_t (H, R, K)
    block_end = cumulative.view(heads, count, size, dim)[:, :, -1]  # Γ_{e_J} (H, N, K)
    own_block = rows // size  # (R,)

    # blocks J before the row's own block: e^{Γ^q_t − Γ_{e_J}} (queries) times e^{Γ_{e_J} − Γ_s} (keys)
    key_factor = (block_end[:, :, None] - cumulative.view(heads, count, size, dim)).to(compute).exp()
    blocked_keys = keys.view(heads, count, size, dim) * key_factor  # (H, N, C, K)
    earlier = torch.arange(count, device=rows.device)[None, :] < own_block[:, None]  # (R, N)
    query_exponent = (query_cumulative[:, :, None] - block_end[:, None]).masked_fill(~earlier[..., None],
                                                                                       float("-inf"))
    blocked_queries = q_rows[:, :, None] * query_exponent.to(compute).exp()  # (H, R, N, K)
    alpha = torch.einsum("hrnk,hnck->hrnc", blocked_queries, blocked_keys).reshape(heads, len(rows), count * size)

    # the row's own block: pairwise exponents Γ^q_t − Γ_s for the columns s it reads there
    own_columns = own_block[:, None] * size + torch.arange(size, device=rows.device)[None, :]  # (R, C)
    reads = own_columns <= rows[:, None] if not read_before_write else own_columns < rows[:, None]
    exponent = (query_cumulative[:, :, None] - cumulative[:, own_columns]).masked_fill(~reads[..., None],
                                                                                       float("-inf"))
    own = (q_rows[:, :, None] * exponent.to(compute).exp() * keys[:, own_columns]).sum(-1)  # (H, R, C)
    alpha = alpha.scatter_add(2, own_columns[None].expand(heads, -1, -1), own)
    return alpha[:, :, :length]
