"""Griffin's RG-LRU scan as HF's ``RecurrentGemmaRglru._rnn_scan`` runs it: a per-token loop under autograd."""
from __future__ import annotations

import torch


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 (HF's ``acc_dtype``), or float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rglru_scan_naive(x, a, initial_state=None):
    """h_t = a_t h_{t−1} + x_t token by token (autograd through the loop); the test reference.

    Args:
        x: (B, L, C) scan inputs (HF's ``hidden_states``: the normalised, gated conv output).
        a: (B, L, C) decays (HF's ``recurrent_gate``, already zeroed at resets).
        initial_state: (B, C) h_{−1}, or None for zeros.
    Returns:
        (y, last): y (B, L, C) the states in x's dtype; last (B, C) the last state, float32 (float64 for float64 x).
    """
    acc = accumulation_dtype(x)
    state = x.new_zeros(x.shape[0], x.shape[2], dtype=acc) if initial_state is None else initial_state.to(acc)
    states = []
    for t in range(x.shape[1]):
        state = a[:, t].to(acc) * state + x[:, t].to(acc)
        states.append(state)
    return torch.stack(states, dim=1).to(x.dtype), state
