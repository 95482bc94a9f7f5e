"""Slot attention over gated linear attention: the additive slot gate and the key-memory read of
flash-linear-attention's gated slot attention (``fla.ops.gsa``: GSA, Raven) and ABC (``fla.ops.abc``).

Per head, M slots with write weights s_t (M) and log decays g_t ≤ 0 (M), one per slot; the key memory
Hk_t = Hk_{t−1} diag(e^{g_t}) + k_t s_tᵀ (K × M) is read by the query, ok_t = scale · Hk_tᵀ q_t, and the slot read
weights are p_t = softmax(ok_t) over the M slots (what the value memory, a plain GLA pass with queries p, keys s and
the decays g, is then read with). The key memory decays along its value side (the slots), which the GLA kernels do
not take; slot m of it is::

    ok_t[m] = scale · Σ_{r≤t} (q_t · k_r) e^{Γ_t,m − Γ_r,m} s_r,m          (Γ the cumulative g)

a GLA head of its own with one decay per head g[..., m] and the single value s[..., m]: :func:`slot_scores` runs it
through :func:`.chunked.gated_linear_chunked` over H·M heads of value width 1.

The additive gate (fla's ``fused_additive_gate``; ABC's slot gates, LightNet's key gate) normalises logits x
cumulatively over time: z_t = log(e^{z_0} + Σ_{s≤t} e^{x_s}), the normalised weight e^{x_t − z_t} and the log decay
z_{t−1} − z_t, so that after token t the memories hold e^{x_r − z_t}-weighted averages.

- :func:`additive_gate`: (weights, log decays, z_T) of whole sequences, from an optional z_0.
- :func:`abc_slot_gates`: ABC's slot write weights and log decays from its slot logits (no z_0), in float32 at least.
- :func:`slot_scores`: the key-memory read ok (B, T, H, M) and the final key memory.
- :func:`slot_read_weights`: p = softmax(ok) over the slots, zero initial key memory.
"""
from __future__ import annotations

import torch

from .chunked import gated_linear_chunked


def additive_gate(logits: torch.Tensor, initial_state: torch.Tensor | None = None):
    """The additive gate of whole sequences, computed in ``logits``' dtype (the caller chooses it).

    Args:
        logits: x (B, T, H, M), each row one sequence. initial_state: z_0 (B, 1, H, M), or None (z_0 = −∞: no state).
    Returns:
        (weights e^{x_t − z_t} (B, T, H, M), log decays g_t = z_{t−1} − z_t (B, T, H, M), with g = 0 where z_{t−1} = −∞
        (a sequence's first token without a state), z_T (B, 1, H, M): z_0 (or −∞) for an empty sequence).
    """
    if initial_state is None:
        initial_state = logits.new_full((logits.shape[0], 1, *logits.shape[2:]), float("-inf"))
    initial_state = initial_state.to(logits.dtype)
    if logits.shape[1] == 0:
        return logits.exp(), torch.zeros_like(logits), initial_state
    z = torch.logaddexp(torch.logcumsumexp(logits, dim=1), initial_state)
    previous = torch.cat([initial_state, z[:, :-1]], dim=1)
    fresh = torch.isneginf(previous)
    # the difference is formed only where z_{t−1} is finite (a −∞ would give the gradient a NaN)
    log_decay = torch.where(fresh, torch.zeros_like(z), previous.masked_fill(fresh, 0.0) - z)
    return (logits - z).exp(), log_decay, z[:, -1:]


def abc_slot_gates(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ABC's slot gates: (s̃, g), the normalised slot write weights e^{s_t − z_t} and the log decays z_{t−1} − z_t
    (0 at t = 1), both (B, T, H, M), from the slot logits s (B, T, H, M), z the running log-sum-exp over t (no initial
    state); float32 (float64 for float64 s)."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    weights, log_decay, _ = additive_gate(logits.to(work))
    return weights, log_decay


def slot_scores(q: torch.Tensor, k: torch.Tensor, slot_weights: torch.Tensor, log_decay: torch.Tensor, scale: float,
                initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """The key-memory read ok_t = scale · Hk_tᵀ q_t, each slot m a GLA head with the decay g[..., m] and the single
    value s[..., m] (module docstring), by :func:`.chunked.gated_linear_chunked` (differentiable).

    Args:
        q, k: (B, T, H, K). slot_weights s, log_decay g: (B, T, H, M). initial_state: Hk_0 (B, H, K, M) or None (zero).
    Returns:
        (ok (B, T, H, M), the final Hk (B, H, K, M) or None).
    """
    batch, length, heads, key_dim = q.shape
    slots = slot_weights.shape[-1]

    def per_slot(x):  # (B, T, H, K) -> (B, T, H·M, K): each slot its own head
        expanded = x[:, :, :, None].expand(batch, length, heads, slots, key_dim)
        return expanded.reshape(batch, length, heads * slots, key_dim)

    state = None
    if initial_state is not None:  # (B, H, K, M) -> (B, H·M, K, 1)
        state = initial_state.permute(0, 1, 3, 2).reshape(batch, heads * slots, key_dim, 1)
    values = slot_weights.reshape(batch, length, heads * slots, 1)
    decays = log_decay.reshape(batch, length, heads * slots)
    scores, final = gated_linear_chunked(per_slot(q), per_slot(k), values, decays, scale=scale,
                                         initial_state=state, output_final_state=output_final_state)
    if final is not None:
        final = final.reshape(batch, heads, slots, key_dim).transpose(-1, -2)
    return scores.reshape(batch, length, heads, slots), final


def slot_read_weights(q: torch.Tensor, k: torch.Tensor, slot_weights: torch.Tensor, log_decay: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """p (B, T, H, M): the softmax over the slots of :func:`slot_scores` from a zero key memory, in q's dtype.
    q, k (B, T, H, K); slot_weights s, log_decay g (B, T, H, M)."""
    return slot_scores(q, k, slot_weights, log_decay, scale)[0].softmax(-1)
