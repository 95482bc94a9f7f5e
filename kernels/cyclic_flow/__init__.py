"""Cyclic Flow Attention (flash-linear-attention 0.6.0's CyFA, ``fla/ops/cyfa``), in plain torch.

Per head, with M slots (even), C = M − 1 readout rows, q and k through RMS norms, the clock λ_t = λ_0 + Σ_{s≤t} δ_s and
the write w_t = β_t · a(λ_t) (a the slot atom)::

    Hk_t = e^{g_t} Hk_{t−1} + k_t w_tᵀ   (K × M),      Hv_t = e^{g_t} Hv_{t−1} + w_t v_tᵀ   (M × V)
    z_t = R_{+λ_t}(scale · Hk_tᵀ q_t),   p_t = softmax(T z_t),   u_t = R_{−λ_t}(Tᵀ p_t),   o_t = Hv_tᵀ u_t

with T = readout · F (H, C, M) (F a fixed Fourier basis) and R_{±λ} the rotations of the slot pairs by the phases
of λ. Both memories are gated linear attention with one log decay per head (:mod:`mamba_captum.kernels.gated_linear`);
u_t reads q, k, g, δ, β and the readout, never v, so o is linear in the values: α[t, s] = u_tᵀ w_s e^{Γ_t − Γ_s}.

- ``readout.py`` (no recurrence): :func:`readout_basis`, :func:`readout_table`, :func:`num_slots_of`,
  :func:`rotate_atom`, :func:`rotate_slots`, :func:`write_vectors`, :func:`readout_weights`, :func:`rms_normed`.
- ``memory.py``: :func:`value_memory_inputs`, the query u and the keys w of the value memory (the key memory run
  by the chunked GLA kernel).
"""
from __future__ import annotations

from .memory import value_memory_inputs
from .readout import (num_slots_of, readout_basis, readout_table, readout_weights, rms_normed, rotate_atom,
                      rotate_slots, write_vectors)

__all__ = ["num_slots_of", "readout_basis", "readout_table", "readout_weights", "rms_normed", "rotate_atom",
           "rotate_slots", "value_memory_inputs", "write_vectors"]
