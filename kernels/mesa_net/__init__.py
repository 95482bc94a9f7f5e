"""MesaNet's rule (flash-linear-attention's ``mesa_net``): two gated states read through a fixed-step
conjugate-gradient solve.

Per head, with one log decay g_t per token, the write strength β_t and the ridge λ (K,)::

    H^kk_t = e^{g_t} H^kk_{t−1} + β_t k_t k_tᵀ,    H^kv_t = e^{g_t} H^kv_{t−1} + β_t k_t v_tᵀ,    o_t = H^kv_tᵀ q*_t

where q*_t approximates (H^kk_t + diag λ)^{−1} q_t by exactly ``iterations`` conjugate-gradient steps as fla's kernels
take them (no stopping test; 1e−5 added to both denominators): from x = 0 (fla's chunk kernel), or from the Jacobi
guess q_t / (diag H^kk_t + λ + 1e−5) (fla's decoding kernel). With H^kk_0 = 0 the state is Σ β k kᵀ (positive
semi-definite), so the matrix is symmetric positive definite for λ > 0. q* depends on q, k, β, g and λ, never on v:
o is linear in v, α[t, s] = e^{Γ_t − Γ_s} β_s k_sᵀ q*_t (s ≤ t, Γ the cumulative g), a gated linear attention over
(q*, β k) with one decay per head.

- :func:`mesa_recurrent`: the per-token reference (explicit K × K states, one token at a time; any dtype).
- :func:`mesa_chunked`, :func:`mesa_query`: all tokens at once, each CG product (H^kk_t + diag λ) p_t being one
  gated linear attention read (:func:`mamba_captum.kernels.gated_linear.gated_linear_chunked`, queries p, keys β k,
  values k); differentiable through autograd.
"""
from __future__ import annotations

from .chunked import conjugate_gradient, mesa_chunked, mesa_query
from .recurrent import mesa_recurrent

__all__ = ["conjugate_gradient", "mesa_chunked", "mesa_query", "mesa_recurrent"]
