"""Token perturbation curves and the areas under them: input activation and pruning (Ali et al. 2022, AUAC and
AU-MSE), token deletion accuracy (Chefer et al. 2021), the trapezoid rule they share and the random baseline (the
conventions: ``mamba_captum.evaluation.metrics``)."""
from __future__ import annotations

from typing import Callable

import torch

from .inputs import DEFAULT_DELETION_STEPS, DEFAULT_FRACTIONS, binary_mask, float_scores, fraction_grid

_FLOAT64_COUNT_GUARD = 1e-9  # keeps ceil(t * N) from jumping to the next integer on float rounding (0.3 * 10)



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
    relevance = float_scores(relevance, "relevance", 2, "(B, L), one score per token")
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
        fixed = binary_mask(fixed, "fixed", input_ids.shape, "input_ids")
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
    fractions = fraction_grid(fractions, DEFAULT_FRACTIONS, "fractions")
    ranks = _ranks(-relevance, fixed.cpu())
    logits = _perturbed_logits(forward_func, input_ids, ranks, _token_counts(fractions, n_free), fixed,
                               replacement_id, replace_ranked=False, batch_size=batch_size)
    _check_target(target, logits.shape[-1])
    evidence = torch.softmax(logits, -1).gather(-1, target.expand(logits.shape[0], -1)[..., None])[..., 0]
    return evidence.mean(-1)


def _fraction_area(curve, fractions):
    return _area(curve, fraction_grid(fractions, DEFAULT_FRACTIONS, "fractions").double(), "curve")


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
    fractions = fraction_grid(fractions, DEFAULT_FRACTIONS, "fractions")
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
    steps = fraction_grid(steps, DEFAULT_DELETION_STEPS, "steps")
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
    steps = fraction_grid(steps, DEFAULT_DELETION_STEPS, "steps").double()
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
