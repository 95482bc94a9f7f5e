"""The delta rule's α by the chunked WY form (the form flash-linear-attention's ``chunk`` kernels use).

Within a chunk of C tokens starting from state S_0 (K × V), with in-chunk cumulative log decays Γ_i = Σ_{r≤i} g_r
(≤ 0) and ``u_i = β_i (v_i − S_{i−1}ᵀ D_i k_i)``, the state is ``S_i = D_{1..i} S_0 + Σ_{j≤i} D_{j+1..i} k_j u_jᵀ``,
so the pseudo-values u solve the unit lower-triangular system::

    u_i + Σ_{j<i} A[i, j] u_j = β_i (v_i − S_0ᵀ (e^{Γ_i} ⊙ k_i)),      A[i, j] = β_i k_iᵀ diag(e^{Γ_i − Γ_j}) k_j

and ``o_i = S_0ᵀ (e^{Γ_i} ⊙ q_i) + Σ_{j≤i} (q_iᵀ diag(e^{Γ_i − Γ_j}) k_j) u_j``. With one-hot values the value
dimension is the source token: V = [0 | I_C | 0] (C × L), the state is K × L, and o is the chunk's rows of α. Every
exponent is a difference Γ_i − Γ_j with j ≤ i, or Γ_i, Γ_C − Γ_j: all ≤ 0, so nothing overflows. Columns after the
chunk are zero and are skipped.
"""
from __future__ import annotations

import torch

CHUNK_SIZE = 64


def _pairwise(left, right, cumulative, causal):
    """(H, C, C): left_iᵀ diag(e^{Γ_i − Γ_j}) right_j where ``causal`` (j ≤ i or j < i), else 0.

    left, right: (H, C, K); cumulative Γ: (H, C) (scalar decay) or (H, C, K) (per key channel).
    """
    if cumulative.dim() == 2:
        exponent = (cumulative[:, :, None] - cumulative[:, None, :]).masked_fill(~causal, float("-inf"))
        return (left @ right.transpose(-1, -2)) * exponent.exp()
    exponent = (cumulative[:, :, None, :] - cumulative[:, None, :, :]).masked_fill(~causal[..., None],
                                                                                    float("-inf"))
    return torch.einsum("hik,hijk,hjk->hij", left, exponent.exp().to(left.dtype), right)


def delta_rule_alpha_chunked(q, k, beta, log_decay, *, last_row=None, chunk_size=CHUNK_SIZE):
    """α (B, H, L, L) in the dtype of q (see :mod:`kernels.delta_rule`); rows after ``last_row`` stay zero.

    Args:
        q, k: (B, L, H, K). beta: (B, L, H). log_decay: (B, L, H) or (B, L, H, K), ≤ 0.
    """
    return _chunked(q, k, beta, log_decay, None, last_row, chunk_size)


def delta_rule_output_chunked(q, k, beta, log_decay, values, *, chunk_size=CHUNK_SIZE):
    """The delta rule's output o (B, L, H, V) for values (B, L, H, V), by the same chunked form: the layer's core
    output, rebuilt at the cost of the forward (no L × L map)."""
    return _chunked(q, k, beta, log_decay, values.to(q.dtype), None, chunk_size).transpose(1, 2)


def _chunked(q, k, beta, log_decay, values, last_row, chunk_size):
    """α (B, H, L, L) when ``values`` is None (one-hot values: the value dimension is the source token), else the
    output (B, H, L, V)."""
    batch, length, heads, dim = q.shape
    dtype = q.dtype
    one_hot = values is None
    last = length if last_row is None else int(last_row) + 1
    width = length if one_hot else values.shape[-1]
    out = q.new_zeros(batch, heads, length, width)
    per_channel = log_decay.dim() == 4
    for b in range(batch):
        qb, kb = q[b].transpose(0, 1), k[b].transpose(0, 1)  # (H, L, K)
        betab = beta[b].transpose(0, 1).to(dtype)  # (H, L)
        gb = log_decay[b].transpose(0, 1).to(torch.float64)  # (H, L[, K]); cumsums in float64
        state = q.new_zeros(heads, dim, width)
        for start in range(0, last, chunk_size):
            end = min(start + chunk_size, length)
            size = end - start
            cols = end if one_hot else width  # one-hot: columns after the chunk are zero
            qc, kc, bc = qb[:, start:end], kb[:, start:end], betab[:, start:end]
            cumulative = gb[:, start:end].cumsum(1)  # Γ (H, C[, K])
            position = torch.arange(size, device=q.device)
            lower = position[:, None] >= position[None, :]
            strictly_lower = position[:, None] > position[None, :]
            decay_to_start = cumulative.exp().to(dtype)  # e^{Γ_i}
            decay_to_end = (cumulative[:, -1:] - cumulative).exp().to(dtype)  # e^{Γ_C − Γ_j}
            gamma = (lambda t: t[..., None]) if not per_channel else (lambda t: t)
            cum = cumulative.to(dtype) if not per_channel else cumulative

            system = bc[:, :, None] * _pairwise(kc, kc, cum, strictly_lower).to(dtype)
            system = system + torch.eye(size, dtype=dtype, device=q.device)
            s0 = state[:, :, :cols]  # (H, K, cols)
            rhs = -((kc * gamma(decay_to_start)) @ s0)  # (H, C, cols)
            if one_hot:
                rhs[:, position, start + position] += 1.0
            else:
                rhs = rhs + values[b, start:end].transpose(0, 1)
            pseudo = torch.linalg.solve_triangular(system, bc[:, :, None] * rhs, upper=False, unitriangular=True)
            scores = _pairwise(qc, kc, cum, lower).to(dtype)  # (H, C, C)
            out[b, :, start:end, :cols] = (qc * gamma(decay_to_start)) @ s0 + scores @ pseudo
            carried = cumulative[:, -1].exp().to(dtype)  # e^{Γ_C}: (H,) or (H, K)
            carried = carried[:, None, None] if not per_channel else carried[:, :, None]
            state[:, :, :cols] = carried * s0 + (kc * gamma(decay_to_end)).transpose(-1, -2) @ pseudo
    return out
