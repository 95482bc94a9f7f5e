"""RWKV-7's generalized delta rule: a diagonal-plus-low-rank (DPLR) state transition, in plain torch.

Per head, with the state S (K × V, laid out (B, H, K, V) as fla's), per-channel log decays g_t (D_t = diag(e^{g_t}))
and values v_t::

    S_t = D_t S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ = (D_t + b_t a_tᵀ) S_{t−1} + k_t v_tᵀ,      o_t = scale · S_tᵀ q_t

(the low-rank term reads the state before the decay). This is flash-linear-attention 0.6.0's
``fla.ops.generalized_delta_rule`` DPLR rule with its argument names q, k, v, a, b, gk = log_decay:
``dplr/naive.py`` ``dplr_recurrence`` (alpha = a, beta = b; head-first, scale fixed at K^−½),
``fused_recurrent_dplr_delta_rule`` and ``chunk_dplr_delta_rule`` (scale default K^−½). The IPLR rule
(``iplr``) is the case g = 0. S_t is linear in the values and its transition does not depend on them, so with a
zero initial state ``o_t = Σ_{s≤t} α[t, s] v_s`` per head, with::

    α[t, s] = scale · q_tᵀ (D_t + b_t a_tᵀ) ⋯ (D_{s+1} + b_{s+1} a_{s+1}ᵀ) k_s

RWKV-7 (``fla/layers/rwkv7.py`` ``RWKV7Attention``): ``chunk_rwkv7(r, w, k, v, a=-kk, b=kk * a, scale=1.)`` (chunk
mode, and whenever training, grad is enabled or L ≥ 64) and ``fused_mul_recurrent_rwkv7(r, w, k, v, kk, a,
scale=1.)`` (inference, which forms −kk and kk ⊙ a in the kernel) both compute this rule with::

    q = r,   log_decay = w = −e^{−1/2} · sigmoid(w_lora(x_w)) ∈ (−0.607, 0),   k = k ⊙ (1 + (a − 1) ⊙ k_a),   v = v,
    a = −kk,   b = kk ⊙ a,   scale = 1

where a = sigmoid(a_lora(x_a)) is the in-context learning rate and kk = normalize(k_proj(x_k) ⊙ k_k) per head (the
key before the k_a update), so the transition is D_t − (kk ⊙ a)(kk)ᵀ. ``chunk_rwkv7`` / ``fused_recurrent_rwkv7``
pass (r, w, k, v, a, b) to the DPLR ops unchanged (``gk = w``, natural-log decays).

- :func:`dplr_recurrent` (``naive.py``): the per-token loop, fla's ``dplr_recurrence`` operation for operation
  (bitwise equal in float64 and float32); the reference.
- :func:`dplr_chunked` (``chunked.py``): the chunked WY (UT) form of ``chunk_dplr_delta_rule``, differentiable,
  exact for log decays of any magnitude; what the library runs.
- :func:`dplr_alpha`: α (B, H, L, L) by the chunk operators; :func:`dplr_alpha_rows`: rows of one batch element,
  (H, R, L), carried backwards from the rows (O(N · R · K²) for N chunks).

Inputs: q, k, a, b, log_decay (B, L, H, K); v (B, L, H, V); initial_state (B, H, K, V). Outputs o (B, L, H, V),
final_state (B, H, K, V) or None.

The preconditioned delta rules (``fla.ops.precond_gated_delta_rule``, ``fla.ops.precond_kda``) are this rule with
a = D_t k, b = −β k̃ and the written key β k̃ (``precond.py``): :func:`atk_preconditioned_keys` (k̃ from the
"ATK" diagonal state), :func:`precond_dplr_inputs`, :func:`precond_rule_inputs` (both), and :func:`l2_normalised`,
fla's in-kernel L2 norm of q and k.
"""
from __future__ import annotations

from .chunked import dplr_alpha, dplr_alpha_rows, dplr_chunked
from .naive import dplr_recurrent
from .precond import atk_preconditioned_keys, l2_normalised, precond_dplr_inputs, precond_rule_inputs

__all__ = ["atk_preconditioned_keys", "dplr_alpha", "dplr_alpha_rows", "dplr_chunked", "dplr_recurrent",
           "l2_normalised", "precond_dplr_inputs", "precond_rule_inputs"]
