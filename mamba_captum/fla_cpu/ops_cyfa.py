"""Plain-torch versions of flash-linear-attention's Cyclic Flow Attention ops (``fla.ops.cyfa``: ``chunk_cyfa``,
``fused_recurrent_cyfa``), whose Triton kernels refuse CPU tensors, over :mod:`mamba_captum.kernels.cyclic_flow`
(CyFA's readout and key memory, which the adapter :mod:`mamba_captum.families.fla_cyfa` uses too); this module keeps
fla's signatures, argument checks, states and packed sequences.

CyFA (fla 0.6.0, ``fla/ops/cyfa/naive.py``), per head, with M slots (even), C = M − 1 readout rows, q and k through
RMS norms (weights, eps), the clock λ_t = λ_0 + Σ_{s≤t} δ_s and the write w_t = β_t · a(λ_t) (a: the slot atom,
:func:`~mamba_captum.kernels.cyclic_flow.rotate_atom`)::

    Hk_t = e^{g_t} Hk_{t−1} + k_t w_tᵀ   (K × M),      Hv_t = e^{g_t} Hv_{t−1} + w_t v_tᵀ   (M × V)
    z_t = R_{+λ_t}(scale · Hk_tᵀ q_t),   p_t = softmax(T z_t),   u_t = R_{−λ_t}(Tᵀ p_t),   o_t = Hv_tᵀ u_t

with T = readout · F (H, C, M) (F the fixed Fourier basis of :func:`~mamba_captum.kernels.cyclic_flow.readout_basis`)
and R_{±λ} the rotations of the slot pairs by the phases of λ (:func:`~mamba_captum.kernels.cyclic_flow.rotate_slots`).
Both memories are gated linear attention with one log decay g per head: z_t before its rotation is
GLA(scale · q, k, w) and o_t is GLA(u, w, v) with scale 1, so both run through
:func:`mamba_captum.kernels.gated_linear.gated_linear_chunked` (chunked, differentiable); the readout u_t depends on
q, k, g, δ, β and the readout, never on v: o is linear in the values, α[t, s] = u_tᵀ w_s e^{Γ_t − Γ_s} (s ≤ t,
Γ the cumulative g).

Same signatures and layout as fla's (B, T, H, ·); packed sequences through ``cu_seqlens`` (B = 1); the state is fla's
(Hk (N, H, K, M), Hv (N, H, M, V), λ (N, H)). Computed in float32 at least (float64 for float64 inputs; fla's
reference computes in float32), outputs in q's dtype, final states in the work dtype.
"""
from __future__ import annotations

import torch

from ..kernels.cyclic_flow import readout_table, value_memory_inputs
from ..kernels.gated_linear import gated_linear_chunked


def _work(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _one_sequence(q, k, v, g, delta, beta, table, q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps, scale,
                  initial_state, output_final_state):
    """CyFA on a (B, T, H, ·) batch whose rows are whole sequences; (o in the work dtype, (Hk, Hv, λ) or None)."""
    work = table.dtype
    key_state = value_state = clock_start = None
    if initial_state is not None:
        key_state, value_state, clock_start = (s.to(work) for s in initial_state)
    weights, write, lambdas, key_state = value_memory_inputs(
        q, k, g, delta, beta, table, q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps, scale, key_state,
        clock_start, output_final_state)
    out, value_state = gated_linear_chunked(weights, write, v.to(work), g.to(work), scale=1.0,
                                            initial_state=value_state, output_final_state=output_final_state)
    if not output_final_state:
        return out, None
    return out, (key_state, value_state, lambdas[:, -1])


def _cyfa(q, k, v, g, delta, beta, readout, q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps, scale,
          initial_state, output_final_state, cu_seqlens):
    if q.dim() != 4 or q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError("`q`, `k`, and `v` must have shape [B, T, H, D] and share [B, T, H].")
    if g.shape != q.shape[:3] or delta.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError("`g`, `delta`, and `beta` must have shape [B, T, H].")
    if readout.shape[0] != q.shape[2]:
        raise ValueError("`readout` must have shape [H, C, C].")
    table = readout_table(readout, _work(q))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    norms = (q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps, scale)
    if cu_seqlens is None:
        out, state = _one_sequence(q, k, v, g, delta, beta, table, *norms, initial_state, output_final_state)
        return out.to(q.dtype), state
    if q.shape[0] != 1:
        raise ValueError("Packed variable-length inputs must have batch size 1.")
    bounds = cu_seqlens.tolist()
    if bounds[-1] != q.shape[1]:
        raise ValueError("Packed sequence length does not match `cu_seqlens`.")
    outs, states = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = [t[:, start:end] for t in (q, k, v, g, delta, beta)]
        state_n = None if initial_state is None else tuple(s[n:n + 1] for s in initial_state)
        out, state = _one_sequence(*part, table, *norms, state_n, output_final_state)
        outs.append(out)
        states.append(state)
    out = torch.cat(outs, dim=1).to(q.dtype)
    if not output_final_state:
        return out, None
    return out, tuple(torch.cat(parts) for parts in zip(*states))


def chunk_cyfa(q, k, v, g, delta, beta, readout, q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps, scale=None,
               initial_state=None, output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
               checkpoint_level=0):
    """fla.ops.cyfa.chunk_cyfa in torch (see the module docstring), differentiable through autograd.

    Args:
        q, k: (B, T, H, K). v: (B, T, H, V). g: (B, T, H) log decays. delta: (B, T, H) clock steps. beta: (B, T, H)
            write strengths. readout: (H, C, C), C = M − 1. q_norm_weight, k_norm_weight: (K,); the eps: floats.
        scale: multiplies the normed queries; None → K^−½. initial_state: (Hk (N, H, K, M), Hv (N, H, M, V),
            λ (N, H)) or None. cu_seqlens: (N + 1) packed sequence bounds (B = 1) or None; cu_seqlens_cpu: the same on
            the host (unused: the bounds are read from cu_seqlens). checkpoint_level: fla's activation checkpointing
            (0 or 1; a memory choice without effect on the results here).

    Returns:
        (o (B, T, H, V) in q's dtype, (Hk, Hv, λ) when ``output_final_state`` else None).
    """
    if checkpoint_level not in (0, 1):
        raise ValueError("`checkpoint_level` must be either 0 or 1.")
    return _cyfa(q, k, v, g, delta, beta, readout, q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps, scale,
                 initial_state, output_final_state, cu_seqlens)


def fused_recurrent_cyfa(q, k, v, g, delta, beta, readout, q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps,
                         scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla.ops.cyfa.fused_recurrent_cyfa (fla's inference path) in torch: the same computation as
    :func:`chunk_cyfa` (arguments and returns as there)."""
    return _cyfa(q, k, v, g, delta, beta, readout, q_norm_weight, k_norm_weight, q_norm_eps, k_norm_eps, scale,
                 initial_state, output_final_state, cu_seqlens)
