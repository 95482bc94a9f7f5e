"""Cyclic Flow Attention's key memory and readout: the query and the keys of its value memory, everything of CyFA
(flash-linear-attention 0.6.0, ``fla/ops/cyfa/naive.py``) that does not read the values. Per head, with q and k
through their RMS norms, the clock λ_t = λ_0 + Σ_{s≤t} δ_s and the write w_t = β_t · a(λ_t)::

    Hk_t = e^{g_t} Hk_{t−1} + k_t w_tᵀ   (K × M),      z_t = scale · Hk_tᵀ q_t
    u_t = R_{−λ_t}(Tᵀ softmax(T R_{+λ_t} z_t))                                  (:mod:`.readout`)

then o_t = Hv_tᵀ u_t with Hv_t = e^{g_t} Hv_{t−1} + w_t v_tᵀ: gated linear attention with query u, key w, one log
decay per head and scale 1, linear in v. The key memory is GLA(scale · q, k, w) too: both run through
:func:`mamba_captum.kernels.gated_linear.gated_linear_chunked`.
"""
from __future__ import annotations

import torch

from ..gated_linear.chunked import gated_linear_chunked
from .readout import readout_weights, rms_normed, write_vectors


def value_memory_inputs(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, delta: torch.Tensor, beta: torch.Tensor,
                        table: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                        q_norm_eps: float, k_norm_eps: float, scale: float, key_state: torch.Tensor | None = None,
                        clock_start: torch.Tensor | None = None, output_final_state: bool = False):
    """The query u and the keys w of CyFA's value memory (o_t = Σ_{s≤t} e^{Γ_t − Γ_s} (u_tᵀ w_s) v_s + the decayed
    initial Hv) for a batch whose rows are whole sequences: everything of CyFA that does not read the values.

    Args:
        q, k: (B, T, H, K) before their norms. g, delta, beta: (B, T, H). table: the readout table (H, C, M) from
            :func:`.readout.readout_table`, in the work dtype. q_norm_weight, k_norm_weight (K,), q_norm_eps,
            k_norm_eps, scale: as fla's op takes them (scale a float). key_state: Hk_0 (B, H, K, M) or None (zero).
            clock_start: λ_0 (B, H) or None (zero).

    Returns:
        (u (B, T, H, M), w (B, T, H, M), λ (B, T, H), the final Hk (B, H, K, M) or None), in the table's dtype.
    """
    work = table.dtype
    num_slots = table.shape[-1]
    q = rms_normed(q.to(work), q_norm_weight, q_norm_eps)
    k = rms_normed(k.to(work), k_norm_weight, k_norm_eps)
    lambdas = delta.to(work).cumsum(1)
    if clock_start is not None:
        lambdas = lambdas + clock_start.to(work)[:, None, :]
    write = write_vectors(beta.to(work), lambdas, num_slots)
    raw_logits, key_state = gated_linear_chunked(q, k, write, g.to(work), scale=scale,
                                                 initial_state=None if key_state is None else key_state.to(work),
                                                 output_final_state=output_final_state)
    return readout_weights(raw_logits, lambdas, table), write, lambdas, key_state
