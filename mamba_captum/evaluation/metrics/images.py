"""Image tests (Chefer et al. 2021): the segmentation test of relevance maps against foreground masks, the
Binary-AUC of activation maps, and the pixel deletion accuracy curve (the conventions:
``mamba_captum.evaluation.metrics``)."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .inputs import DEFAULT_DELETION_STEPS, binary_mask, float_scores, fraction_grid
from .localisation import roc_auc


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
    maps = float_scores(maps, "maps", 3, "(B, h, w), one relevance map per image")
    masks = torch.as_tensor(masks).detach().cpu()
    if masks.dim() != 3 or masks.shape[0] != maps.shape[0]:
        raise ValueError(f"mamba_captum: masks must be (B, H, W) with B = {maps.shape[0]} like maps, got "
                         f"{tuple(masks.shape)}.")
    if masks.shape[1] < maps.shape[1] or masks.shape[2] < maps.shape[2]:
        raise ValueError(f"mamba_captum: masks {tuple(masks.shape[1:])} are smaller than maps "
                         f"{tuple(maps.shape[1:])}; maps are upsampled to the mask size, so pass full-size masks.")
    foreground = binary_mask(masks, "masks", masks.shape, "masks")
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
    maps = float_scores(maps, "maps", 3, "(B, h, w), one activation map per image")
    masks = torch.as_tensor(masks).detach().cpu()
    if masks.dim() != 3 or masks.shape[0] != maps.shape[0]:
        raise ValueError(f"mamba_captum: masks must be (B, H, W) with B = {maps.shape[0]} like maps, got "
                         f"{tuple(masks.shape)}.")
    if masks.shape[1] < maps.shape[1] or masks.shape[2] < maps.shape[2]:
        raise ValueError(f"mamba_captum: masks {tuple(masks.shape[1:])} are smaller than maps "
                         f"{tuple(maps.shape[1:])}; upsample the maps to the mask size instead.")
    foreground = binary_mask(masks, "masks", masks.shape, "masks")
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
    relevance = float_scores(relevance, "relevance", 3, "(B, H, W), one score per pixel")
    if images.dim() != 4 or relevance.shape != (images.shape[0], *images.shape[2:]):
        raise ValueError(f"mamba_captum: images (B, C, H, W) = {tuple(images.shape)} and relevance (B, H, W) = "
                         f"{tuple(relevance.shape)} do not match.")
    labels = torch.as_tensor(labels).long().cpu()
    steps = fraction_grid(steps, DEFAULT_DELETION_STEPS, "steps")
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
