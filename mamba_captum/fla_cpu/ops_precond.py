"""Plain-torch versions of flash-linear-attention 0.6.0's preconditioned delta rules
(``fla.ops.precond_gated_delta_rule``, ``fla.ops.precond_kda``) and of KDA's gate (``fla.ops.kda.gate.fused_kda_gate``),
over the library's kernels. Layout as fla's: q, k (B, T, H, K), v (B, T, HV, V) (HV a multiple of H: grouped value
heads), the state (N, HV, K, V); packed sequences through ``cu_seqlens`` (B = 1).

The rule (fla's ``naive_recurrent_precond_gated_delta_rule`` / ``naive_recurrent_precond_kda`` and their kernels),
per head with k (and q) L2-normalised where asked (eps 1e-6 inside the root, as fla's kernels)::

    A_t = exp(g^atk_t) A_{t−1} + β^atk_t k_t ⊙ k_t                         (the "ATK" diagonal state, K per key head)
    r_t = log(A_t + eps) − c_h,   M_t = exp(−log(x) · r_t / (1 + |r_t|)),   k̃_t = M_t ⊙ k_t   (M_t in [1/x, x])
    S_t = D_t S_{t−1} + β_t k̃_t (v_t − k_tᵀ D_t S_{t−1})ᵀ = (I − β_t k̃_t k_tᵀ) D_t S_{t−1} + β_t k̃_t v_tᵀ
    o_t = scale · S_tᵀ q_t

with c_h = ``log_atk_scale`` (−0.2 when None), D_t = exp(g_t) (one per value head: gated DeltaNet) or diag(exp(g_t))
(one per key channel: KDA). The ATK state has one head per key head for gated DeltaNet (its value heads in a group
share it) and one per value head for KDA (fla's PrecondKDA repeats q and k to the value heads). The preconditioner
rescales only the key that writes (k̃); the erase reads with k. The rule's math — the L2 norm, the ATK state (a gated
linear recurrence) and the rule as inputs of the diagonal-plus-low-rank rule (a = D_t k, b = −β k̃, the written key
β k̃) — is :mod:`mamba_captum.kernels.dplr.precond`, run by :func:`mamba_captum.kernels.dplr.dplr_chunked`; this
module keeps fla's signatures, argument checks and packed sequences.
"""
from __future__ import annotations

import math

import torch

from ..kernels.dplr import dplr_chunked, l2_normalised, precond_rule_inputs
from .ops import refuse


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _one_sequence(q, k, v, g, beta, g_atk, beta_atk, scale, initial_state, initial_A_state, output_final_state, x,
                  eps, log_atk_scale):
    q, written, read, erase, log_decay, final_A = precond_rule_inputs(q, k, g, beta, g_atk, beta_atk, log_atk_scale,
                                                                      x, eps, initial_A_state, output_final_state)
    o, state = dplr_chunked(q, written, v, read, erase, log_decay, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state)
    return o, state, final_A


def _precond_rule(op, q, k, v, g, beta, g_atk, beta_atk, scale, initial_state, initial_A_state, output_final_state,
                  use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout, x, eps, log_atk_scale):
    """(o (B, T, HV, V) in q's dtype, final state (N, HV, K, V) or None, final ATK state (N, H, K) or None)."""
    if q.shape[2] != k.shape[2] or v.shape[2] % k.shape[2]:
        raise ValueError(f"{op}: q and k need the same heads H and v a multiple of them, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}.")
    if beta.dim() != 3:
        refuse(op, **{f"a beta of shape {tuple(beta.shape)} (one per value channel)": True})
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalised(q), l2_normalised(k)
    if transpose_state_layout and initial_state is not None:  # fla's (N, HV, V, K) <-> the kernels' (N, HV, K, V)
        initial_state = initial_state.transpose(-1, -2)
    tensors = dict(q=q, k=k, v=v, g=g, beta=beta, g_atk=g_atk, beta_atk=beta_atk)
    options = dict(scale=scale, output_final_state=output_final_state, x=x, eps=eps, log_atk_scale=log_atk_scale)
    if cu_seqlens is None:
        o, state, final_A = _one_sequence(**tensors, initial_state=initial_state, initial_A_state=initial_A_state,
                                          **options)
    else:
        if q.shape[0] != 1:
            raise ValueError(f"{op}: the batch size is expected to be 1 rather than {q.shape[0]} with cu_seqlens.")
        bounds = cu_seqlens.tolist()
        parts = []
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            pick = lambda s: None if s is None else s[n:n + 1]  # noqa: E731
            parts.append(_one_sequence(**{name: t[:, start:end] for name, t in tensors.items()},
                                       initial_state=pick(initial_state), initial_A_state=pick(initial_A_state),
                                       **options))
        o = torch.cat([p[0] for p in parts], dim=1)
        state = torch.cat([p[1] for p in parts]) if output_final_state else None
        final_A = torch.cat([p[2] for p in parts]) if output_final_state else None
    if transpose_state_layout and state is not None:
        state = state.transpose(-1, -2)
    return o.to(q.dtype), state, final_A


def chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta, scale=None, initial_state=None,
                                   initial_A_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
                                   transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None):
    """fla.ops.precond_gated_delta_rule.chunk_precond_gated_delta_rule (module docstring): g (B, T, HV) one log decay
    per value head, g_atk and beta_atk (B, T, H), log_atk_scale (H,).

    Returns:
        (o (B, T, HV, V), final state (N, HV, K, V) or None, final ATK state (N, H, K) or None).
    """
    refuse("chunk_precond_gated_delta_rule", cp_context=cp_context)
    return _precond_rule("chunk_precond_gated_delta_rule", q, k, v, g, beta, g_atk, beta_atk, scale, initial_state,
                         initial_A_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                         transpose_state_layout, x, eps, log_atk_scale)


def fused_recurrent_precond_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, g_atk=None, beta_atk=None,
                                             scale=None, initial_state=None, initial_A_state=None,
                                             output_final_state=False, use_qk_l2norm_in_kernel=True, cu_seqlens=None,
                                             transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None):
    """fla.ops.precond_gated_delta_rule.fused_recurrent_precond_gated_delta_rule: a head decay g (B, T, HV) and / or a
    key-channel decay gk (B, T, HV, K) (fla applies both); β defaults to one. A value-channel decay gv is refused."""
    op = "fused_recurrent_precond_gated_delta_rule"
    refuse(op, gv=gv)
    if g_atk is None or beta_atk is None:
        raise ValueError(f"{op}: g_atk and beta_atk are required (the preconditioner's gate and strength).")
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    decay = None if g is None else g.to(torch.promote_types(g.dtype, torch.float32))[..., None]
    if gk is not None:
        gk = gk.to(torch.promote_types(gk.dtype, torch.float32))
        decay = gk if decay is None else decay + gk
    if decay is None:
        decay = torch.zeros(v.shape[:3], dtype=_compute_dtype(q), device=q.device)
    return _precond_rule(op, q, k, v, decay, beta, g_atk, beta_atk, scale, initial_state, initial_A_state,
                         output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout, x, eps,
                         log_atk_scale)


# -- PrecondKDA ---------------------------------------------------------------------------------------------------------
def fused_kda_gate(g, A_log=None, dt_bias=None, lower_bound=None, output_dtype=torch.float32):
    """fla.ops.kda.gate.fused_kda_gate, as its kernel computes it: −exp(A_log_h)·softplus(g + dt_bias), or with
    ``lower_bound`` lower_bound·σ(exp(A_log_h)·(g + dt_bias)); without A_log the factor exp(A_log_h) is e (no
    lower bound) or 1 (with one), as fla's kernel. Computed in float32 (float64 for float64 g), returned in
    ``output_dtype``.

    Args:
        g: (..., H, K) the raw gate input. A_log: (H,) or None. dt_bias: (H·K,) or None.
    """
    work = torch.float64 if g.dtype == torch.float64 else torch.float32
    heads, dim = g.shape[-2:]
    x = g.to(work)
    if dt_bias is not None:
        x = x + dt_bias.to(work).reshape(heads, dim)
    rate = None if A_log is None else A_log.to(work).reshape(heads, 1).exp()
    if lower_bound is None:
        out = -(math.e if rate is None else rate) * torch.nn.functional.softplus(x)
    else:
        out = lower_bound * torch.sigmoid(x if rate is None else rate * x)
    return out.to(output_dtype)


def _kda_decay(op, g, use_gate_in_kernel, A_log, dt_bias, lower_bound):
    if not use_gate_in_kernel:
        return g
    if A_log is None:  # fla's own check, kept
        raise ValueError(f"{op}: A_log must be provided when use_gate_in_kernel=True.")
    return fused_kda_gate(g, A_log, dt_bias, lower_bound, output_dtype=_compute_dtype(g))


def chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, scale=None, initial_state=None, initial_A_state=None,
                      output_final_state=False, use_gate_in_kernel=False, safe_gate=False, lower_bound=None,
                      cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, cp_context=None,
                      transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None, solve_tril_precision=None,
                      disable_recompute=False, return_intermediate_states=False, **kwargs):
    """fla.ops.precond_kda.chunk_precond_kda (module docstring): g (B, T, H, K) one log decay per key channel (or its
    raw input with ``use_gate_in_kernel``, A_log and dt_bias from the kwargs), g_atk and beta_atk (B, T, H),
    log_atk_scale (H,). q and k are always L2-normalised, as fla's kernel (it ignores ``use_qk_l2norm_in_kernel``).

    Returns:
        (o (B, T, H, V), final state (N, H, K, V) or None, final ATK state (N, H, K) or None).
    """
    op = "chunk_precond_kda"
    kwargs.pop("use_qk_l2norm_in_kernel", None)  # fla passes True to its kernel whatever is given
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    refuse(op, cp_context=cp_context, return_intermediate_states=return_intermediate_states, **kwargs)
    if safe_gate and use_gate_in_kernel and (lower_bound is None or not -5 <= lower_bound < 0):  # fla's check, kept
        raise ValueError(f"{op}: `lower_bound` must be in the safe range [-5, 0) with safe_gate=True, got "
                         f"{lower_bound}.")
    g = _kda_decay(op, g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    return _precond_rule(op, q, k, v, g, beta, g_atk, beta_atk, scale, initial_state, initial_A_state,
                         output_final_state, True, cu_seqlens, transpose_state_layout, x, eps, log_atk_scale)


def fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta, A_log=None, dt_bias=None, scale=None,
                                initial_state=None, initial_A_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, lower_bound=None,
                                cu_seqlens=None, transpose_state_layout=False, x=1.5, eps=1e-6, log_atk_scale=None,
                                **kwargs):
    """fla.ops.precond_kda.fused_recurrent_precond_kda: q, k (B, T, H, K), v (B, T, HV, V), g (B, T, HV, K),
    g_atk, beta_atk, beta (B, T, HV), log_atk_scale (HV,): the ATK state per value head. fla's function ignores its
    other ``kwargs``; so does this one."""
    op = "fused_recurrent_precond_kda"
    g = _kda_decay(op, g, use_gate_in_kernel, A_log, dt_bias, lower_bound)
    return _precond_rule(op, q, k, v, g, beta, g_atk, beta_atk, scale, initial_state, initial_A_state,
                         output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, transpose_state_layout, x, eps,
                         log_atk_scale)
