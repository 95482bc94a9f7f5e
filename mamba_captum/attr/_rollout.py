"""Rollout arithmetic shared by the methods (DESIGN.md §4): row normalisation, min-max, the running product; the
explained query (:class:`Query`) and the rows it reads.

Shapes: B batch, L tokens. Padding tokens have zero rows and columns in every map, so after ``I +`` their rows
are unit rows and they never receive relevance from a real query.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    """ρ = Ã^Λ ⋯ Ã^s, later layers on the left, built one layer at a time: (B, L, L).

    A multi-stage image model (``layout`` a :class:`mamba_captum.layout.StagedLayout`) mixes fewer tokens at each
    stage: between two stages ρ takes the downsample's window, ``Ã^{first of s+1} · T_{s+1} · Ã^{last of s}``
    (``layout.transition``). Its query is pooled, so the factors are kept and the query's row is taken right to
    left, one (B, L_s) × (B, L_s, L_s) product per layer instead of an L³ matrix product."""

    def __init__(self, layout=None):
        self.product = None
        self.layout = layout if getattr(layout, "stages", None) is not None else None
        self.factors: list[torch.Tensor] = []

    def push(self, factor: torch.Tensor):
        if self.layout is not None:
            self.factors.append(factor)
            return
        self.product = factor if self.product is None else factor @ self.product

    def _staged_rows(self, weights: torch.Tensor) -> torch.Tensor:
        """The pooled query's row over the first stage's tokens: weights (B, L_last) · ρ, carried through the
        downsample windows."""
        layout, rows = self.layout, weights
        for factor in reversed(self.factors):
            if rows.shape[-1] != factor.shape[-1]:  # a later stage's row: spread over the windows down to this one
                rows = layout.carry(rows.to(factor.dtype), layout.stage_of_length(factor.shape[-1]))
            rows = torch.einsum("bq,bqj->bj", rows.to(factor.dtype), factor)
        return layout.carry(rows, 0)

    def rows(self, positions: torch.Tensor, length: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """ρ[b, positions[b], :] (B, L); the identity's rows when no layer was pushed."""
        batch = positions.shape[0]
        if self.layout is not None:
            raise ValueError("mamba_captum: a multi-stage model's head pools the last stage; it has no query row.")
        if self.product is None:
            eye = torch.eye(length, dtype=torch.float32 if like is None else like.dtype)
            return eye[positions.cpu()].to(positions.device)
        return self.product[torch.arange(batch, device=positions.device), positions.to(self.product.device)]

    def weighted_rows(self, weights: torch.Tensor) -> torch.Tensor:
        """Σ_q weights[b, q] ρ[b, q, :] (B, L): the row of a pooled query; ``weights`` itself when no layer was
        pushed (ρ = I)."""
        if self.layout is not None:
            return self._staged_rows(weights)
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


@dataclass
class Query:
    """One explained output: the query row per example and, for class-specific methods, the target per example.

    A pooled head (an image model that reads the mean over its tokens) has no single query row: ``weights`` (B, L)
    says how it reads the rows, and every row-based result is the ``weights``-combination of the rows (rollout and
    raw attention are linear in the query's one-hot vector)."""

    positions: torch.Tensor  # (B,) long, the query token of each example (unused when ``weights`` is set)
    targets: torch.Tensor | None = None  # (B,) long, the explained class / next token of each example
    weights: torch.Tensor | None = None  # (B, L) a pooled query: Σ_q weights[b, q] · row q
    causal: bool = True  # False for non-causal models (Vim): every token is in the query's context

    @property
    def pooled(self) -> bool:
        return self.weights is not None

    def context(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, L): 1 on the real tokens the query can see (j ≤ q for causal models; all real tokens for non-causal
        ones and pooled queries). Min-max normalisations run over these only, so a query in the middle of a causal
        sequence gets the result it gets as the last token."""
        if not self.causal or self.pooled:
            return mask
        index = torch.arange(mask.shape[1], device=mask.device)
        return mask * (index[None, :] <= self.positions[:, None].to(mask.device)).to(mask.dtype)

    def row_of(self, product, length: int) -> torch.Tensor:
        """The query's row (B, L) of a :class:`RunningProduct` ρ: ``ρ[b, q_b]``, or ``weights[b] @ ρ[b]``."""
        if self.weights is None:
            return product.rows(self.positions, length)
        return product.weighted_rows(self.weights)

    def gather(self, rows_by_position: dict) -> torch.Tensor:
        """Per example, the query's row from ``rows_by_position[p]`` (B, ...) (for a pooled query, the
        ``weights``-combination of all of them) -> (B, ...)."""
        if self.weights is None:
            return gather_rows(rows_by_position, self.positions)
        total = 0
        for position, rows in rows_by_position.items():
            weight = self.weights[:, position].to(rows.dtype)
            total = total + weight.reshape(-1, *([1] * (rows.dim() - 1))) * rows
        return total


def gather_rows(rows_by_position: dict, positions: torch.Tensor) -> torch.Tensor:
    """Per example b, the row computed for query positions[b]: rows_by_position[p] is (B, ...) -> (B, ...)."""
    return torch.stack([rows_by_position[int(p)][b] for b, p in enumerate(positions.tolist())])


def unique_positions(queries: Sequence[Query], length: int | None = None) -> list[int]:
    """The query rows to compute: the queries' positions, or every row when a query is pooled."""
    if any(q.pooled for q in queries):
        return list(range(length))
    return sorted({int(p) for q in queries for p in q.positions.tolist()})


def refuse_pooled(queries: Sequence[Query], recipe: str = "official"):
    """The official recipes read one query row (the CLS token's); a pooled head has none."""
    if any(q.pooled for q in queries):
        raise ValueError(f"mamba_captum: recipe={recipe!r} reads the CLS token's row, and this model has no CLS "
                         "token (its head reads the mean over the tokens); use recipe='product', which explains "
                         "the mean of the rows.")
