"""Evaluation metrics for explanations: localisation, text perturbation curves, image segmentation tests.

Conventions shared by every function here:

* A relevance map is one score per token, ``(B, L)``, or per pixel, ``(B, h, w)``; higher means more relevant.
  Inputs are validated and computed in float64; results are float64 tensors on the CPU, or Python floats for
  the areas under curves and the dataset-level segmentation scores.
* Per-example scores come back as ``(B,)`` tensors with NaN where the score is undefined for that example
  (e.g. no positive position for a ROC-AUC). Aggregate them with ``torch.nanmean`` and report how many were
  NaN; dropping them silently changes the population being compared.
* Ties are never broken by position in the *scores* (that would reward or punish a method for the order of
  its input): ROC-AUC counts tied pairs half, precision@k takes the expectation over random tie-breaking,
  average precision puts one threshold at each distinct score (the scikit-learn definition).
* Perturbation curves (``activation_curve``, ``pruning_curve``, ``deletion_curve``) change ``k = ceil(t * N)``
  tokens at fraction ``t``, where ``N`` counts the positions that may change (not ``fixed``). The *order* of the
  tokens is a ranking, so ties there are broken deterministically: lower position first.
* Areas under curves use the trapezoid rule over the given x values (``trapezoid``), with no normalisation by
  the x range: a curve sampled on ``[0.1, 0.9]`` has an area of at most 0.8 times its largest value.

References: Ali et al. 2022, "XAI for Transformers: Better Explanations through Conservative Propagation"
(activation / pruning curves, AUAC and AU-MSE); Chefer et al. 2021, "Transformer Interpretability Beyond
Attention Visualization" (token deletion accuracy curves and the ImageNet-segmentation test).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "roc_auc", "precision_at_k", "relevance_mass", "localisation_scores",
    "trapezoid",
    "activation_curve", "auac", "pruning_curve", "au_mse", "deletion_curve", "deletion_auc", "random_relevance",
    "segmentation_scores", "binary_auc", "mean_binary_auc", "pixel_deletion_curve",
]

DEFAULT_FRACTIONS = tuple(i / 10 for i in range(11))  # 0.0, 0.1, ..., 1.0 (activation / pruning curves)
DEFAULT_DELETION_STEPS = tuple(i / 10 for i in range(1, 10))  # 0.1, ..., 0.9 (Chefer's deletion curve)
_FLOAT64_COUNT_GUARD = 1e-9  # keeps ceil(t * N) from jumping to the next integer on float rounding (0.3 * 10)


# ----------------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------------

def _float_scores(values, name: str, dims: int, what: str) -> torch.Tensor:
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


def _binary_mask(mask, name: str, shape: torch.Size, reference: str) -> torch.Tensor:
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


def _token_inputs(relevance, relevant, exclude):
    relevance = _float_scores(relevance, "relevance", 2, "(B, L), one score per token")
    relevant = _binary_mask(relevant, "relevant", relevance.shape, "relevance")
    if exclude is None:
        scored = torch.ones_like(relevant)
    else:
        scored = ~_binary_mask(exclude, "exclude", relevance.shape, "relevance")
    return relevance, relevant, scored


# ----------------------------------------------------------------------------------------------------------------
# A. Localisation against a known relevant-token mask
# ----------------------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------------------
# B. Trapezoid rule
# ----------------------------------------------------------------------------------------------------------------

def trapezoid(y, x) -> torch.Tensor:
    """Area under y(x) by the trapezoid rule along the last dimension.

    Convention: sum_i (x[i+1] - x[i]) * (y[i] + y[i+1]) / 2, the plain area in the units of x; it is not divided
    by the x range, and nothing is added outside [x[0], x[-1]] (a single point has area 0).

    Args:
        y: (..., N) values.
        x: (N,) or (..., N) sample positions, non-decreasing.
    Returns:
        (...) float64 tensor (0-dim for a 1-D y).
    """
    y = torch.as_tensor(y).detach().double().cpu()
    x = torch.as_tensor(x).detach().double().cpu()
    if y.dim() == 0 or x.dim() == 0 or x.shape[-1] != y.shape[-1]:
        raise ValueError(f"mamba_captum: trapezoid needs y (..., N) and x (N,) with the same N, got y "
                         f"{tuple(y.shape)} and x {tuple(x.shape)}.")
    if (x[..., 1:] < x[..., :-1]).any():
        raise ValueError("mamba_captum: trapezoid needs non-decreasing x; sort the points by x first.")
    return ((x[..., 1:] - x[..., :-1]) * (y[..., 1:] + y[..., :-1]) / 2).sum(-1)


def _area(curve, x, name: str):
    curve = torch.as_tensor(curve).detach().double().cpu()
    if curve.dim() == 0 or curve.shape[-1] != x.numel():
        raise ValueError(f"mamba_captum: {name} has {tuple(curve.shape)} points but there are {x.numel()} x "
                         f"values; pass the fractions/steps the curve was computed at.")
    area = trapezoid(curve, x)
    return area.item() if area.dim() == 0 else area


# ----------------------------------------------------------------------------------------------------------------
# C. Text perturbation metrics
# ----------------------------------------------------------------------------------------------------------------

def _grid(values, default: Sequence[float], name: str) -> torch.Tensor:
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


def _token_counts(grid: torch.Tensor, n_free: torch.Tensor) -> torch.Tensor:
    """(T, B) number of tokens to change: ceil(t * N - guard), clamped to [0, N].

    The guard is 1e-9 for float64 fractions; fractions given in a lower precision (torch.linspace's default
    float32) carry a rounding error of up to N * eps(dtype), so the guard grows to that.
    """
    guard = max(_FLOAT64_COUNT_GUARD, n_free.max().item() * torch.finfo(grid.dtype).eps)
    counts = torch.ceil(grid.double()[:, None] * n_free.double()[None, :] - guard).long()
    return torch.minimum(counts.clamp(min=0), n_free[None, :])


def _perturbation_inputs(input_ids, relevance, target, fixed, replacement_id, batch_size):
    input_ids = torch.as_tensor(input_ids).detach()
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"mamba_captum: input_ids must be an integer (B, L) tensor of token ids, got "
                         f"{input_ids.dtype} of shape {tuple(input_ids.shape)}.")
    relevance = _float_scores(relevance, "relevance", 2, "(B, L), one score per token")
    if relevance.shape != input_ids.shape:
        raise ValueError(f"mamba_captum: relevance has shape {tuple(relevance.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}; reduce embedding attributions to one score per token.")
    target = torch.as_tensor(target).detach()
    if target.shape != input_ids.shape[:1] or target.is_floating_point():
        raise ValueError(f"mamba_captum: target must be a (B,) = ({input_ids.shape[0]},) integer tensor of "
                         f"class indices, got {target.dtype} of shape {tuple(target.shape)}.")
    if fixed is None:
        fixed = torch.zeros(input_ids.shape, dtype=torch.bool)
    else:
        fixed = _binary_mask(fixed, "fixed", input_ids.shape, "input_ids")
    n_free = (~fixed).sum(-1)
    if (n_free == 0).any():
        raise ValueError(f"mamba_captum: every position of example(s) {torch.nonzero(n_free == 0).flatten().tolist()} "
                         f"is fixed, so there is nothing to perturb; drop those examples or unfix positions.")
    if isinstance(replacement_id, bool) or not isinstance(replacement_id, int):
        raise ValueError(f"mamba_captum: replacement_id must be an int token id (e.g. tokenizer.unk_token_id), "
                         f"got {replacement_id!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"mamba_captum: batch_size must be a positive int, got {batch_size!r}.")
    device = input_ids.device
    return input_ids, relevance, target.cpu().long(), fixed.to(device), n_free


def _ranks(order_key: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """(B, L) position -> rank: ascending order_key, ties lower position first, fixed positions last."""
    order = torch.sort(order_key, dim=-1, stable=True).indices
    # A second stable sort on the fixed flag moves fixed positions to the end and keeps the rest in order.
    order = order.gather(-1, torch.sort(fixed.gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices)
    positions = torch.arange(order.shape[-1]).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def _perturbed_logits(forward_func, input_ids, ranks, counts, fixed, replacement_id, replace_ranked, batch_size):
    """(T, B, K) float64 logits of every perturbed input, built lazily and run in chunks of batch_size rows.

    Row (t, b) marks the counts[t, b] top-ranked positions of example b. If replace_ranked, those are replaced by
    replacement_id; otherwise every other non-fixed position is replaced (the ranked ones are put back).
    """
    n_grid, n_examples = counts.shape
    device = input_ids.device
    ranks, counts = ranks.to(device), counts.to(device)
    chunks = []
    with torch.no_grad():
        for start in range(0, n_grid * n_examples, batch_size):
            rows = torch.arange(start, min(start + batch_size, n_grid * n_examples), device=device)
            grid_index, example = rows // n_examples, rows % n_examples
            ranked = ranks[example] < counts[grid_index, example][:, None]
            replace = ranked if replace_ranked else ~ranked & ~fixed[example]
            logits = forward_func(torch.where(replace, replacement_id, input_ids[example]))
            if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != rows.numel():
                shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
                raise ValueError(f"mamba_captum: forward_func must map ({rows.numel()}, L) input_ids to "
                                 f"({rows.numel()}, K) class logits, got {shape}; wrap the model, e.g. "
                                 f"lambda ids: model(ids).logits[:, -1] for a last-token classifier.")
            chunks.append(logits.detach().double().cpu())
    logits = torch.cat(chunks).reshape(n_grid, n_examples, -1)
    return logits


def _check_target(target: torch.Tensor, n_classes: int):
    if ((target < 0) | (target >= n_classes)).any():
        raise ValueError(f"mamba_captum: target holds class indices {target.tolist()} but forward_func returns "
                         f"{n_classes} logits per example; target must index into them.")


def activation_curve(forward_func: Callable[[torch.Tensor], torch.Tensor], input_ids, relevance, target,
                     replacement_id: int, fixed=None, fractions=None, batch_size: int = 64) -> torch.Tensor:
    """Input-activation curve (Ali et al. 2022): evidence for the target as the most relevant tokens come back.

    Per example, the N non-fixed positions are ordered by signed relevance, most positive first (ties: lower
    position first). At fraction t the input is all ``replacement_id`` except the fixed positions and the
    k = ceil(t * N) top-ranked positions, which keep their original tokens; the evidence is
    softmax(forward_func(input))[target].

    Args:
        forward_func: (n, L) long token ids -> (n, K) class logits; called under torch.no_grad in chunks of
            ``batch_size`` rows (put the model in eval mode first).
        input_ids: (B, L) integer token ids, no padding (all examples the same length).
        relevance: (B, L) float scores.
        target: (B,) integer class index into K (the true class).
        replacement_id: the token put in place of removed tokens (e.g. [UNK]).
        fixed: optional (B, L) bool, positions never replaced and not counted in N (e.g. the query token).
        fractions: (F,) floats in [0, 1]; default 0.0, 0.1, ..., 1.0.
        batch_size: rows per forward_func call.
    Returns:
        (F,) float64, the evidence at each fraction averaged over the examples. Higher area (``auac``) is better.
    """
    input_ids, relevance, target, fixed, n_free = _perturbation_inputs(
        input_ids, relevance, target, fixed, replacement_id, batch_size)
    fractions = _grid(fractions, DEFAULT_FRACTIONS, "fractions")
    ranks = _ranks(-relevance, fixed.cpu())
    logits = _perturbed_logits(forward_func, input_ids, ranks, _token_counts(fractions, n_free), fixed,
                               replacement_id, replace_ranked=False, batch_size=batch_size)
    _check_target(target, logits.shape[-1])
    evidence = torch.softmax(logits, -1).gather(-1, target.expand(logits.shape[0], -1)[..., None])[..., 0]
    return evidence.mean(-1)


def _fraction_area(curve, fractions):
    return _area(curve, _grid(fractions, DEFAULT_FRACTIONS, "fractions").double(), "curve")


def auac(curve, fractions=None) -> float:
    """Area under the activation curve: ``trapezoid(curve, fractions)``; higher is better.

    Args:
        curve: (F,) from ``activation_curve`` (or (..., F), giving a tensor of areas).
        fractions: the (F,) fractions the curve was computed at; default 0.0, 0.1, ..., 1.0.
    """
    return _fraction_area(curve, fractions)


def pruning_curve(forward_func: Callable[[torch.Tensor], torch.Tensor], input_ids, relevance, target,
                  replacement_id: int, fixed=None, fractions=None, batch_size: int = 64) -> torch.Tensor:
    """Input-pruning curve (Ali et al. 2022): logit change as the least relevant tokens are removed.

    Per example, the N non-fixed positions are ordered by |relevance|, smallest first (ties: lower position
    first). At fraction t the k = ceil(t * N) first-ranked positions are replaced by ``replacement_id`` and
    M_t = sum_k (logits_clean[k] - logits_t[k])**2 over the K classes.

    Args: as ``activation_curve`` (``target`` is validated but M_t uses all K logits).
    Returns:
        (F,) float64, M_t averaged over the examples. Lower area (``au_mse``) is better.
    """
    input_ids, relevance, target, fixed, n_free = _perturbation_inputs(
        input_ids, relevance, target, fixed, replacement_id, batch_size)
    fractions = _grid(fractions, DEFAULT_FRACTIONS, "fractions")
    ranks = _ranks(relevance.abs(), fixed.cpu())
    clean = _perturbed_logits(forward_func, input_ids, ranks, torch.zeros(1, len(n_free), dtype=torch.long),
                              fixed, replacement_id, replace_ranked=True, batch_size=batch_size)
    logits = _perturbed_logits(forward_func, input_ids, ranks, _token_counts(fractions, n_free), fixed,
                               replacement_id, replace_ranked=True, batch_size=batch_size)
    _check_target(target, logits.shape[-1])
    return ((clean - logits) ** 2).sum(-1).mean(-1)


def au_mse(curve, fractions=None) -> float:
    """Area under the pruning curve: ``trapezoid(curve, fractions)``; lower is better.

    Args:
        curve: (F,) from ``pruning_curve`` (or (..., F), giving a tensor of areas).
        fractions: the (F,) fractions the curve was computed at; default 0.0, 0.1, ..., 1.0.
    """
    return _fraction_area(curve, fractions)


def deletion_curve(forward_func: Callable[[torch.Tensor], torch.Tensor], input_ids, relevance, target,
                   replacement_id: int, most_relevant_first: bool = True, fixed=None, steps=None,
                   batch_size: int = 64) -> torch.Tensor:
    """Token-deletion accuracy curve (Chefer et al. 2021): top-1 accuracy as tokens are replaced.

    Per example, the N non-fixed positions are ordered by signed relevance, most positive first if
    ``most_relevant_first`` (MoRF, "positive perturbation") else most negative first (LeRF, "negative
    perturbation"); ties: lower position first. At step t the k = ceil(t * N) first-ranked positions are replaced
    by ``replacement_id`` and the example counts as a hit when argmax(logits) == target.

    Args: as ``activation_curve``, with
        most_relevant_first: MoRF (True) or LeRF (False).
        steps: (S,) floats in [0, 1]; default 0.1, 0.2, ..., 0.9.
    Returns:
        (S,) float64 accuracy in [0, 1] at each step. See ``deletion_auc`` for the area: for MoRF lower is
        better, for LeRF higher is better.
    """
    input_ids, relevance, target, fixed, n_free = _perturbation_inputs(
        input_ids, relevance, target, fixed, replacement_id, batch_size)
    steps = _grid(steps, DEFAULT_DELETION_STEPS, "steps")
    ranks = _ranks(-relevance if most_relevant_first else relevance, fixed.cpu())
    logits = _perturbed_logits(forward_func, input_ids, ranks, _token_counts(steps, n_free), fixed,
                               replacement_id, replace_ranked=True, batch_size=batch_size)
    _check_target(target, logits.shape[-1])
    return (logits.argmax(-1) == target).double().mean(-1)


def deletion_auc(curve, steps=None, clean_accuracy: float | None = None) -> float:
    """Area under a deletion accuracy curve, times 100 (Chefer et al.'s reporting unit).

    Two conventions, both by the trapezoid rule over the step fractions as x:

    * ``clean_accuracy=None``: only the curve's own points (default x = 0.1, ..., 0.9). The x range is 0.8, so a
      curve that stays at accuracy 1 scores 80.
    * ``clean_accuracy`` given (accuracy of the unperturbed inputs): the point (0, clean_accuracy) is prepended
      before integrating, as Chefer answered in his repository's issue #31; x now spans 0 to 0.9 (maximum 90).

    State which convention a reported number uses; they are not comparable. For MoRF curves lower is better,
    for LeRF curves higher is better.

    Args:
        curve: (S,) accuracies in [0, 1] from ``deletion_curve``.
        steps: the (S,) steps the curve was computed at; default 0.1, ..., 0.9.
        clean_accuracy: optional accuracy in [0, 1] at step 0.
    Returns:
        float, 100 * area.
    """
    steps = _grid(steps, DEFAULT_DELETION_STEPS, "steps").double()
    curve = torch.as_tensor(curve).detach().double().cpu()
    if curve.dim() != 1:
        raise ValueError(f"mamba_captum: deletion_auc takes one (S,) curve, got shape {tuple(curve.shape)}.")
    if not ((curve >= 0) & (curve <= 1)).all():
        raise ValueError("mamba_captum: deletion curve values must be accuracies in [0, 1]; divide percentages "
                         "by 100.")
    if clean_accuracy is not None:
        if not 0 <= clean_accuracy <= 1:
            raise ValueError(f"mamba_captum: clean_accuracy must be in [0, 1], got {clean_accuracy}; divide "
                             f"percentages by 100.")
        if steps[0] <= 0:
            raise ValueError("mamba_captum: clean_accuracy is placed at step 0, so the steps must start above "
                             "0; drop the 0 step or leave clean_accuracy out.")
        steps = torch.cat([steps.new_zeros(1), steps])
        curve = torch.cat([curve.new_tensor([float(clean_accuracy)]), curve])
    return 100 * _area(curve, steps, "curve")


def random_relevance(shape, generator: torch.Generator | None = None) -> torch.Tensor:
    """Uniform [0, 1) float64 scores of the given shape: the random-order baseline for every metric here.

    Pass a seeded ``torch.Generator`` for a reproducible baseline.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return torch.rand(shape, generator=generator, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------------------
# D. Images
# ----------------------------------------------------------------------------------------------------------------

def _average_precision(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """scikit-learn's average_precision_score: sum_k (recall_k - recall_{k-1}) * precision_k, one threshold per
    distinct score (a block of tied scores enters at once)."""
    n_positive = int(labels.sum())
    if n_positive == 0:
        return math.nan
    order = torch.argsort(scores, descending=True)
    sorted_scores, sorted_labels = scores[order], labels[order].double()
    true_pos = torch.cumsum(sorted_labels, 0)
    # The last index of each block of equal scores is where that threshold's counts are read.
    block_end = torch.nonzero(sorted_scores[1:] != sorted_scores[:-1]).flatten()
    block_end = torch.cat([block_end, block_end.new_tensor([scores.numel() - 1])])
    true_pos = true_pos[block_end]
    precision = true_pos / (block_end + 1).double()
    recall = true_pos / n_positive
    recall_gain = torch.diff(recall, prepend=recall.new_zeros(1))
    return (recall_gain * precision).sum().item()


def segmentation_scores(maps, masks) -> dict[str, float]:
    """Chefer et al.'s segmentation test: relevance maps against foreground masks.

    Each map is upsampled bilinearly (``F.interpolate``, align_corners=False) to the mask's (H, W), then:

    * prediction: foreground where R > mean(R) of that image (its own mean);
    * "pixel_accuracy": correct pixels / labelled pixels summed over the whole set (every pixel is labelled);
    * "miou": mean over {background, foreground} of (intersections summed over the set / unions summed over the
      set); a class whose union is empty over the whole set is undefined and left out of the mean;
    * "map": mean over images of the average precision (scikit-learn definition, one threshold per distinct
      score) of the 2 * H * W scores [1 - R', R'] against the labels [1 - mask, mask], both channels ranked
      together, where R' is the upsampled map min-max normalised to [0, 1] per image (a constant map becomes
      all zeros).

    Args:
        maps: (B, h, w) float relevance maps.
        masks: (B, H, W) 0/1 or bool foreground masks, H >= h and W >= w.
    Returns:
        {"pixel_accuracy": float, "miou": float, "map": float}.
    """
    maps = _float_scores(maps, "maps", 3, "(B, h, w), one relevance map per image")
    masks = torch.as_tensor(masks).detach().cpu()
    if masks.dim() != 3 or masks.shape[0] != maps.shape[0]:
        raise ValueError(f"mamba_captum: masks must be (B, H, W) with B = {maps.shape[0]} like maps, got "
                         f"{tuple(masks.shape)}.")
    if masks.shape[1] < maps.shape[1] or masks.shape[2] < maps.shape[2]:
        raise ValueError(f"mamba_captum: masks {tuple(masks.shape[1:])} are smaller than maps "
                         f"{tuple(maps.shape[1:])}; maps are upsampled to the mask size, so pass full-size masks.")
    foreground = _binary_mask(masks, "masks", masks.shape, "masks")
    upsampled = F.interpolate(maps[:, None], size=tuple(masks.shape[1:]), mode="bilinear",
                              align_corners=False)[:, 0].flatten(1)
    foreground = foreground.flatten(1)

    predicted = upsampled > upsampled.mean(-1, keepdim=True)
    pixel_accuracy = (predicted == foreground).double().mean().item()  # same count of pixels in every image

    ious = []
    for predicted_class, true_class in ((~predicted, ~foreground), (predicted, foreground)):
        union = (predicted_class | true_class).sum().item()
        if union > 0:
            ious.append((predicted_class & true_class).sum().item() / union)
    miou = sum(ious) / len(ious)  # the background union is never empty: R > mean(R) cannot hold everywhere

    low, high = upsampled.amin(-1, keepdim=True), upsampled.amax(-1, keepdim=True)
    spread = high - low
    normalised = torch.where(spread > 0, (upsampled - low) / torch.where(spread > 0, spread, 1.0), 0.0)
    average_precisions = [
        _average_precision(torch.cat([1 - normalised[b], normalised[b]]),
                           torch.cat([~foreground[b], foreground[b]]))
        for b in range(maps.shape[0])]
    return {"pixel_accuracy": pixel_accuracy, "miou": miou,
            "map": sum(average_precisions) / len(average_precisions)}


def binary_auc(maps, masks) -> torch.Tensor:
    """Per-image Binary-AUC of an activation map against the foreground mask: max(AUC, 1 - AUC).

    The ROC-AUC (ties half, as ``roc_auc``) is taken at the map's resolution. Masks already at (h, w) are used
    as they are; larger masks are downsampled with area interpolation (the foreground fraction of each cell)
    and a cell is foreground when that fraction is >= 0.5. The max makes the score blind to the map's sign.

    Args:
        maps: (B, h, w) float activation maps.
        masks: (B, h, w) or larger (B, H, W) 0/1 or bool foreground masks.
    Returns:
        (B,) float64 in [0.5, 1]; NaN for an image whose (downsampled) mask is all foreground or all background.
        Average with ``torch.nanmean`` (``mean_binary_auc``).
    """
    maps = _float_scores(maps, "maps", 3, "(B, h, w), one activation map per image")
    masks = torch.as_tensor(masks).detach().cpu()
    if masks.dim() != 3 or masks.shape[0] != maps.shape[0]:
        raise ValueError(f"mamba_captum: masks must be (B, H, W) with B = {maps.shape[0]} like maps, got "
                         f"{tuple(masks.shape)}.")
    if masks.shape[1] < maps.shape[1] or masks.shape[2] < maps.shape[2]:
        raise ValueError(f"mamba_captum: masks {tuple(masks.shape[1:])} are smaller than maps "
                         f"{tuple(maps.shape[1:])}; upsample the maps to the mask size instead.")
    foreground = _binary_mask(masks, "masks", masks.shape, "masks")
    if foreground.shape != maps.shape:
        area_fraction = F.interpolate(foreground[:, None].double(), size=tuple(maps.shape[1:]), mode="area")[:, 0]
        foreground = area_fraction >= 0.5
    auc = roc_auc(maps.flatten(1), foreground.flatten(1))
    return torch.maximum(auc, 1 - auc)  # NaN stays NaN


def mean_binary_auc(maps, masks) -> float:
    """NaN-skipping mean of ``binary_auc`` over the images (NaN if no image has both classes)."""
    return torch.nanmean(binary_auc(maps, masks)).item()


def pixel_deletion_curve(forward_func: Callable[[torch.Tensor], torch.Tensor], images, relevance, labels,
                         most_relevant_first: bool = True, steps=None, removed_value: float = 0.0,
                         batch_size: int = 256) -> torch.Tensor:
    """Chefer et al.'s image perturbation test: top-1 accuracy as pixels are removed in order of relevance.

    At step t the k = round(t · H · W) pixels ranked first (most relevant first if ``most_relevant_first``:
    "positive perturbation", lower area is better; least relevant first: "negative perturbation", higher is
    better) are set to ``removed_value`` in every channel (0: the mean of normalised pixels, as their code zeroes
    them); an image counts as a hit when the model's top-1 class is its label. Ties: lower pixel index first.

    Args:
        forward_func: images (n, C, H, W) -> logits (n, K).
        images: (B, C, H, W).  relevance: (B, H, W) per-pixel scores.  labels: (B,) the classes counted as hits.
        steps: (S,) fractions in [0, 1]; default 0.1, ..., 0.9.
    Returns:
        (S,) float64 accuracies. ``deletion_auc(curve, clean_accuracy=...)`` gives Chefer's area (×100).
    """
    images = torch.as_tensor(images)
    relevance = _float_scores(relevance, "relevance", 3, "(B, H, W), one score per pixel")
    if images.dim() != 4 or relevance.shape != (images.shape[0], *images.shape[2:]):
        raise ValueError(f"mamba_captum: images (B, C, H, W) = {tuple(images.shape)} and relevance (B, H, W) = "
                         f"{tuple(relevance.shape)} do not match.")
    labels = torch.as_tensor(labels).long().cpu()
    steps = _grid(steps, DEFAULT_DELETION_STEPS, "steps")
    batch, pixels = relevance.shape[0], relevance[0].numel()
    order = torch.sort(-relevance.flatten(1) if most_relevant_first else relevance.flatten(1), dim=1,
                       stable=True).indices  # (B, H·W): pixels in removal order
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(pixels).expand(batch, -1))
    hits = torch.zeros(len(steps), dtype=torch.float64)
    for s, step in enumerate(steps.tolist()):
        removed = (rank < round(step * pixels)).view(batch, 1, *images.shape[2:]).to(images.device)
        perturbed = torch.where(removed, torch.full_like(images, removed_value), images)
        with torch.no_grad():
            predictions = torch.cat([forward_func(perturbed[i:i + batch_size]).argmax(-1).cpu()
                                     for i in range(0, batch, batch_size)])
        hits[s] = (predictions == labels).double().mean()
    return hits
