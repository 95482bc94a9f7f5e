"""Plain-torch versions of flash-linear-attention 0.6.0's Comba and gated DeltaProduct ops (``fla.ops.comba``,
``fla.ops.gated_delta_product``), over the library's kernels. Layout as fla's: q, k, p (B, T, H, K), v (B, T, HV, V)
(HV a multiple of H: grouped value heads), the state (N, HV, K, V); packed sequences through ``cu_seqlens`` (B = 1).

Comba (``chunk_comba`` / ``fused_recurrent_comba``, as fla's kernels and ``naive_chunk_comba`` compute it; fla's
``naive_recurrent_comba`` decays the state before the read and is not what the kernels run)::

    S_t = exp(g_t) S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ p_t)ᵀ = (exp(g_t) I − β_t k_t p_tᵀ) S_{t−1} + β_t k_t v_tᵀ

(the read with p uses the state before the decay), o_t = scale · S_tᵀ q_t. That is the diagonal-plus-low-rank rule
of :mod:`mamba_captum.kernels.dplr` (S_t = D_t S_{t−1} + b_t (a_tᵀ S_{t−1}) + k'_t v_tᵀ) with D_t = exp(g_t) I,
a = p, b = −β k and k' = β k. With ``use_qk_l2norm_in_kernel`` q, k and p are each L2-normalised (eps 1e-6 inside the
root, as fla's kernels: :func:`mamba_captum.kernels.dplr.l2_normalised`).

Gated DeltaProduct (``chunk_gated_delta_product``): k, v, β have n = ``num_householder`` rows per token (T·n rows);
per token S ← exp(g_t) S, then n delta-rule updates S ← S + β_{t,j} k_{t,j} (v_{t,j} − Sᵀ k_{t,j})ᵀ, then
o_t = scale · Sᵀ q_t. That is the (gated) delta rule of :mod:`mamba_captum.kernels.delta_rule` over the expanded
sequence of T·n sub-steps with the decay g_t on sub-step (t, 0) and the query q_t on sub-step (t, n − 1), whose
outputs are read (what fla's own layer runs without gradients, through ``fused_recurrent_gated_delta_rule``).
"""
from __future__ import annotations

import torch

from ..kernels.delta_rule import delta_rule_chunked_states
from ..kernels.dplr import dplr_chunked, l2_normalised
from .ops import per_sequence, refuse


def comba_dplr_inputs(q, k, p, g, beta):
    """Comba's rule as DPLR inputs: (q, k' = β k, a = p, b = −β k, log_decay (B, T, HV, K)), q, k, p repeated for the
    HV value heads, in the compute dtype (q's, float32 for half types); the scale is left to the caller.

    Args:
        q, k, p: (B, T, H, K) as the rule uses them (normalised). g: (B, T, HV) log decays. beta: (B, T, HV).
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    group = beta.shape[2] // q.shape[2]
    q, k, p = (x.to(dtype).repeat_interleave(group, dim=2) for x in (q, k, p))
    written = beta.to(dtype)[..., None] * k
    log_decay = g.to(torch.promote_types(g.dtype, torch.float32))[..., None].expand(*k.shape)
    return q, written, p, -written, log_decay


def _comba(q, k, v, p, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    if p is None:
        p = k
    if use_qk_l2norm_in_kernel:
        q, k, p = l2_normalised(q), l2_normalised(k), l2_normalised(p)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)

    def run(q, k, v, p, g, beta, initial_state, output_final_state):
        q, written, read, erase, log_decay = comba_dplr_inputs(q, k, p, g, beta)
        return dplr_chunked(q, written, v, read, erase, log_decay, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state)

    return per_sequence(run, cu_seqlens, dict(q=q, k=k, v=v, p=p, g=g, beta=beta), initial_state,
                        output_final_state)


def chunk_comba(q, k, v, p, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla.ops.comba.chunk_comba (module docstring); p None reads with k (fla's default). Returns (o (B, T, HV, V),
    final state (N, HV, K, V) or None)."""
    return _comba(q, k, v, p, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens)


def fused_recurrent_comba(q, k, p, v, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla.ops.comba.fused_recurrent_comba (note fla's positional order q, k, p, v): :func:`chunk_comba`."""
    return _comba(q, k, v, p, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  cu_seqlens)


def delta_product_substeps(q, g, num_householder: int):
    """The expanded sequence's queries (B, T·n, H, K), q_t on sub-step (t, n − 1) and zero elsewhere, and log decays
    (B, T·n, HV) or None, g_t on sub-step (t, 0) and zero elsewhere. q: (B, T, H, K); g: (B, T, HV) or None."""
    n = int(num_householder)
    batch, length = q.shape[:2]
    queries = q.new_zeros(batch, length, n, *q.shape[2:])
    queries[:, :, -1] = q
    decays = None
    if g is not None:
        decays = g.new_zeros(batch, length, n, g.shape[2])
        decays[:, :, 0] = g
        decays = decays.flatten(1, 2)
    return queries.flatten(1, 2), decays


def chunk_gated_delta_product(q, k, v, g, beta, num_householder, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                              cu_seqlens_cpu=None, cp_context=None):
    """fla.ops.gated_delta_product.chunk_gated_delta_product: the delta rule over T·n sub-steps (module docstring).

    Args:
        q: (B, T, H, K). k: (B, T·n, H, K). v: (B, T·n, HV, V). g: (B, T, HV) log decays or None. beta: (B, T·n, HV).
        cu_seqlens: (N + 1) token bounds of the packed sequences (of T, not T·n).
    Returns:
        (o (B, T, HV, V), final state (N, HV, K, V) or None).
    """
    refuse("chunk_gated_delta_product", cp_context=cp_context)
    n = int(num_householder)
    if k.shape[1] != q.shape[1] * n or v.shape[1] != k.shape[1] or beta.shape[1] != k.shape[1]:
        raise ValueError(f"chunk_gated_delta_product: k, v and beta need T·n = {q.shape[1] * n} rows, got "
                         f"{k.shape[1]}, {v.shape[1]} and {beta.shape[1]}.")
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalised(q), l2_normalised(k)
    queries, decays = delta_product_substeps(q, g, n)

    def run(q, k, v, beta, log_decay, initial_state, output_final_state):
        return delta_rule_chunked_states(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state)

    o, state = per_sequence(run, None if cu_seqlens is None else cu_seqlens * n,
                            dict(q=queries, k=k, v=v, beta=beta, log_decay=decays), initial_state, output_final_state)
    return o[:, n - 1::n], state
