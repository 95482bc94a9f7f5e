"""A fast, exact, differentiable RG-LRU scan in plain torch: explicit forward and backward, O(√L) Python steps.

The recurrence ``h_t = a_t h_{t−1} + x_t`` is solved as a two-level blocked scan: the sequence is cut into chunks
of T tokens, and

1. every chunk runs its own recurrence from a zero state, all chunks at once (T steps over (B, L/T, C) slices),
   together with the running products ``P_i = a_1 ⋯ a_i`` of its decays;
2. the state entering each chunk is carried across chunks (L/T steps over (B, C));
3. ``h = local + P · entering``, one vectorised op.

Only sums and products of the same terms are reassociated (no division, no logarithm): exact to float rounding,
and with RG-LRU's decays ``0 ≤ a ≤ 1`` no product can overflow. The backward is the same scan run backwards in time
for the adjoint ``λ_t = ∂_t + a_{t+1} λ_{t+1}``, then ``∂x_t = λ_t``, ``∂a_t = λ_t h_{t−1}``, ``∂h_{−1} = a_0 λ_0``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .naive import accumulation_dtype

CHUNK = 32  # tokens per chunk: T + L/T Python steps in all (48 at L = 512)


def _tokens_first(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """A fresh (T, B, n, C) copy of a (B, L, C) tensor, zero-padded to n·T tokens (chunk i of T tokens is [:, :, i])."""
    batch, length, channels = x.shape
    n = -(-length // chunk)
    padded = F.pad(x, (0, 0, 0, n * chunk - length))
    return padded.view(batch, n, chunk, channels).permute(2, 0, 1, 3).clone(memory_format=torch.contiguous_format)


def _sequence_first(x: torch.Tensor, length: int) -> torch.Tensor:
    """(T, B, n, C) back to (B, L, C)."""
    chunk, batch, n, channels = x.shape
    return x.permute(1, 2, 0, 3).reshape(batch, n * chunk, channels)[:, :length]


def linear_scan(decay, inputs, start, chunk: int = CHUNK):
    """h_t = decay_t h_{t−1} + inputs_t along dim 1, from h_{−1} = start; no autograd (see the module docstring).

    Args:
        decay, inputs: (B, L, C) in one dtype.  start: (B, C) or None for zeros.
    Returns:
        (B, L, C) every state.
    """
    length = inputs.shape[1]
    products, states = _tokens_first(decay, chunk), _tokens_first(inputs, chunk)  # (T, B, n, C), in place below
    for i in range(1, chunk):  # each chunk from a zero state; products become a_1 ⋯ a_i
        states[i].addcmul_(products[i], states[i - 1])
        products[i].mul_(products[i - 1])
    entering = torch.zeros_like(states[0])  # (B, n, C): the state before each chunk
    if start is not None:
        entering[:, 0] = start
    for c in range(1, entering.shape[1]):
        entering[:, c] = torch.addcmul(states[-1, :, c - 1], products[-1, :, c - 1], entering[:, c - 1])
    return _sequence_first(states.addcmul_(products, entering), length)


class _RglruScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, initial_state, chunk):
        acc = accumulation_dtype(x)
        start = None if initial_state is None else initial_state.to(acc)
        states = linear_scan(a.to(acc), x.to(acc), start, chunk)
        ctx.save_for_backward(a, states, start)
        ctx.chunk, ctx.x_dtype = chunk, x.dtype
        ctx.start_dtype = None if initial_state is None else initial_state.dtype
        ctx.set_materialize_grads(False)
        return states.to(x.dtype), states[:, -1].clone()

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        a, states, start = ctx.saved_tensors
        acc = states.dtype
        grad = torch.zeros_like(states) if grad_y is None else grad_y.to(acc).clone()
        if grad_last is not None:
            grad[:, -1] += grad_last.to(acc)
        # λ backwards in time: λ_t = grad_t + a_{t+1} λ_{t+1}, a forward scan of the flipped sequence
        next_decay = torch.cat([a[:, 1:].to(acc), torch.zeros_like(a[:, :1], dtype=acc)], dim=1)
        adjoint = linear_scan(next_decay.flip(1), grad.flip(1), None, ctx.chunk).flip(1)
        zero = torch.zeros_like(states[:, :1])
        previous = torch.cat([zero if start is None else start[:, None], states[:, :-1]], dim=1)  # h_{t−1}
        grad_a = (adjoint * previous).to(a.dtype)
        grad_start = None if start is None else (a[:, 0].to(acc) * adjoint[:, 0]).to(ctx.start_dtype)
        return adjoint.to(ctx.x_dtype), grad_a, grad_start, None


def rglru_scan_chunked(x, a, initial_state=None, chunk: int = CHUNK):
    """h_t = a_t h_{t−1} + x_t, differentiable, O(√L) Python steps forward and backward (see the module docstring).

    Args:
        x: (B, L, C) scan inputs.  a: (B, L, C) decays in [0, 1] (0 at resets).  initial_state: (B, C) or None.
    Returns:
        (y, last): y (B, L, C) the states in x's dtype; last (B, C) the last state, float32 (float64 for float64 x).
    """
    return _RglruScan.apply(x, a, initial_state, chunk)
