"""Cyclic Flow Attention's slot readout (flash-linear-attention 0.6.0, ``fla/ops/cyfa``): everything of CyFA that is
not a recurrence. Per head, M slots (M even), C = M − 1 readout rows, the clock λ (cumulative steps) and its phases.

- :func:`readout_basis`: F (C, M), the fixed Fourier basis; :func:`readout_table`: T = readout · F (H, C, M).
- :func:`rotate_atom`: the slot atom a(λ) (..., M); :func:`write_vectors`: w = β · a(λ), what a token writes.
- :func:`rotate_slots`: R_{±λ} x, the slot pairs (2j, 2j+1) turned by j · λ slots of the period C.
- :func:`readout_weights`: u = R_{−λ}(Tᵀ softmax(T R_{+λ} z)), the value memory's query from the key-memory read z.
- :func:`rms_normed`: CyFA's q / k RMS norms. :func:`num_slots_of`: M from a readout (H, C, C), checked as fla does.

All are elementwise or per-token, in the input's dtype, differentiable through autograd.
"""
from __future__ import annotations

import math

import torch


def num_slots_of(readout: torch.Tensor) -> int:
    """M = C + 1 for a readout (H, C, C); fla's rule: a positive even number."""
    if readout.dim() != 3 or readout.shape[1] != readout.shape[2]:
        raise ValueError("`readout` must have shape [H, C, C].")
    slots = readout.shape[-1] + 1
    if slots <= 0 or slots % 2:
        raise ValueError("`num_slots` must be a positive even integer.")
    return slots


def readout_basis(num_slots: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """F (C, M), C = M − 1: row r, slot m = 2j (+1) holds cos (sin) of r · j · 2π / C; the cos column of j = 0 scaled
    by C^−½, the sin column of j = 0 zero, the others by (2 / C)^½ (fla's ``_readout_basis``)."""
    period = num_slots - 1
    slot = torch.arange(num_slots, device=device)
    rows = torch.arange(period, device=device, dtype=dtype)[:, None]
    omega = (slot // 2).to(dtype) * (2.0 * math.pi / period)
    basis = torch.where(slot.remainder(2)[None, :] == 1, torch.sin(rows * omega), torch.cos(rows * omega))
    weight = torch.full((num_slots,), (2.0 / period) ** 0.5, dtype=dtype, device=device)
    weight[0], weight[1] = period ** -0.5, 0.0
    return basis * weight


def readout_table(readout: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """T = readout · F: (H, C, M) in ``dtype``."""
    return readout.to(dtype) @ readout_basis(num_slots_of(readout), dtype, readout.device)


def _phases(lambdas: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (..., M) of each slot's phase at clock λ (...): pair j = m // 2 turns by j · λ slots of the period
    C = M − 1, reduced in integer slot coordinates first (as fla does) and taken in (−C/2, C/2]."""
    period = num_slots - 1
    pair = torch.arange(num_slots, device=lambdas.device) // 2
    whole = torch.floor(lambdas)
    fraction = lambdas - whole
    coordinate = (whole.to(torch.long).remainder(period).unsqueeze(-1) * pair).remainder(period).to(lambdas.dtype)
    coordinate = coordinate + fraction.unsqueeze(-1) * pair.to(lambdas.dtype)
    coordinate = torch.where(coordinate > period * 0.5, coordinate - period, coordinate)
    phase = coordinate * (2 * math.pi / period)
    return torch.cos(phase), torch.sin(phase)


def rotate_atom(lambdas: torch.Tensor, num_slots: int) -> torch.Tensor:
    """a(λ) (..., M): the slot atom written at clock λ (...): slot 2j holds s_j cos φ_j, slot 2j+1 holds −s_j sin φ_j
    (s_0 = C^−½, s_j = (2 / C)^½ otherwise)."""
    cos, sin = _phases(lambdas, num_slots)
    slot = torch.arange(num_slots, device=lambdas.device)
    weight = torch.where(slot // 2 == 0, 1.0, 2.0).to(lambdas.dtype).div(num_slots - 1).sqrt()
    return weight * torch.where(slot.remainder(2) == 0, cos, -sin)


def rotate_slots(lambdas: torch.Tensor, x: torch.Tensor, num_slots: int, sign: int) -> torch.Tensor:
    """R_{±λ} x (..., M): each slot pair (2j, 2j+1) of x rotated by its phase at clock λ (...), forward (sign +1,
    fla's ``_rotate_modal_pos``) or back (sign −1, ``_rotate_modal_neg``)."""
    cos, sin = _phases(lambdas, num_slots)
    sin = sin * sign
    slot = torch.arange(num_slots, device=lambdas.device)
    mate = torch.where(slot.remainder(2) == 0, slot + 1, slot - 1).clamp(0, num_slots - 1)
    partner = x[..., mate]
    return torch.where(slot.remainder(2) == 0, cos * x - sin * partner, sin * partner + cos * x)


def write_vectors(beta: torch.Tensor, lambdas: torch.Tensor, num_slots: int) -> torch.Tensor:
    """w (B, T, H, M) = β (B, T, H) · a(λ): what each token writes into the slots (the keys of the value memory)."""
    return beta[..., None] * rotate_atom(lambdas, num_slots)


def readout_weights(raw_logits: torch.Tensor, lambdas: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """u (B, T, H, M) = R_{−λ}(Tᵀ softmax(T R_{+λ} z)) from the raw logits z = scale · Hk_tᵀ q_t (B, T, H, M), the clock
    λ (B, T, H) and the readout table T (H, C, M): the query of the value memory."""
    num_slots = table.shape[-1]
    logits = torch.einsum("hrm,bthm->bthr", table, rotate_slots(lambdas, raw_logits, num_slots, +1))
    coefficients = torch.einsum("hrm,bthr->bthm", table, torch.softmax(logits, dim=-1))
    return rotate_slots(lambdas, coefficients, num_slots, -1)


def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · weight over the last dim (CyFA's q / k norms), in x's dtype."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + float(eps)) * weight.to(x.dtype)
