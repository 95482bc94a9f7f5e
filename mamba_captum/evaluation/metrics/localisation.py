"""Localisation against a known relevant-token mask: per-example ROC-AUC, precision@k and relevance mass (the
conventions: ``mamba_captum.evaluation.metrics``)."""
from __future__ import annotations

import math

import torch

from .inputs import binary_mask, float_scores


def _token_inputs(relevance, relevant, exclude):
    relevance = float_scores(relevance, "relevance", 2, "(B, L), one score per token")
    relevant = binary_mask(relevant, "relevant", relevance.shape, "relevance")
    if exclude is None:
        scored = torch.ones_like(relevant)
    else:
        scored = ~binary_mask(exclude, "exclude", relevance.shape, "relevance")
    return relevance, relevant, scored


def _midranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks of a 1-D tensor, tied values sharing the mean of the ranks they span."""
    _, group, group_size = torch.unique(values, sorted=True, return_inverse=True, return_counts=True)
    last_rank = torch.cumsum(group_size, 0).double()
    first_rank = last_rank - group_size.double() + 1
    return ((first_rank + last_rank) / 2)[group]


def _auc_1d(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Mann-Whitney ROC-AUC of one example's scores (ties half); NaN without both classes."""
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    # Sum of the positives' midranks minus its minimum counts the (pos > neg) pairs plus half the tied pairs.
    rank_sum = _midranks(scores)[positive].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def roc_auc(relevance, relevant, exclude=None) -> torch.Tensor:
    """Per-example ROC-AUC of token relevance against the known relevant tokens.

    Args:
        relevance: (B, L) float scores, higher = more relevant.
        relevant: (B, L) bool or 0/1, the ground-truth relevant tokens.
        exclude: optional (B, L) bool, positions left out of the score (query token, padding).
    Returns:
        (B,) float64: P(score of a relevant token > score of an irrelevant one) + 0.5 P(equal), over the scored
        positions (the Mann-Whitney statistic). NaN for an example whose scored positions are all relevant or
        all irrelevant.
    """
    relevance, relevant, scored = _token_inputs(relevance, relevant, exclude)
    return torch.tensor([_auc_1d(relevance[b][scored[b]], relevant[b][scored[b]])
                         for b in range(relevance.shape[0])], dtype=torch.float64)


def precision_at_k(relevance, relevant, exclude=None) -> torch.Tensor:
    """Per-example precision of the k highest-scored tokens, k = number of relevant scored tokens.

    Ties at the k-th place are resolved by expectation: if ``a`` tokens score strictly above the k-th score and
    ``t`` tokens tie with it, of which ``r_t`` are relevant, the ``k - a`` remaining picks contribute
    ``(k - a) * r_t / t`` relevant tokens, the mean over uniformly random tie-breaking. The result is therefore
    deterministic and does not depend on token positions.

    Args:
        relevance: (B, L) float scores.
        relevant: (B, L) bool or 0/1.
        exclude: optional (B, L) bool, positions not scored.
    Returns:
        (B,) float64 in [0, 1] (this is also R-precision); NaN where no scored token is relevant (k = 0).
    """
    relevance, relevant, scored = _token_inputs(relevance, relevant, exclude)
    result = []
    for b in range(relevance.shape[0]):
        scores, positive = relevance[b][scored[b]], relevant[b][scored[b]]
        k = int(positive.sum())
        if k == 0:
            result.append(math.nan)
            continue
        kth_score = torch.sort(scores, descending=True).values[k - 1]
        above, tied = scores > kth_score, scores == kth_score
        picks_from_ties = k - int(above.sum())
        expected_hits = positive[above].sum().item() + picks_from_ties * positive[tied].double().mean().item()
        result.append(expected_hits / k)
    return torch.tensor(result, dtype=torch.float64)


def relevance_mass(relevance, relevant, exclude=None) -> torch.Tensor:
    """Per-example share of positive relevance that falls on the relevant tokens.

    Args:
        relevance: (B, L) float scores; only the positive part R+ = max(R, 0) counts.
        relevant: (B, L) bool or 0/1.
        exclude: optional (B, L) bool, positions not scored.
    Returns:
        (B,) float64: sum of R+ over relevant scored tokens / sum of R+ over all scored tokens; NaN where the
        scored tokens carry no positive relevance.
    """
    relevance, relevant, scored = _token_inputs(relevance, relevant, exclude)
    positive_part = relevance.clamp(min=0) * scored
    total = positive_part.sum(-1)
    on_relevant = (positive_part * relevant).sum(-1)
    return torch.where(total > 0, on_relevant / torch.where(total > 0, total, 1.0), math.nan)


def localisation_scores(relevance, relevant, exclude=None) -> dict[str, torch.Tensor]:
    """All three localisation scores: {"roc_auc", "precision_at_k", "relevance_mass"}, each (B,) float64.

    Args: as ``roc_auc``: relevance (B, L), relevant (B, L), optional exclude (B, L).
    """
    return {"roc_auc": roc_auc(relevance, relevant, exclude),
            "precision_at_k": precision_at_k(relevance, relevant, exclude),
            "relevance_mass": relevance_mass(relevance, relevant, exclude)}
