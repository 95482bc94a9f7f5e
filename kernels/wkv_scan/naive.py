"""RWKV-4's WKV as HF's ``rwkv_linear_attention_cpu`` computes it: a per-token loop under autograd, the state
kept as (numerator, denominator, running max) so that no exponential overflows."""
from __future__ import annotations

import torch

EMPTY_MAX = -1e38  # the running max of an empty state (HF's rwkv_linear_attention_cpu)


def accumulation_dtype(key: torch.Tensor) -> torch.dtype:
    """float32 (as HF's CPU path), or float64 for float64 inputs."""
    return torch.float64 if key.dtype == torch.float64 else torch.float32


def start_state(key: torch.Tensor, state, acc: torch.dtype):
    """(numerator, denominator, max), each (B, C) in ``acc``: the given state, or HF's empty one."""
    if state is not None:
        return tuple(s.to(acc) for s in state)
    zeros = key.new_zeros(key.shape[0], key.shape[2], dtype=acc)
    return zeros, zeros, torch.full_like(zeros, EMPTY_MAX)


def wkv_scan_naive(time_decay, time_first, key, value, state=None, return_state=False):
    """HF's ``rwkv_linear_attention`` by a per-token loop (autograd through it); the test reference.

    With w = −exp(time_decay), u = time_first, per channel::

        wkv_t = (S_{t−1} + e^{u + k_t} v_t) / (D_{t−1} + e^{u + k_t}),
        S_t = e^w S_{t−1} + e^{k_t} v_t,   D_t = e^w D_{t−1} + e^{k_t},

    S and D stored as (num, den, max) with S = num · e^max, D = den · e^max.

    Args:
        time_decay, time_first: (C,).  key, value: (B, L, C).
        state: None, or (num, den, max), each (B, C): the state before the first token.
        return_state: return the last state even when no state was given.
    Returns:
        (wkv, state): wkv (B, L, C) in key's dtype; the last (num, den, max) as a list of (B, C) float32 tensors
        (float64 for float64 keys) when a state was given or ``return_state``, else None.
    """
    acc = accumulation_dtype(key)
    decay, first = (-torch.exp(time_decay)).to(acc), time_first.to(acc)
    num, den, running = start_state(key, state, acc)
    outputs = []
    for t in range(key.shape[1]):
        k, v = key[:, t].to(acc), value[:, t].to(acc)
        top = torch.maximum(running, k + first)
        e1, e2 = torch.exp(running - top), torch.exp(k + first - top)
        outputs.append((e1 * num + e2 * v) / (e1 * den + e2))
        top = torch.maximum(running + decay, k)
        e1, e2 = torch.exp(running + decay - top), torch.exp(k - top)
        num, den, running = e1 * num + e2 * v, e1 * den + e2, top
    last = [num, den, running] if return_state or state is not None else None
    return torch.stack(outputs, dim=1).to(key.dtype), last
