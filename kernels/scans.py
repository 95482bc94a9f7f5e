"""Plain-torch scans used to check a rebuilt operator against the layer's real output.

Written to be evidently right first and reasonably fast second: the Mamba-1 scan precomputes every decay and
input in one vectorised pass and leaves only a fused multiply-add per token in the Python loop; the Mamba-2 scan is
the chunked SSD algorithm (exact; chunk-local cumulative sums in float64, every exponent ≤ 0; differentiable, and
the SSD ``mc.fast_scans`` runs in place of HF's ``mamba2_chunk_scan`` on CPU); the decay recurrence without query /
key terms (RG-LRU's) runs as a chunked scan. The differentiable scans that stand in for HF's per-token loops live in
``selective_scan``, ``wkv_scan`` and ``rglru_scan``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rglru_scan.chunked import rglru_scan_chunked

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


def ssd_scan_reference(x, delta, A, B, C, chunk: int = SSD_CHUNK, initial_state=None,
                       return_final_state: bool = False):
    """Mamba-2 (SSD) scan without the D skip, by chunks; differentiable (plain torch ops).

    h_t = exp(delta_t A_h) h_{t-1} + delta_t x_t B_tᵀ,  y_t = h_t C_t  (per head h; head h reads group h // (H/G)).
    Inside a chunk, y = (C Bᵀ ∘ exp(A (S_i - S_j)) Δ_j) x; across chunks the state is passed on, decayed by
    exp(A · Σ Δ over the chunk). S is a chunk-local cumulative sum, so every exponent is ≤ 0. C Bᵀ is formed once
    per group and shared by its H/G heads (Mamba-2 130m: 24 heads, one group), every product is a batched matmul.

    Args:
        x: (B, L, H, P).  delta: (B, L, H).  A: (H,).  B, C: (B, L, G, N).
        initial_state: (B, H, P, N) the state before the first token, or None (zeros).
    Returns:
        y: (B, L, H, P), in the dtype of ``x``; with ``return_final_state``, (y, the state after the last token
        (B, H, P, N)).
    """
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    per_group = heads // groups
    pad = (-length) % chunk
    fold = lambda t: F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)).unflatten(1, (-1, chunk))  # (B, nc, T, ...)
    # heads as (G, H/G) and tokens last but one: (B, nc, G, H/G, T, ...) for x and Δ, (B, nc, G, 1, T, N) for B, C
    x = fold(x).unflatten(3, (groups, per_group)).permute(0, 1, 3, 4, 2, 5)
    delta = fold(delta).unflatten(3, (groups, per_group)).permute(0, 1, 3, 4, 2)
    B = fold(B).permute(0, 1, 3, 2, 4)[:, :, :, None]
    C = fold(C).permute(0, 1, 3, 2, 4)[:, :, :, None]
    # exponents in float64 whatever x's dtype: a float32 cumsum over a chunk, differenced, loses |S|·2⁻²⁴ (1e-5
    # relative gradients at chunk 64 against HF's 7e-7); the (T, T) decays are cheap next to the products
    cum = torch.cumsum(delta.double() * A.double().view(groups, per_group, 1), dim=-1)  # (B, nc, G, H/G, T), ≤ 0
    exp = lambda t: t.exp().to(x.dtype)  # noqa: E731
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    log_decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    scores = (C @ B.mT) * exp(log_decay) * delta[..., None, :]  # (B, nc, G, H/G, T, T)
    y = scores @ x

    # State at the end of each chunk from its own tokens, then passed through the chunks.
    to_end = exp(cum[..., -1:] - cum)  # (B, nc, G, H/G, T)
    chunk_states = ((to_end * delta)[..., None] * x).mT @ B  # (B, nc, G, H/G, P, N)
    running = x.new_zeros(batch, groups, per_group, head_dim, state) if initial_state is None else \
        initial_state.to(x.dtype).reshape(batch, groups, per_group, head_dim, state)
    incoming = torch.empty_like(chunk_states)
    for c in range(chunk_states.shape[1]):
        incoming[:, c] = running
        running = exp(cum[:, c, ..., -1])[..., None, None] * running + chunk_states[:, c]
    y = y + (C @ incoming.mT) * exp(cum)[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(batch, -1, heads, head_dim)[:, :length]
    # the padded tokens have Δ = 0: decay 1, no input, so the running state is the last real token's
    return (y, running.reshape(batch, heads, head_dim, state)) if return_final_state else y


def decay_scan_reference(x, log_decay, log_q=None, log_k=None, log_diag=None, row_weight=None, col_weight=None,
                         segments=None):
    """The diagonal-decay recurrence of :mod:`mamba_captum.kernels.decay` applied to x, token by token, float64.

    y_i = row_i · (Σ_{j<i} exp(log_q_i + log_k_j − Σ_{k=j+1..i} log_decay_k) col_j x_j + exp(log_diag_i) col_i x_i),
    where the sum stops at the last reset (``segments`` changes). The state is kept as exp(m) · h̃ with m a running
    max of the key exponents (RWKV's numerically stable recurrence): keys of any size cannot overflow.

    Args:
        x, log_decay: (B, L, C).  log_q, log_k, log_diag, row_weight, col_weight: (B, L, C) or None.
        segments: (B, L) integer segment ids or None.
    Returns:
        y: (B, L, C) float64.
    """
    f64 = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731
    x, log_decay = f64(x), f64(log_decay)
    zero = torch.zeros_like(x)
    log_q = zero if log_q is None else f64(log_q)
    log_k = zero if log_k is None else f64(log_k)
    log_diag = log_q + log_k if log_diag is None else f64(log_diag)
    value = x if col_weight is None else x * f64(col_weight)
    batch, length, channels = x.shape
    running = x.new_full((batch, channels), float("-inf"))  # m: log-scale of the state
    state = x.new_zeros(batch, channels)  # h̃: state / exp(m)
    out = torch.empty_like(x)
    for t in range(length):
        carried = running - log_decay[:, t]  # log-scale of the decayed previous state
        if segments is not None and t > 0:
            reset = (segments[:, t] != segments[:, t - 1])[:, None]
            carried = carried.masked_fill(reset, float("-inf"))
        previous = torch.where(torch.isfinite(carried), torch.exp(log_q[:, t] + carried) * state, zero[:, t])
        out[:, t] = previous + torch.exp(log_diag[:, t]) * value[:, t]
        running_new = torch.maximum(carried, log_k[:, t])
        keep = torch.where(torch.isfinite(carried), torch.exp(carried - running_new), zero[:, t])
        state = keep * state + torch.exp(log_k[:, t] - running_new) * value[:, t]
        running = running_new
    return out if row_weight is None else out * f64(row_weight)


def reset_decay_scan(x, log_decay, col_weight=None, segments=None):
    """:func:`decay_scan_reference` without query / key / diagonal terms, as a chunked scan: float64, differentiable.

    h_i = exp(−log_decay_i) · h_{i−1} + col_i x_i, with h reset at each change of ``segments`` (RG-LRU's
    recurrence). The per-token loop above costs L Python steps of a few ops each; this runs the two-level blocked
    scan of :mod:`mamba_captum.kernels.rglru_scan` (O(√L) steps, the same products reassociated: equal to the loop
    to float64 rounding).

    Args:
        x, log_decay: (B, L, C); log_decay ≥ 0 keeps every product ≤ 1.  col_weight: (B, L, C) or None.
        segments: (B, L) integer segment ids or None.
    Returns:
        (B, L, C) float64.
    """
    x, decay = x.to(torch.float64), torch.exp(-log_decay.to(torch.float64))
    if col_weight is not None:
        x = x * col_weight.to(torch.float64)
    if segments is not None:
        starts = torch.ones_like(segments, dtype=torch.bool)
        starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
        decay = decay.masked_fill(starts[..., None], 0.0)
    return rglru_scan_chunked(x, decay)[0]
