"""Input checks shared by the explanation metrics (their conventions: ``mamba_captum.evaluation.metrics``): score
maps, 0/1 masks, and the fraction grids of the perturbation curves with their defaults."""
from __future__ import annotations

from typing import Sequence

import torch

DEFAULT_FRACTIONS = tuple(i / 10 for i in range(11))  # 0.0, 0.1, ..., 1.0 (activation / pruning curves)
DEFAULT_DELETION_STEPS = tuple(i / 10 for i in range(1, 10))  # 0.1, ..., 0.9 (Chefer's deletion curve)


def float_scores(values, name: str, dims: int, what: str) -> torch.Tensor:
    values = torch.as_tensor(values).detach()
    if values.dim() != dims:
        raise ValueError(f"mamba_captum: {name} must be {what}, got shape {tuple(values.shape)}; "
                         f"add a leading batch dimension ({name}[None]) for a single example.")
    if values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"mamba_captum: {name} must hold real scores, got dtype {values.dtype}.")
    values = values.double().cpu()
    if not torch.isfinite(values).all():
        raise ValueError(f"mamba_captum: {name} contains NaN or infinite values; replace them (e.g. "
                         f"torch.nan_to_num) before scoring, since they have no place in a ranking.")
    return values


def binary_mask(mask, name: str, shape: torch.Size, reference: str) -> torch.Tensor:
    mask = torch.as_tensor(mask).detach().cpu()
    if mask.shape != shape:
        raise ValueError(f"mamba_captum: {name} has shape {tuple(mask.shape)} but {reference} has shape "
                         f"{tuple(shape)}; they must match position for position.")
    if mask.dtype != torch.bool:
        if mask.is_complex() or not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"mamba_captum: {name} must be boolean or 0/1 valued; threshold it first "
                             f"(e.g. {name} > 0.5).")
        mask = mask != 0
    return mask


def fraction_grid(values, default: Sequence[float], name: str) -> torch.Tensor:
    """Fractions / steps as float64 plus the tolerance their own dtype needs in ceil(t * N)."""
    values = default if values is None else values
    # Python numbers become float64 (not torch's float32 default); float tensors keep their dtype for the guard.
    grid = values.detach().cpu() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
    if not grid.is_floating_point():
        grid = grid.double()
    if torch.finfo(grid.dtype).bits < 32:
        raise ValueError(f"mamba_captum: {name} in {grid.dtype} cannot say which token count is meant; pass "
                         f"float32/float64 values or a Python list.")
    if grid.dim() != 1 or grid.numel() == 0:
        raise ValueError(f"mamba_captum: {name} must be a non-empty 1-D sequence of floats in [0, 1], "
                         f"got shape {tuple(grid.shape)}.")
    if not ((grid >= 0) & (grid <= 1)).all():
        raise ValueError(f"mamba_captum: {name} must lie in [0, 1] (fractions of the tokens), got "
                         f"{grid.tolist()}.")
    return grid
