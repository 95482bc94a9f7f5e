"""The (gated) delta rule with states, token by token: the reference for :mod:`.states`.

Per head, with the state S (K × V), D_t = diag(e^{g_t}) (g_t a scalar per head, one number per key channel for
KDA, or 0 for the plain delta rule)::

    S_t = (I − β_t k_t k_tᵀ) D_t S_{t−1} + β_t k_t v_tᵀ        o_t = scale · S_tᵀ q_t

The decay comes first, then the delta update, and the output reads the updated state; scale multiplies q (default
K^−½). This is the order of flash-linear-attention 0.6.0's references (``fla/ops/delta_rule/naive.py``
``delta_rule_recurrence``, ``gated_delta_rule/naive.py`` ``naive_recurrent_gated_delta_rule``, ``kda/naive.py``
``naive_recurrent_kda``): ``h *= exp(g_t)``, then ``h += k_t ⊗ β_t (v_t − hᵀ k_t)``, then ``o_t = hᵀ (scale q_t)``.
The state is laid out (B, H, K, V) as fla's default (``state_v_first=False``).
"""
from __future__ import annotations

import torch


def prepare_inputs(q, k, v, beta, log_decay, scale, initial_state):
    """Checked inputs in one compute dtype, q and k repeated for grouped value heads, q multiplied by scale.

    Returns (q, k, v, beta, log_decay, initial_state); log_decay is left as given. The compute dtype is q's, raised
    to float32 for bfloat16 / float16 (sums over tokens in 8 or 11 mantissa bits lose too much).
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (B, L, H, K), got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, length, heads, dim = q.shape
    if v.dim() != 4 or v.shape[:2] != (batch, length) or v.shape[2] % heads:
        raise ValueError(f"v must be (B, L, HV, V) with HV a multiple of H = {heads}, got {tuple(v.shape)}")
    value_heads = v.shape[2]
    if beta.shape != (batch, length, value_heads):
        raise ValueError(f"beta must be (B, L, HV) = {(batch, length, value_heads)}, got {tuple(beta.shape)}")
    if log_decay is not None and log_decay.shape not in ((batch, length, value_heads),
                                                         (batch, length, value_heads, dim)):
        raise ValueError(f"log_decay must be (B, L, HV) or (B, L, HV, K), got {tuple(log_decay.shape)}")
    if initial_state is not None and initial_state.shape != (batch, value_heads, dim, v.shape[-1]):
        raise ValueError(f"initial_state must be (B, HV, K, V) = {(batch, value_heads, dim, v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    dtype = torch.promote_types(q.dtype, torch.float32)
    scale = dim ** -0.5 if scale is None else scale
    q, k = q.to(dtype) * scale, k.to(dtype)
    if value_heads != heads:  # grouped value heads (fla's GVA): value head h reads query / key head h // group
        q, k = (x.repeat_interleave(value_heads // heads, dim=2) for x in (q, k))
    initial_state = None if initial_state is None else initial_state.to(dtype)
    return q, k, v.to(dtype), beta.to(dtype), log_decay, initial_state


def delta_rule_recurrent(q, k, v, beta, log_decay=None, *, scale=None, initial_state=None,
                         output_final_state=False):
    """The (gated) delta rule run token by token (module docstring); differentiable through autograd.

    Args:
        q, k: (B, L, H, K). v: (B, L, HV, V), HV a multiple of H (value head h uses q / k head h // (HV / H)).
        beta: (B, L, HV). log_decay: None (no decay), (B, L, HV) (one per head: gated delta rule) or (B, L, HV, K)
            (one per key channel: KDA); ≤ 0. scale: multiplies q, default K^−½. initial_state: (B, HV, K, V) or
            None (zero).
    Returns:
        (o, final_state): o (B, L, HV, V) in v's dtype; final_state (B, HV, K, V) in the compute dtype (q's dtype,
        float32 for half types) when ``output_final_state``, else None.
    """
    out_dtype = v.dtype
    q, k, v, beta, log_decay, state = prepare_inputs(q, k, v, beta, log_decay, scale, initial_state)
    batch, length, heads, dim = v.shape[:3] + (q.shape[-1],)
    if state is None:
        state = q.new_zeros(batch, heads, dim, v.shape[-1])
    decays = [None] * length if log_decay is None else log_decay.to(q.dtype).exp().unbind(1)  # (B, H[, K]) each
    outputs = []
    # unbind, not indexing per token: the backward of an index is a zero tensor of the whole input per token
    for q_t, k_t, v_t, beta_t, decay_t in zip(q.unbind(1), k.unbind(1), v.unbind(1), beta.unbind(1), decays):
        if decay_t is not None:
            state = state * (decay_t[..., None, None] if decay_t.dim() == 2 else decay_t[..., None])
        update = beta_t[..., None] * (v_t - torch.einsum("bhk,bhkv->bhv", k_t, state))
        state = state + k_t[..., None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, state))
    output = torch.stack(outputs, dim=1).to(out_dtype)
    return output, (state if output_final_state else None)
