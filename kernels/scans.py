"""Plain-torch scans used to check a rebuilt operator against the layer's real output.

Written to be evidently right first and reasonably fast second: the Mamba-1 scan precomputes every decay and
input in one vectorised pass and leaves only a fused multiply-add per token in the Python loop; the Mamba-2 scan is
the chunked SSD algorithm (exact; chunk-local cumulative sums, every exponent ≤ 0). The fast, differentiable scans
belong to the kernels issue and will sit beside these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SELECTIVE_TOKENS_PER_BLOCK = 32  # cache-sized; bounds the (B, T, D, N) decay / input / state tensors of one block
SSD_CHUNK = 64


def selective_scan_reference(u, delta, A, B, C):
    """Mamba-1 selective scan without the D skip and the gate.

    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t,  y_t = C_t · h_t  (per channel, state size N).

    Args:
        u: (B, L, D) scan input.  delta: (B, L, D) step sizes (softplus applied).
        A: (D, N) negative decay rates.  B, C: (B, L, N).
    Returns:
        y: (B, L, D), in the dtype of ``u``.
    """
    batch, length, channels = u.shape
    state = u.new_zeros(batch, channels, A.shape[-1])
    out = torch.empty_like(u)
    for start in range(0, length, SELECTIVE_TOKENS_PER_BLOCK):
        stop = min(start + SELECTIVE_TOKENS_PER_BLOCK, length)
        decay = torch.exp(delta[:, start:stop, :, None] * A)  # (B, T, D, N)
        states = (delta[:, start:stop] * u[:, start:stop])[..., None] * B[:, start:stop, None, :]
        for t in range(stop - start):  # states[:, t] becomes h_t in place
            state = torch.addcmul(states[:, t], decay[:, t], state, out=states[:, t])
        out[:, start:stop] = torch.einsum("btdn,btn->btd", states, C[:, start:stop])
    return out


def ssd_scan_reference(x, delta, A, B, C, chunk: int = SSD_CHUNK):
    """Mamba-2 (SSD) scan without the D skip, by chunks.

    h_t = exp(delta_t A_h) h_{t-1} + delta_t x_t B_tᵀ,  y_t = h_t C_t  (per head h; head h reads group h // (H/G)).
    Inside a chunk, y = (C Bᵀ ∘ exp(A (S_i - S_j)) Δ_j) x; across chunks the state is passed on, decayed by
    exp(A · Σ Δ over the chunk). S is a chunk-local cumulative sum, so every exponent is ≤ 0.

    Args:
        x: (B, L, H, P).  delta: (B, L, H).  A: (H,).  B, C: (B, L, G, N).
    Returns:
        y: (B, L, H, P), in the dtype of ``x``.
    """
    batch, length, heads, head_dim = x.shape
    groups = B.shape[2]
    pad = (-length) % chunk
    fold = lambda t: F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)).unflatten(1, (-1, chunk))  # (B, nc, T, ...)
    x, delta = fold(x), fold(delta)
    B = fold(B).repeat_interleave(heads // groups, dim=3)  # (B, nc, T, H, N)
    C = fold(C).repeat_interleave(heads // groups, dim=3)
    cum = torch.cumsum(delta * A, dim=2)  # (B, nc, T, H), chunk-local, decreasing
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    log_decay = (cum[:, :, :, None, :] - cum[:, :, None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    scores = torch.einsum("bcihn,bcjhn->bcijh", C, B) * log_decay.exp() * delta[:, :, None, :, :]
    y = torch.einsum("bcijh,bcjhp->bcihp", scores, x)

    # State at the end of each chunk from its own tokens, then passed through the chunks.
    to_end = torch.exp(cum[:, :, -1:, :] - cum)  # (B, nc, T, H)
    chunk_states = torch.einsum("bcjh,bcjhn,bcjhp->bchpn", to_end * delta, B, x)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    incoming = torch.empty_like(chunk_states)
    for c in range(chunk_states.shape[1]):
        incoming[:, c] = state
        state = torch.exp(cum[:, c, -1])[:, :, None, None] * state + chunk_states[:, c]
    y = y + torch.einsum("bcihn,bchpn,bcih->bcihp", C, incoming, cum.exp())
    return y.flatten(1, 2)[:, :length]
