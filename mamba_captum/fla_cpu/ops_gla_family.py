"""Plain-torch versions of the fla functions that the GLA-family layers call besides the gated linear ops of
:mod:`.ops`: linear attention's normaliser (``fla.ops.linear_attn.utils.normalize_with_z_state``, taken by
``chunk_linear_attn`` / ``fused_chunk_linear_attn`` / ``fused_recurrent_linear_attn`` with ``normalize=True``; their
unnormalised part already runs through the simple-GLA swaps) and the additive gate of LightNet and GSA
(``fla.ops.gsa.gate.fused_additive_gate``, over :func:`mamba_captum.kernels.gated_linear.additive_gate`).

Each has its fla function's signature and fla's layout (x, q, k: (B, T, H, K); packed sequences through
``cu_seqlens`` with B = 1), and computes in float32 at least (float64 for float64 inputs), differentiable through
autograd.
"""
from __future__ import annotations

import torch

from ..kernels.gated_linear import additive_gate


def _work(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _bounds(cu_seqlens, length: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, length)]
    edges = cu_seqlens.tolist()
    return list(zip(edges[:-1], edges[1:]))


def _cumsum(x: torch.Tensor, reverse: bool, cu_seqlens) -> torch.Tensor:
    """The running sum over time of each sequence (from its end with ``reverse``), in x's work dtype."""
    work = x.to(_work(x))
    parts = []
    for start, end in _bounds(cu_seqlens, x.shape[1]):
        piece = work[:, start:end]
        parts.append(piece.flip(1).cumsum(1).flip(1) if reverse else piece.cumsum(1))
    return torch.cat(parts, dim=1) if parts else work


def normalize_with_z_state(o, q, k, scale, z_init, reverse, cu_seqlens):
    """fla.ops.linear_attn.utils.normalize_with_z_state: o_t / (scale · q_t · Z_t + 1e-10) with the running key sum
    Z_t = z_init + Σ_{s≤t} k_s (Σ_{s≥t} with ``reverse``), per packed sequence. Returns (the normalised o, the key
    sum at each sequence's boundary (N, 1, H, K): its last token, its first with ``reverse``, z_init (or 0) for an
    empty sequence)."""
    k_cum = _cumsum(k, reverse, cu_seqlens).to(k.dtype)
    if z_init is not None:
        if cu_seqlens is not None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
            k_cum = k_cum + z_init.squeeze(1).repeat_interleave(lengths, dim=0).unsqueeze(0)
        else:
            k_cum = k_cum + z_init
    denominator = (q * scale * k_cum).sum(-1, keepdim=True) + 1e-10
    normalised = o / denominator
    if cu_seqlens is None:
        z_state = k_cum[:, :1] if reverse else k_cum[:, -1:]
        return normalised, z_state.contiguous()
    states = []
    for n, (start, end) in enumerate(_bounds(cu_seqlens, k.shape[1])):
        if end > start:
            states.append(k_cum[0, start if reverse else end - 1][None, None])
        elif z_init is not None:  # an empty sequence keeps its initial key sum
            states.append(z_init[n:n + 1].to(k_cum.dtype))
        else:
            states.append(k_cum.new_zeros(1, 1, *k.shape[2:]))
    return normalised, torch.cat(states).contiguous()


def fused_additive_gate(x, initial_state=None, cu_seqlens=None, output_dtype=None, gate_dtype=None):
    """fla.ops.gsa.gate.fused_additive_gate: from logits x (B, T, H, K), the running log-normaliser
    z_t = log(e^{z_0} + Σ_{s≤t} e^{x_s}) per sequence (z_0 = ``initial_state`` (N, 1, H, K), else −∞), the normalised
    input k_t = e^{x_t − z_t} and the log decay g_t = z_{t−1} − z_t (0 where z_{t−1} = −∞: a sequence's first token
    without a state). Returns (k in ``output_dtype`` (default x's), g in ``gate_dtype`` (default x's), z at each
    sequence's end (N, 1, H, K): float32 as fla's, float64 for float64 x; an empty sequence keeps z_0 (or −∞)))."""
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError("Packed inputs with cu_seqlens must have batch size 1.")
    work = _work(x)
    keys, gates, finals = [], [], []
    for n, (start, end) in enumerate(_bounds(cu_seqlens, x.shape[1])):
        start_state = None
        if initial_state is not None:
            start_state = initial_state[n:n + 1] if cu_seqlens is not None else initial_state
        weights, log_decay, final = additive_gate(x[:, start:end].to(work), start_state)
        keys.append(weights)
        gates.append(log_decay)
        finals.append(final)
    k = torch.cat(keys, dim=1).to(output_dtype or x.dtype)
    g = torch.cat(gates, dim=1).to(gate_dtype or x.dtype)
    final_state = torch.cat(finals, dim=0).to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return k, g, final_state

