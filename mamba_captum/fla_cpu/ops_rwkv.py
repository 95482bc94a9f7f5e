"""Plain-torch versions of flash-linear-attention's RWKV-7 fused functions (``fla.ops.rwkv7``) that
``RWKV7Attention`` calls besides its core op: the six token-shift interpolations, the key update, the output
correction with the gate, and the recurrent core of its inference path (``fused_mul_recurrent_rwkv7``, over
:mod:`mamba_captum.kernels.dplr`); and the squared ReLU of its channel mix.

Each has its fla function's signature and computes what fla's torch reference computes (``torch_addcmul_rwkv7``,
``k_update_ref``, ``gate_output_correction_ref``, the DPLR recurrence with a = −kk, b = kk ⊙ a); autograd gives
the gradients. The chunked core (``chunk_rwkv7``) and ``fused_recurrent_rwkv7`` are in :mod:`.ops`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.dplr.chunked import dplr_chunked
from .ops import per_sequence, refuse


def sqrelu(x):
    """fla.modules.activations.ops.sqrelu (``SquaredReLUFunction``, RWKV-7's channel mix; fla's forward and backward
    are ``torch.compile``d, which on a CPU costs a C++ build of seconds per shape): ``relu(x)²`` formed in float32
    (float64 stays), in x's dtype."""
    work = x.float() if x.dtype != torch.float64 else x
    return F.relu(work).square().to(x.dtype)


def fused_addcmul_rwkv7(hidden_states, delta, xr, xw, xk, xv, xa, xg=None):
    """fla.ops.rwkv7.fused_addcmul.fused_addcmul_rwkv7: ``x + delta ⊙ x_∗`` for each of the six mixing vectors
    (x_∗ (1, 1, D)); hidden_states, delta (B, T, D). Returns six (B, T, D) tensors, the last None without ``xg``."""
    mixed = [torch.addcmul(hidden_states, delta, weight) for weight in (xr, xw, xk, xv, xa)]
    mixed.append(None if xg is None else torch.addcmul(hidden_states, delta, xg))
    return tuple(mixed)


def fused_k_rwkv7(k, a, ka, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla.ops.rwkv7.fused_k_update.fused_k_rwkv7: ``k ⊙ (1 + (a − 1) ⊙ k_a)`` (fla's ``k.addcmul(k (a − 1), ka)``);
    k, a (B, T, D), ka (D,). Elementwise, so packed sequences (``cu_seqlens``) need nothing."""
    return k.addcmul(k * (a - 1), ka)


def gate_output_correction(o, r, k, r_k, v, g):
    """fla.ops.rwkv7.gate_output_correction.gate_output_correction: ``(o + (Σ_K r ⊙ k ⊙ r_k) v) ⊙ g``, RWKV-7's
    bonus of the current token's value and the output gate. o, g (B, T, H·V); r, k (B, T, H, K); r_k (H, K);
    v (B, T, H, V)."""
    bonus = (r * k * r_k[None, None]).sum(-1, keepdim=True)  # (B, T, H, 1)
    return (o + (bonus * v).reshape(o.shape)) * g


def fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=None, output_final_state=False,
                              reverse=False, cu_seqlens=None):
    """fla.ops.rwkv7.fused_recurrent.fused_mul_recurrent_rwkv7 (RWKV-7's path for short sequences without
    gradients): the DPLR recurrence ``S_t = (diag(exp(w_t)) − (kk_t ⊙ a_t) kk_tᵀ) S_{t−1} + k_t v_tᵀ``,
    ``o_t = scale · S_tᵀ r_t``, i.e. the generalized delta rule with a = −kk (read) and b = kk ⊙ a (write).

    Args:
        r, w, k, kk, a: (B, T, H, K), w the log decays. v: (B, T, H, V). scale: None gives K^−½ as fla.
        initial_state: (N, H, K, V) or None. cu_seqlens: (N + 1) packed sequences (B = 1) or None.
    Returns:
        (o (B, T, H, V), final state (N, H, K, V) or None).
    """
    refuse("fused_mul_recurrent_rwkv7", reverse=reverse)
    scale = r.shape[-1] ** -0.5 if scale is None else scale

    def run(q, k, v, a, b, log_decay, initial_state, output_final_state):
        return dplr_chunked(q, k, v, a, b, log_decay, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state)

    return per_sequence(run, cu_seqlens, dict(q=r, k=k, v=v, a=-kk, b=kk * a, log_decay=w), initial_state,
                        output_final_state)
