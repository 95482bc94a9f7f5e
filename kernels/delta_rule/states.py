"""The (gated) delta rule with an initial and a final state, by the chunked WY (UT) form; plain torch, so autograd
gives the gradients of every input (q, k, v, beta, log_decay, initial_state).

Recurrence and conventions: :mod:`.recurrent`. Within a chunk of C tokens entered with the state S_0, with the
in-chunk cumulative log decays Γ_i = Σ_{r≤i} g_r (≤ 0) and pseudo-values ``u_i = β_i (v_i − S_{i−1}ᵀ D_i k_i)``, the
state is ``S_i = e^{Γ_i} S_0 + Σ_{j≤i} e^{Γ_i − Γ_j} k_j u_jᵀ`` (e^{…} diagonal over the key channels), so u solves
the unit lower-triangular system (the same as in :mod:`.chunked`)::

    (I + A) u = β v − β (e^{Γ} k) S_0,      A[i, j] = β_i k_iᵀ e^{Γ_i − Γ_j} k_j  (j < i)

that is ``u = U − W S_0`` with ``U = (I + A)⁻¹ β v`` and ``W = (I + A)⁻¹ β e^{Γ} k``, which do not depend on the
state: they are solved for all chunks at once. Only the hand-over of the state is sequential::

    S_next = e^{Γ_C} S_0 + (e^{Γ_C − Γ} k)ᵀ u,      o_i = S_0ᵀ (e^{Γ_i} q_i) + Σ_{j≤i} (q_iᵀ e^{Γ_i − Γ_j} k_j) u_j

(q already multiplied by scale). The outputs are again computed for all chunks at once from the states the chunks
were entered with. Every exponent is Γ_i − Γ_j with j ≤ i, Γ_i or Γ_C − Γ_j: ≤ 0, so nothing overflows, whatever
the decays (the masked entries are set to −∞ before the exponential, so no ∞ · 0 either); the cumulative sums and
their differences are formed in float64. A sequence whose length is not a multiple of C is padded with tokens of
k = v = β = g = 0, which leave the state as it is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .recurrent import prepare_inputs

CHUNK_SIZE = 64  # tokens per chunk with no decay or one per head (fastest on CPU at K = V = 128, float32)
PER_CHANNEL_CHUNK_SIZE = 8  # with a decay per key channel: the (C, C, K) decays cost C·K per token


def _chunks(x, size):
    """(B, L, H, ...) → (B·H, N, size, ...), zero-padded to N · size tokens."""
    x = x.transpose(1, 2)
    pad = -x.shape[2] % size
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(x.shape[0] * x.shape[1], -1, size, *x.shape[3:])


def _key_products(q, k, cumulative, lower):
    """(k_iᵀ e^{Γ_i − Γ_j} k_j, q_iᵀ e^{Γ_i − Γ_j} k_j), each (…, C, C), for j ≤ i and 0 above the diagonal.

    q, k: (…, C, K); cumulative Γ: (…, C) (one decay per head) or (…, C, K) (per key channel), float64; lower:
    (C, C) bool, j ≤ i. The decays e^{Γ_i − Γ_j} are formed once for both products.
    """
    if cumulative.dim() == k.dim() - 1:
        exponent = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~lower, float("-inf"))
        decays = exponent.exp().to(k.dtype)
        return (k @ k.transpose(-1, -2)) * decays, (q @ k.transpose(-1, -2)) * decays
    # per key channel: (…, i, j, K) decays times k_j, contracted with k_i and q_i in one batched product
    exponent = (cumulative[..., :, None, :] - cumulative[..., None, :, :]).to(k.dtype)
    decayed_keys = exponent.masked_fill(~lower[:, :, None], float("-inf")).exp() * k[..., None, :, :]
    both = decayed_keys @ torch.stack([k, q], dim=-1)  # (…, i, j, 2)
    return both[..., 0], both[..., 1]


def delta_rule_chunked_states(q, k, v, beta, log_decay=None, *, scale=None, initial_state=None,
                              output_final_state=False, chunk_size=None):
    """The (gated) delta rule's output and final state by the chunked WY form (module docstring); equal to
    :func:`.recurrent.delta_rule_recurrent` up to rounding, for every input and gradient.

    Args:
        q, k: (B, L, H, K). v: (B, L, HV, V), HV a multiple of H (value head h uses q / k head h // (HV / H)).
        beta: (B, L, HV). log_decay: None (no decay), (B, L, HV) (one per head: gated delta rule) or (B, L, HV, K)
            (one per key channel: KDA); ≤ 0, any magnitude. scale: multiplies q, default K^−½. initial_state:
            (B, HV, K, V) or None (zero). chunk_size: tokens per chunk C; None: 64, or 8 with per-channel decays
            (the cost has a part ∝ C·K per token, C·C·K with per-channel decays, and L / C sequential steps).
    Returns:
        (o, final_state): o (B, L, HV, V) in v's dtype; final_state (B, HV, K, V) in the compute dtype (q's dtype,
        float32 for half types) when ``output_final_state``, else None.
    """
    out_dtype = v.dtype
    q, k, v, beta, log_decay, state = prepare_inputs(q, k, v, beta, log_decay, scale, initial_state)
    dtype = q.dtype
    batch, length, heads, dim = v.shape[:3] + (q.shape[-1],)
    value_dim = v.shape[-1]
    per_channel = log_decay is not None and log_decay.dim() == 4
    size = (PER_CHANNEL_CHUNK_SIZE if per_channel else CHUNK_SIZE) if chunk_size is None else int(chunk_size)
    if size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q, k, v, beta = (_chunks(x, size) for x in (q, k, v, beta))  # (B·H, N, C, ·)
    if log_decay is None:
        log_decay = torch.zeros(batch, length, heads, dtype=torch.float64, device=q.device)
    cumulative = _chunks(log_decay.to(torch.float64), size).cumsum(2)  # Γ: (B·H, N, C[, K])
    position = torch.arange(size, device=q.device)
    lower = position[:, None] >= position[None, :]
    # e^{Γ_i}, e^{Γ_C − Γ_j}, e^{Γ_C}, shaped to multiply (…, C, K) rows and (B·H, K, V) states
    last = cumulative[:, :, -1:]
    to_start, to_end, whole = (x.exp().to(dtype) for x in (cumulative, last - cumulative, last))
    if not per_channel:
        to_start, to_end = to_start[..., None], to_end[..., None]
    whole = whole.squeeze(2)[..., None] if per_channel else whole[..., None]  # (B·H, N, K, 1) or (B·H, N, 1, 1)

    key_products, scores = _key_products(q, k, cumulative, lower)  # (B·H, N, C, C) each
    system = beta[..., None] * key_products.tril(-1)  # A; the unit diagonal is implied
    # (I + A)⁻¹ once (C columns), then two GEMMs: cheaper than solving for the K + V columns of W and U
    identity = torch.eye(size, dtype=dtype, device=q.device)
    inverse = torch.linalg.solve_triangular(system, identity, upper=False, unitriangular=True) * beta[..., None, :]
    w_chunks, u_chunks = inverse @ (k * to_start), inverse @ v  # W (…, C, K), U (…, C, V)
    keys_to_end = (k * to_end).transpose(-1, -2)  # (B·H, N, K, C)

    state = q.new_zeros(batch * heads, dim, value_dim) if state is None else state.reshape(-1, dim, value_dim)
    entered, pseudo = [], []  # the state each chunk starts from, and its pseudo-values u
    # unbind, not indexing per chunk: the backward of an index is a zero tensor of the whole input per chunk
    for u_n, w_n, keys_n, whole_n in zip(*(x.unbind(1) for x in (u_chunks, w_chunks, keys_to_end, whole))):
        entered.append(state)
        u = torch.baddbmm(u_n, w_n, state, alpha=-1)  # U − W S
        pseudo.append(u)
        state = torch.baddbmm(whole_n * state, keys_n, u)
    entered, pseudo = torch.stack(entered, dim=1), torch.stack(pseudo, dim=1)
    output = (q * to_start) @ entered + scores @ pseudo  # (B·H, N, C, V)
    output = output.reshape(batch, heads, -1, value_dim)[:, :, :length].transpose(1, 2).to(out_dtype)
    return output, (state.reshape(batch, heads, dim, value_dim) if output_final_state else None)
