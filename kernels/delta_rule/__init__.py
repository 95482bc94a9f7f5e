"""The delta rule's implicit attention: one scalar weight per value head and token pair.

The (gated) delta rule (Qwen3-Next / Qwen3.5 / OLMo-hybrid's GatedDeltaNet; Kimi Linear's KDA with a decay per key
channel) keeps a state ``S_t`` (K × V per head) and, with values v_t::

    S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ,      o_t = S_tᵀ q_t,      D_t = diag(exp(g_t))

(g_t a scalar per head, or one per key channel for KDA; HF decays first, then applies the delta update). S_t is
linear in the values and the state's transition does not depend on them, so ``o_t = Σ_{s≤t} α[t, s] v_s`` with::

    α[t, s] = q_tᵀ (I − β_t k_t k_tᵀ) D_t ⋯ (I − β_{s+1} k_{s+1} k_{s+1}ᵀ) D_{s+1} β_s k_s

one number per head shared by all the head's value channels.

- :func:`delta_rule_alpha_naive`: the recurrence run on one-hot values (the value of token s is e_s), float64; the
  test reference.
- :func:`delta_rule_alpha_chunked`: the chunked WY form (a unit-triangular solve per chunk of C tokens and
  GEMMs against the state), O(L² K) per head and no L × L × K × K product; what the library runs.

With states, as a stand-in for flash-linear-attention's delta-rule ops (``chunk_delta_rule``,
``chunk_gated_delta_rule``, ``chunk_kda`` and their ``fused_recurrent_*`` twins with precomputed decays and betas):
``(o, final_state) = f(q, k, v, beta, log_decay=None, *, scale=None, initial_state=None, output_final_state=False)``
with o_t = scale · S_tᵀ q_t (scale default K^−½), v (B, L, HV, V), states (B, HV, K, V).

- :func:`delta_rule_recurrent`: token by token, the reference (equal to fla's ``naive.py`` recurrences).
- :func:`delta_rule_chunked_states`: the chunked WY form with the state carried between chunks (64 tokens per
  chunk, 8 with per-channel decays); autograd gives the gradients of every input.

Inputs: q, k (B, L, H, K) as the kernel sees them (normalised and scaled, key heads already repeated for the value
heads), beta (B, L, H), log_decay g (B, L, H) or (B, L, H, K), ≤ 0. Output α (B, H, L, L), zero above the diagonal.
"""
from __future__ import annotations

from .chunked import delta_rule_alpha_chunked, delta_rule_output_chunked
from .naive import delta_rule_alpha_naive
from .recurrent import delta_rule_recurrent
from .states import delta_rule_chunked_states

__all__ = ["delta_rule_alpha", "delta_rule_alpha_chunked", "delta_rule_alpha_naive", "delta_rule_output_chunked",
           "delta_rule_recurrent", "delta_rule_chunked_states"]


def delta_rule_alpha(q, k, beta, log_decay, *, last_row=None):
    """α (B, H, L, L) of the (gated) delta rule (module docstring), by the chunked WY form.

    Args:
        q, k: (B, L, H, K). beta: (B, L, H). log_decay: (B, L, H) or (B, L, H, K). last_row: rows after it are
        left zero (not computed).
    """
    return delta_rule_alpha_chunked(q, k, beta, log_decay, last_row=last_row)
