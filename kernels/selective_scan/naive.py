"""The Mamba-1 selective scan as HF's torch path computes it: a per-token loop differentiated by autograd."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def accumulation_dtype(u: torch.Tensor) -> torch.dtype:
    """float32 (as HF's torch path), or float64 for float64 inputs."""
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def step_sizes(delta, delta_bias, delta_softplus):
    """The step sizes Δ (B, D, L) the scan uses: ``delta`` plus ``delta_bias`` (D,), then softplus if asked."""
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)[..., None]
    return F.softplus(delta) if delta_softplus else delta


def skip_and_gate(y, u, D, z):
    """The scan output ``y`` (B, D, L) with the D skip (``u`` · D, D (D,)) and the gate silu(``z``) applied."""
    if D is not None:
        y = y + u * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y


def selective_scan_naive(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         return_last_state=False, **kwargs):
    """mamba-ssm's ``selective_scan_fn`` by a per-token loop (autograd through it).

    Args:
        u, delta: (B, D, L).  A: (D, N).  B, C: (B, N, L).  D: (D,) or None.  z: (B, D, L) or None.
        delta_bias: (D,) or None.  delta_softplus: apply softplus to delta (+ bias).
    Returns:
        y (B, D, L) in u's dtype; with ``return_last_state`` also the last state (B, D, N) float32 (float64 for float64 inputs).
    """
    delta = step_sizes(delta, delta_bias, delta_softplus)
    acc = accumulation_dtype(u)
    decay = torch.exp(A[None, :, None, :] * delta[..., None].to(acc))  # (B, D, L, N)
    inputs = (delta * u)[..., None].to(acc) * B.transpose(1, 2)[:, None].to(acc)
    state = u.new_zeros(u.shape[0], u.shape[1], A.shape[1], dtype=acc)
    outputs = []
    for t in range(u.shape[-1]):
        state = decay[:, :, t] * state + inputs[:, :, t]
        outputs.append((state * C[:, None, :, t].to(acc)).sum(-1))
    y = skip_and_gate(torch.stack(outputs, dim=-1).to(u.dtype), u, D, z)
    return (y, state) if return_last_state else y
