"""A fast, exact, differentiable Mamba-1 selective scan in plain torch: explicit forward and backward, linear in L.

Forward: the recurrence ``h_t = a_t h_{t−1} + b_t`` (a = exp(Δ A), b = Δ B u; per channel d and state n) one
token at a time on (B, D, N) slices, with no autograd graph; only the states at chunk starts are kept. Backward:
chunks in reverse; each chunk's states are recomputed from its start state, then the adjoint runs backwards,
``λ_t = C_t g_t + a_{t+1} λ_{t+1}``, and the gradients of the chunk are contractions of (B, D, T, N) slabs:

    ∂C_t = Σ_d g_t h_t,   ∂b_t = λ_t,   ∂a_t = λ_t h_{t−1}   (→ ∂Δ, ∂A through a = exp(Δ A); ∂Δ, ∂B, ∂u through b).

Every step is a few element-wise ops over (B, D, N): time O(L·B·D·N) forward and backward, against HF's autograd
of the loop, whose backward writes a full (B, D, L, N) gradient for every token. Numerics follow HF's torch path
(float32 decays and states; float64 for float64 inputs).
"""
from __future__ import annotations

import torch

from .naive import accumulation_dtype, skip_and_gate, step_sizes

CHUNK = 64  # tokens per chunk: the backward holds (CHUNK, B, D, N) slabs


class _SelectiveScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, delta, A, B, C, chunk):
        batch, channels, length = u.shape
        acc = accumulation_dtype(u)
        state = torch.zeros(batch, channels, A.shape[1], dtype=acc, device=u.device)
        starts, y = [], torch.empty(batch, channels, length, dtype=acc, device=u.device)
        for t0 in range(0, length, chunk):
            t1 = min(length, t0 + chunk)
            starts.append(state)
            decay, inputs = _slabs(u, delta, A, B, t0, t1)
            states = _run(decay, inputs, state)  # (T, B, D, N)
            y[:, :, t0:t1] = _over_states(states, _tokens_first(C, t0, t1, acc)).permute(1, 2, 0)
            state = states[-1].clone()  # a copy: a view would keep the whole slab alive
        ctx.save_for_backward(u, delta, A, B, C, *starts)
        ctx.chunk = chunk
        return y.to(u.dtype), state

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        u, delta, A, B, C, *starts = ctx.saved_tensors
        chunk, length, acc = ctx.chunk, u.shape[-1], accumulation_dtype(u)
        grads = [torch.zeros_like(t, dtype=acc) for t in (u, delta, A, B, C)]
        grad_u, grad_delta, grad_A, grad_B, grad_C = grads
        adjoint_after = grad_last.to(acc) if grad_last is not None else torch.zeros_like(starts[0])  # λ past the chunk
        decay_after = None  # a of the token after the chunk (None after the last token)
        for index in reversed(range(len(starts))):
            t0 = index * chunk
            t1 = min(length, t0 + chunk)
            decay, inputs = _slabs(u, delta, A, B, t0, t1)
            states = _run(decay, inputs, starts[index])  # (T, B, D, N)
            g = _tokens_first(grad_y, t0, t1, acc)  # (T, B, D)
            grad_C[:, :, t0:t1] = _over_channels(g, states).permute(1, 2, 0)
            adjoint = g[..., None] * _tokens_first(C, t0, t1, acc)[:, :, None, :]  # C_t g_t, becomes λ in place
            carried = adjoint_after  # λ_t = C_t g_t + a_{t+1} λ_{t+1}, one fused op per token
            for t in reversed(range(t1 - t0)):
                if decay_after is None:
                    carried = adjoint[t].add_(carried)
                else:
                    carried = adjoint[t].addcmul_(decay_after, carried)
                decay_after = decay[t]
            adjoint_after = carried
            previous = torch.cat([starts[index][None], states[:-1]], dim=0)  # h_{t−1}
            grad_decay = adjoint * previous * decay  # ∂/∂(Δ A) of a = exp(Δ A)
            d, x, b = (_tokens_first(t, t0, t1, acc) for t in (delta, u, B))  # (T, B, D), (T, B, D), (T, B, N)
            grad_A += (grad_decay * d[..., None]).sum((0, 1))
            grad_inputs = _over_states(adjoint, b)  # ∂(Δ u)
            grad_delta[:, :, t0:t1] = ((grad_decay * A.to(acc)).sum(-1) + grad_inputs * x).permute(1, 2, 0)
            grad_u[:, :, t0:t1] = (grad_inputs * d).permute(1, 2, 0)
            grad_B[:, :, t0:t1] = _over_channels(d * x, adjoint).permute(1, 2, 0)
        return (grad_u.to(u.dtype), grad_delta.to(delta.dtype), grad_A.to(A.dtype), grad_B.to(B.dtype),
                grad_C.to(C.dtype), None)


# The contractions below run as multiply-and-sum / small matmuls: einsum's plans for these shapes (a batch of
# (T, B) tiny products) were 4-7x slower on CPU.
def _over_states(slab, per_state):
    """Σ_n slab[t, b, d, n] · per_state[t, b, n]: (T, B, D, N), (T, B, N) -> (T, B, D)."""
    return (slab * per_state[:, :, None, :]).sum(-1)


def _over_channels(per_channel, slab):
    """Σ_d per_channel[t, b, d] · slab[t, b, d, n]: (T, B, D), (T, B, D, N) -> (T, B, N)."""
    return torch.matmul(per_channel.unsqueeze(-2), slab).squeeze(-2)


def _tokens_first(x, t0, t1, acc):
    """Tokens [t0, t1) of a (B, X, L) tensor as a contiguous (T, B, X) tensor in the accumulation dtype."""
    return x[:, :, t0:t1].permute(2, 0, 1).to(acc).contiguous()


def _slabs(u, delta, A, B, t0, t1):
    """Decays exp(Δ A) and inputs Δ B u of tokens [t0, t1): (T, B, D, N) in the accumulation dtype, token-major so
    that each token's (B, D, N) slice is contiguous (the per-token loops run on contiguous memory)."""
    acc = accumulation_dtype(u)
    d = _tokens_first(delta, t0, t1, acc)
    decay = torch.exp(d[..., None] * A.to(acc))
    inputs = (d * _tokens_first(u, t0, t1, acc))[..., None] * _tokens_first(B, t0, t1, acc)[:, :, None, :]
    return decay, inputs


def _run(decay, inputs, state):
    """States h_t of one chunk from its start state, in place in ``inputs``: (T, B, D, N)."""
    for t in range(inputs.shape[0]):
        state = inputs[t].addcmul_(decay[t], state)
    return inputs


def selective_scan_chunked(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False, chunk: int = CHUNK, **kwargs):
    """mamba-ssm's ``selective_scan_fn``, differentiable, forward and backward linear in L (see module docstring).

    Args:
        u, delta: (B, D, L).  A: (D, N).  B, C: (B, N, L).  D: (D,) or None.  z: (B, D, L) or None.
        delta_bias: (D,) or None.  delta_softplus: apply softplus to delta (+ bias).
    Returns:
        y (B, D, L) in u's dtype; with ``return_last_state`` also the last state (B, D, N) float32 (float64 for float64 inputs).
    """
    delta = step_sizes(delta, delta_bias, delta_softplus)
    y, last = _SelectiveScan.apply(u, delta, A, B, C, chunk)
    y = skip_and_gate(y, u, D, z)
    return (y, last) if return_last_state else y
