"""Rollout arithmetic shared by the methods (DESIGN.md §4): row normalisation, min-max, the running product.

Shapes: B batch, L tokens. Padding tokens have zero rows and columns in every map, so after ``I +`` their rows
are unit rows and they never receive relevance from a real query.
"""
from __future__ import annotations

import torch


def row_normalise(matrix: torch.Tensor) -> torch.Tensor:
    """Divide each row by its sum. (B, L, L) -> (B, L, L)."""
    return matrix / matrix.sum(-1, keepdim=True)


def add_identity(matrix: torch.Tensor) -> torch.Tensor:
    """matrix + I for a (B, L, L) batch of matrices."""
    return matrix + torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)


def rollout_step(matrix: torch.Tensor) -> torch.Tensor:
    """Ã = rownorm(I + matrix₊): the rollout factor of one layer (Abnar & Zuidema; Ali et al. Eq. 20-21)."""
    return row_normalise(add_identity(matrix.clamp(min=0)))


SIGNS = ("absolute", "positive")
NORMALISATIONS = ("row_max", "row_sum", "none")


def layer_weights(matrix: torch.Tensor, sign: str = "absolute", normalise: str = "row_max") -> torch.Tensor:
    """The non-negative mixing weights a layer's (B, L, L) gradient-weighted map enters the rollout with.

    sign: ``"absolute"`` |G| (evidence for and against the class both count as relevant) or ``"positive"`` G₊
        (the papers' clamp). normalise: ``"row_max"`` divides each row by its largest entry, ``"row_sum"`` by its
        sum (each row then mixes like an attention row, whatever the scale of the gradients), ``"none"`` keeps the
        raw scale (the identity then dominates rows whose gradients are small).
    """
    weights = matrix.abs() if sign == "absolute" else matrix.clamp(min=0)
    if normalise == "none":
        return weights
    scale = weights.amax(-1, keepdim=True) if normalise == "row_max" else weights.sum(-1, keepdim=True)
    return weights / torch.where(scale > 0, scale, torch.ones_like(scale))


def minmax(values: torch.Tensor, mask: torch.Tensor, dims=(-1,)) -> torch.Tensor:
    """(x − min) / (max − min) over ``dims`` (real tokens only; mask broadcasts to ``values``); 0 on padding and
    where max = min."""
    real = mask.bool().expand_as(values)
    low = values.masked_fill(~real, float("inf")).amin(dim=dims, keepdim=True)
    high = values.masked_fill(~real, float("-inf")).amax(dim=dims, keepdim=True)
    span = high - low
    scaled = (values - low) / torch.where(span > 0, span, torch.ones_like(span))
    return torch.where(real & (span > 0), scaled, torch.zeros_like(scaled))


class RunningProduct:
    """ρ = Ã^Λ ⋯ Ã^s, later layers on the left, built one layer at a time: (B, L, L)."""

    def __init__(self):
        self.product = None

    def push(self, factor: torch.Tensor):
        self.product = factor if self.product is None else factor @ self.product

    def rows(self, positions: torch.Tensor, length: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """ρ[b, positions[b], :] (B, L); the identity's rows when no layer was pushed."""
        batch = positions.shape[0]
        if self.product is None:
            eye = torch.eye(length, dtype=torch.float32 if like is None else like.dtype)
            return eye[positions.cpu()].to(positions.device)
        return self.product[torch.arange(batch, device=positions.device), positions.to(self.product.device)]

    def weighted_rows(self, weights: torch.Tensor) -> torch.Tensor:
        """Σ_q weights[b, q] ρ[b, q, :] (B, L): the row of a pooled query; ``weights`` itself when no layer was
        pushed (ρ = I)."""
        if self.product is None:
            return weights
        return torch.einsum("bq,bqj->bj", weights.to(self.product.dtype), self.product)


def broadcast_row(vector: torch.Tensor) -> torch.Tensor:
    """The official code's rank-1 layer matrix 1 · vᵀ: every row is the query row. (B, L) -> (B, L, L)."""
    return vector[:, None, :].expand(-1, vector.shape[-1], -1)


def drop_query(relevance: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The official maps' last step: the query's own entry set to 0 (their code drops that column), negatives
    clamped to 0. (B, L)."""
    relevance = relevance.clone()
    relevance[torch.arange(relevance.shape[0], device=relevance.device), positions.to(relevance.device)] = 0
    return relevance.clamp(min=0)
