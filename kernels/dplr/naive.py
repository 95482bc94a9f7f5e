"""The generalized delta rule with a diagonal-plus-low-rank transition (DPLR), token by token: the reference.

Per head, with the state S (K × V), D_t = diag(e^{g_t}) (one log decay per key channel)::

    S_t = D_t S_{t−1} + b_t (a_tᵀ S_{t−1}) + k_t v_tᵀ = (D_t + b_t a_tᵀ) S_{t−1} + k_t v_tᵀ,      o_t = scale · S_tᵀ q_t

The low-rank term reads the state before the decay. This is flash-linear-attention 0.6.0's
``fla/ops/generalized_delta_rule/dplr/naive.py`` ``dplr_recurrence(q, k, v, alpha, beta, gk)`` with alpha = a,
beta = b, gk = g (``_kv = k vᵀ + beta (alphaᵀ S)``, ``S = S·e^{gk} + _kv``, ``o = (scale q)ᵀ S``), and what its
Triton kernels (``fused_recurrent_dplr_delta_rule``, ``chunk_dplr_delta_rule``) compute. The state is laid out
(B, H, K, V) as fla's.
"""
from __future__ import annotations

import torch


def prepare_inputs(q, k, v, a, b, log_decay, scale, initial_state):
    """Checked inputs in one compute dtype, laid out (B, H, L, ·) and contiguous, q multiplied by scale.

    Returns (q, k, v, a, b, log_decay, initial_state). The compute dtype is q's, raised to float32 for half types.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be (B, L, H, K), got {tuple(q.shape)}")
    for name, x in (("k", k), ("a", a), ("b", b), ("log_decay", log_decay)):
        if x.shape != q.shape:
            raise ValueError(f"{name} must be (B, L, H, K) = {tuple(q.shape)}, got {tuple(x.shape)}")
    batch, length, heads, dim = q.shape
    if v.dim() != 4 or v.shape[:3] != (batch, length, heads):
        raise ValueError(f"v must be (B, L, H, V) with (B, L, H) = {(batch, length, heads)}, got {tuple(v.shape)}")
    if initial_state is not None and initial_state.shape != (batch, heads, dim, v.shape[-1]):
        raise ValueError(f"initial_state must be (B, H, K, V) = {(batch, heads, dim, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = dim ** -0.5 if scale is None else scale
    head_first = lambda x: x.to(dtype).transpose(1, 2).contiguous()  # noqa: E731
    q = head_first(q) * scale
    k, v, a, b, log_decay = (head_first(x) for x in (k, v, a, b, log_decay))
    initial_state = None if initial_state is None else initial_state.to(dtype)
    return q, k, v, a, b, log_decay, initial_state


def dplr_recurrent(q, k, v, a, b, log_decay, *, scale=None, initial_state=None, output_final_state=False):
    """The DPLR recurrence run token by token (module docstring); differentiable through autograd.

    The operations are fla's ``dplr_recurrence`` ones in the same order, so in float64 the two agree to the last
    bit (fla's reference itself casts to float32 first; see the tests).

    Args:
        q, k, a, b, log_decay: (B, L, H, K); log_decay g is the natural log of the per-channel decay (fla's gk).
        v: (B, L, H, V). scale: multiplies q, default K^−½ (RWKV-7 uses 1). initial_state: (B, H, K, V) or None
            (zero).
    Returns:
        (o, final_state): o (B, L, H, V) in v's dtype; final_state (B, H, K, V) in the compute dtype (q's dtype,
        float32 for half types) when ``output_final_state``, else None.
    """
    out_dtype = v.dtype
    q, k, v, a, b, log_decay, state = prepare_inputs(q, k, v, a, b, log_decay, scale, initial_state)
    batch, heads, length, dim = q.shape
    if state is None:
        state = q.new_zeros(batch, heads, dim, v.shape[-1])
    outputs = []
    for t in range(length):
        update = k[:, :, t, :, None] * v[:, :, t, None, :] \
            + (state * a[:, :, t, :, None]).sum(-2, keepdim=True) * b[:, :, t, :, None]
        state = state * log_decay[:, :, t].exp()[..., None] + update
        outputs.append(torch.einsum("bhd,bhdm->bhm", q[:, :, t], state))
    output = torch.stack(outputs, dim=1).to(out_dtype)  # (B, L, H, V)
    return output, (state if output_final_state else None)
