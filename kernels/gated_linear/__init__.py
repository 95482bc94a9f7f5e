"""Gated linear attention: the recurrences of flash-linear-attention's GLA family, exact and differentiable in torch.

Per head, a state S (K × V), queries and keys q_t, k_t (K), values v_t (V), log decays g_t ≤ 0 and
D_t = diag(e^{g_t})::

    GLA convention (write, then read):
        S_t = D_t S_{t−1} + k_t v_tᵀ,                              o_t = scale · S_tᵀ q_t
    RWKV-6 convention (read, then write; bonus u (K) per head):
        o_t = scale · (S_{t−1} + diag(u) k_t v_tᵀ)ᵀ q_t,           S_t = D_t S_{t−1} + k_t v_tᵀ

The log decay g_t is one per key channel (B, L, H, K), one per head (B, L, H) — the same for every channel — or
absent (D_t = I). With zero initial state o_t = Σ_{s≤t} α[t, s] v_s, one weight per head and token pair::

    GLA:     α[t, s] = scale · q_tᵀ diag(e^{Γ_t − Γ_s}) k_s        (s ≤ t),      Γ_t = Σ_{r≤t} g_r
    RWKV-6:  α[t, s] = scale · q_tᵀ diag(e^{Γ_{t−1} − Γ_s}) k_s    (s < t),      α[t, t] = scale · q_tᵀ diag(u) k_t

Which flash-linear-attention (0.6) ops these are (same B, T, H, K layout, state (N, H, K, V), scale default K^−½):

- ``fla.ops.gla.chunk_gla`` / ``fused_recurrent_gla`` (``gk``; ``naive_recurrent_gla``): GLA, per-channel decays.
  HGRN2 calls ``chunk_gla`` with k = 1 − f, g = log f (and ``state_v_first=True``: its cache holds Sᵀ).
- ``fla.ops.simple_gla.chunk_simple_gla`` (``g`` (B, T, H)): GLA with one decay per head; ``g_gamma`` (H,) is that
  decay held constant over time. ``fla.ops.retention.chunk_retention`` is simple GLA with
  g_gamma[h] = log(1 − 2^{−5−h}).
- ``fla.ops.linear_attn`` (``naive_recurrent_linear_attn``, ``normalize=False``): GLA with no decay. Its
  ``normalize=True`` divides o_t by scale · q_tᵀ Σ_{s≤t} k_s afterwards; that division is not part of these kernels.
- ``fla.ops.rwkv6.chunk_rwkv6`` / ``fused_recurrent_rwkv6`` (r, k, v, w, u): the RWKV-6 convention. Verified against
  ``fused_recurrent_rwkv6_fwd_kernel``: per token it computes ``o = Σ_K (h + u ⊙ k vᵀ) ⊙ (scale · q)`` with the
  state h before the token, then ``h = h · exp(w) + k vᵀ`` — the read comes before the decay w_t and the write, and
  scale multiplies q (None → K^−½; fla's RWKV-6 layer passes scale=1).

Functions (all return ``(o, final_state)``, final_state None unless ``output_final_state``):

- :func:`gated_linear_recurrent` (naive.py): the token loop, in the input dtype; the reference.
- :func:`gated_linear_chunked` (chunked.py): chunks with state passing and intra-chunk pairwise terms, every
  exponent ≤ 0; float32 accumulation at least; differentiable through autograd.
- :func:`gated_linear_alpha`, :func:`gated_linear_alpha_rows`: α (B, H, L, L), or chosen rows (H, R, L) of one
  batch element blocked by columns (no L × L × K tensor).

Slot attention over these kernels (slots.py; fla's gated slot attention (GSA, Raven) and ABC):

- :func:`slot_scores`, :func:`slot_read_weights`: the key-memory read of M slots (B, T, H, M), one GLA head per slot,
  and its softmax over the slots.
- :func:`additive_gate`, :func:`abc_slot_gates`: the cumulative (log-sum-exp) normalisation of slot logits into write
  weights and log decays (fla's ``fused_additive_gate``; ABC's slot gates).
"""
from __future__ import annotations

from .chunked import gated_linear_alpha, gated_linear_alpha_rows, gated_linear_chunked
from .naive import gated_linear_recurrent
from .slots import abc_slot_gates, additive_gate, slot_read_weights, slot_scores

__all__ = ["abc_slot_gates", "additive_gate", "gated_linear_alpha", "gated_linear_alpha_rows", "gated_linear_chunked",
           "gated_linear_recurrent", "slot_read_weights", "slot_scores"]
