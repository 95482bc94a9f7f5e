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

Every metric is imported from here; they live in ``localisation``, ``token_perturbation`` (with the trapezoid rule)
and ``images``, and share the input checks of ``inputs``.
"""
# in the order of __all__, the order the API reference shows them in
from .localisation import roc_auc, precision_at_k, relevance_mass, localisation_scores
from .token_perturbation import (trapezoid, activation_curve, auac, pruning_curve, au_mse, deletion_curve,
                                 deletion_auc, random_relevance)
from .images import segmentation_scores, binary_auc, mean_binary_auc, pixel_deletion_curve
from .inputs import DEFAULT_FRACTIONS, DEFAULT_DELETION_STEPS  # the curves' default grids

__all__ = [
    "roc_auc", "precision_at_k", "relevance_mass", "localisation_scores",
    "trapezoid",
    "activation_curve", "auac", "pruning_curve", "au_mse", "deletion_curve", "deletion_auc", "random_relevance",
    "segmentation_scores", "binary_auc", "mean_binary_auc", "pixel_deletion_curve",
]
