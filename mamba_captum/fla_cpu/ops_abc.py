"""Plain-torch version of flash-linear-attention's ABC op (``fla.ops.abc.chunk_abc``, attention with bounded-memory
control), which fla's ``ABCAttention`` calls.

ABC is gated slot attention (:mod:`.ops_gsa`) whose slot write weights and decays come from the slot logits s alone
(fla's ``naive_recurrent_abc``): per head and slot m, z_t = log Σ_{r≤t} e^{s_r} (``logcumsumexp``), the normalised
write weight s̃_t = e^{s_t − z_t} and the log decay g_t = z_{t−1} − z_t (g_1 = 0), so that after token t the slot
memories hold the e^{s_r − z_t}-weighted averages of the keys and values r ≤ t (an initial state decays by
e^{z_1 − z_t})::

    ok_t = K^−½ Hk_tᵀ q_t,   p_t = softmax(ok_t) over the M slots,   o_t = Hv_tᵀ p_t

The normalisation is :func:`mamba_captum.kernels.gated_linear.abc_slot_gates` (GSA's additive gate, fla's own ABC
path of ``chunk_gsa``), kept in the work dtype; the two passes are :func:`.ops_gsa.chunk_gsa` over the library's
gated linear kernels.

Same signature and layout as fla's (q, k: (B, T, H, K), v: (B, T, H, V), s: (B, T, H, M); the state a pair
(B, H, K, M), (B, H, M, V); fla's op has neither a scale nor packed sequences); computes in float32 at least (float64
for float64 inputs); returns o in v's dtype and the final pair (or None); differentiable through autograd.
"""
from __future__ import annotations

from ..kernels.gated_linear import abc_slot_gates
from .ops_gsa import chunk_gsa


def chunk_abc(q, k, v, s, initial_state=None, output_final_state=False):
    """fla.ops.abc.chunk_abc: o (B, T, H, V) in v's dtype and, with ``output_final_state``, the final slot memories
    (Hk (B, H, K, M), Hv (B, H, M, V)) in float32 (float64 for float64 inputs), else None. initial_state: that pair,
    or None (zeros). The scale is K^−½, as fla's."""
    weights, log_decay = abc_slot_gates(s)
    o, (key_memory, value_memory) = chunk_gsa(q, k, v, weights, g=log_decay, scale=None,
                                              initial_state=initial_state, output_final_state=output_final_state)
    return o.to(v.dtype), ((key_memory, value_memory) if output_final_state else None)
