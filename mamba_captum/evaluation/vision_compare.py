"""The image faithfulness comparison: our methods and Captum's baselines on the tiny trained Vims.

Every method gives a (B, H, W) pixel map for the explained class: ours through the Captum classes (patch maps
interpolated from the patch centres, as the papers upsample); Saliency, InputXGradient and IntegratedGradients
(50 steps, black = 0 baseline) summed over the colour channels; LayerGradCam on the last block's output tokens
(a view of them as (B, D, L) channels × positions, Captum's Grad-CAM: ReLU of the channel sum weighted by the
token-mean gradients), CLS dropped and interpolated like ours; FeatureAblation with one feature per patch
(baseline 0); random patch values.

Scores (Chefer et al.; Yang et al.; docs/faithfulness.md "Images"):
- segmentation against the planted object's pixels (``shapes``): pixel accuracy, mIoU, mAP with the map
  thresholded at its mean (:func:`metrics.segmentation_scores`) and Binary-AUC (:func:`metrics.binary_auc`),
  explaining the predicted class;
- positive / negative perturbation (:func:`metrics.pixel_deletion_curve`): top-1 accuracy against the label as
  10 … 90 % of the pixels are zeroed, most / least relevant first, AUC ×100 with the clean point at 0 % (Chefer's
  convention), explaining the predicted class and the true class.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from captum.attr import FeatureAblation, InputXGradient, IntegratedGradients, LayerGradCam, Saliency
from torch import nn

from .. import MambaAttribution, MambaRawAttention, MambaRollout
from ..files import atomic_target, write_atomically
from . import metrics
from .results import read_doc
from .vision_models import held_out, load_trained_vim

BEGIN = "<!-- generated-images:begin (python -m mamba_captum.evaluation.vision) -->"
END = "<!-- generated-images:end -->"


@dataclass
class ImageMethod:
    """``run(model, images, targets) -> (B, H, W)`` pixel relevance for the target classes."""

    name: str
    group: str  # "ours", "official", "captum", "random"
    run: Callable
    class_agnostic: bool = False  # the same map whatever the class: explained once


def _ours(cls, **options):
    def run(model, images, targets):
        return cls(model).attribute(images, target=targets, **options).detach()[:, 0]
    return run


def _channels_summed(cls, **options):
    def run(model, images, targets):
        return cls(model).attribute(images, target=targets, **options).detach().sum(1)
    return run


class _GridView(nn.Module):
    """The Vim's forward with the last block's output tokens exposed as (B, D, L) through an identity module, so that
    Captum's LayerGradCam sees D channels over L positions (its mean over the trailing dims is then the token mean)."""

    def __init__(self, vim):
        super().__init__()
        self.vim = vim
        self.tokens_as_channels = nn.Identity()

    def forward(self, pixel_values):
        vim = self.vim
        residual = vim.tokens(pixel_values).float()
        for block in vim.layers:
            residual = block(residual)
        residual = self.tokens_as_channels(residual.transpose(1, 2)).transpose(1, 2)
        hidden = vim.norm_f(residual)
        index = vim.cls_index()
        return vim.head(hidden[:, index] if index is not None else hidden.mean(1))


def _grad_cam(model, images, targets):
    view = _GridView(model)
    cam = LayerGradCam(view, view.tokens_as_channels).attribute(images, target=targets, relu_attributions=True)
    return model.token_layout().to_pixels(cam.detach()[:, 0])[:, 0]  # (B, 1, L) -> (B, H, W)


def _feature_ablation(model, images, targets):
    layout = model.token_layout()
    rows, cols = layout.grid
    patch_h, patch_w = layout.patch_size
    index = torch.arange(rows * cols).reshape(rows, cols)
    mask = index.repeat_interleave(patch_h, 0).repeat_interleave(patch_w, 1)[None, None]  # (1, 1, H, W)
    attributions = FeatureAblation(model).attribute(images, target=targets, feature_mask=mask,
                                                    perturbations_per_eval=16)
    return attributions.detach().sum(1)


def _random(model, images, targets):
    layout = model.token_layout()
    generator = torch.Generator().manual_seed(0)
    return layout.to_pixels(torch.rand(images.shape[0], layout.length, generator=generator))[:, 0]


def image_methods() -> list[ImageMethod]:
    methods = []
    for formulation in ("unified", "hidden"):
        methods += [
            ImageMethod(f"Attribution ({formulation})", "ours", _ours(MambaAttribution, formulation=formulation)),
            ImageMethod(f"Attribution ({formulation}, residual)", "ours",
                        _ours(MambaAttribution, formulation=formulation, gradient_rule="residual")),
            ImageMethod(f"Rollout ({formulation})", "ours", _ours(MambaRollout, formulation=formulation), True),
            ImageMethod(f"Raw attention ({formulation})", "ours", _ours(MambaRawAttention, formulation=formulation),
                        True),
        ]
    methods += [
        ImageMethod("UIA official (unified attribution)", "official",
                    _ours(MambaAttribution, formulation="unified", recipe="official")),
        ImageMethod("HMA official (hidden attribution)", "official",
                    _ours(MambaAttribution, formulation="hidden", recipe="official")),
        ImageMethod("HMA official (hidden rollout)", "official",
                    _ours(MambaRollout, formulation="hidden", recipe="official"), True),
        ImageMethod("Saliency", "captum", _channels_summed(Saliency)),
        ImageMethod("InputXGradient", "captum", _channels_summed(InputXGradient)),
        ImageMethod("IntegratedGradients", "captum",
                    _channels_summed(IntegratedGradients, n_steps=50, internal_batch_size=256)),
        ImageMethod("LayerGradCam (last block)", "captum", _grad_cam),
        ImageMethod("FeatureAblation (patches)", "captum", _feature_ablation),
        ImageMethod("random", "random", _random, True),
    ]
    return methods


def _scores(model, task, relevance_predicted, relevance_label, clean_accuracy) -> dict:
    row = {}
    if task.masks is not None:
        row.update(metrics.segmentation_scores(relevance_predicted, task.masks))
        row["binary_auc"] = metrics.mean_binary_auc(relevance_predicted, task.masks)
    curves = {}
    for which, relevance in (("predicted", relevance_predicted), ("target", relevance_label)):
        for order, first in (("positive", True), ("negative", False)):
            curve = metrics.pixel_deletion_curve(model, task.images, relevance, task.labels,
                                                 most_relevant_first=first)
            curves[f"{order}_{which}"] = curve.tolist()
            row[f"{order}_{which}"] = metrics.deletion_auc(curve, clean_accuracy=clean_accuracy)
    row["curves"] = curves
    return row


def evaluate_images(tasks, examples: int = 128, weights_root=None, methods=None, log=print) -> dict:
    """Score every method on each task's shipped model: ``{"models": [...], "rows": [...]}``."""
    methods = image_methods() if methods is None else methods
    results = {"models": [], "rows": []}
    for task_name in tasks:
        model, record = load_trained_vim(task_name, weights_root)
        results["models"].append(record)
        task = held_out(task_name).subset(slice(0, examples))
        with torch.no_grad():
            predicted = model(task.images).argmax(-1)
        clean_accuracy = float((predicted == task.labels).double().mean())
        for method in methods:
            start = time.perf_counter()
            relevance_predicted = method.run(model, task.images, predicted)
            seconds = time.perf_counter() - start
            same = method.class_agnostic or bool((predicted == task.labels).all())
            relevance_label = relevance_predicted if same else method.run(model, task.images, task.labels)
            row = dict(task=task_name, method=method.name, group=method.group, seconds=round(seconds, 2),
                       examples=len(task), clean_accuracy=clean_accuracy,
                       **_scores(model, task, relevance_predicted, relevance_label, clean_accuracy))
            results["rows"].append(row)
            log({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "curves"})
    return results


# -- the report ----------------------------------------------------------------------------------------------------
def _fmt(value, digits=1):
    return "–" if value is None else f"{value:.{digits}f}"


def _tables(results) -> str:
    parts = ["### The models", "", "| task | classes | held-out accuracy | training steps | training time (s) | "
             "parameters |", "|---|---|---|---|---|---|"]
    for record in results["models"]:
        parts.append(f"| {record['task']} | {record['config']['num_classes']} | "
                     f"{record['held_out_accuracy']:.1%} ({record['held_out_examples']}) | {record['steps']} | "
                     f"{record['train_seconds']} | {record['parameters']:,} |")
    segmentation = [r for r in results["rows"] if "miou" in r]
    if segmentation:
        parts += ["", "### Segmentation of the planted object (`shapes`, predicted class)", "",
                  "| method | pixel accuracy | mIoU | mAP | Binary-AUC | seconds |", "|---|---|---|---|---|---|"]
        for r in sorted(segmentation, key=lambda r: -r["miou"]):
            parts.append(f"| {r['method']} | {100 * r['pixel_accuracy']:.1f} | {100 * r['miou']:.1f} | "
                         f"{100 * r['map']:.1f} | {r['binary_auc']:.3f} | {r['seconds']} |")
    for task in dict.fromkeys(r["task"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["task"] == task]
        parts += ["", f"### Perturbation (`{task}`, clean accuracy {rows[0]['clean_accuracy']:.1%})", "",
                  "AUC ×100 of top-1 accuracy against the fraction of pixels zeroed (0, 10 … 90 %); positive "
                  "(most relevant first): lower is better; negative (least relevant first): higher is better.", "",
                  "| method | positive, predicted ↓ | positive, target ↓ | negative, predicted ↑ | negative, target ↑ |",
                  "|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: r["positive_predicted"]):
            parts.append(f"| {r['method']} | {_fmt(r['positive_predicted'])} | {_fmt(r['positive_target'])} | "
                         f"{_fmt(r['negative_predicted'])} | {_fmt(r['negative_target'])} |")
    return "\n".join(parts)


def _plots(results, folder: Path, examples=4) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, axes = plt.subplots(1, len({r["task"] for r in results["rows"]}), figsize=(12, 4), squeeze=False)
    for ax, task in zip(axes[0], dict.fromkeys(r["task"] for r in results["rows"])):
        steps = [0.0] + [i / 10 for i in range(1, 10)]
        for r in results["rows"]:
            if r["task"] == task and r["group"] != "ours" or (r["task"] == task and r["method"] in
                                                               ("Attribution (unified)", "Attribution (hidden)")):
                ax.plot(steps, [r["clean_accuracy"]] + r["curves"]["positive_predicted"], label=r["method"])
        ax.set_title(f"{task}: positive perturbation (predicted class)")
        ax.set_xlabel("fraction of pixels zeroed, most relevant first")
        ax.set_ylabel("top-1 accuracy")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    with atomic_target(folder / "images_curves.png") as temporary:
        fig.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    names.append("images_curves.png")
    return names


def example_figure(folder: Path, weights_root=None, count: int = 4, methods=None) -> str:
    """A grid of held-out ``shapes`` images (with the planted object outlined) and each method's map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..vision import to_display

    model, _ = load_trained_vim("shapes", weights_root)
    task = held_out("shapes").subset(slice(0, count))
    methods = methods or [m for m in image_methods() if m.name in (
        "Attribution (unified)", "Attribution (hidden)", "UIA official (unified attribution)",
        "HMA official (hidden attribution)", "Saliency", "IntegratedGradients", "LayerGradCam (last block)",
        "FeatureAblation (patches)")]
    with torch.no_grad():
        predicted = model(task.images).argmax(-1)
    maps = [m.run(model, task.images, predicted) for m in methods]
    fig, axes = plt.subplots(count, len(methods) + 1, figsize=(1.7 * (len(methods) + 1), 1.8 * count))
    for i in range(count):
        image = to_display(task.images[i], mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
        axes[i, 0].imshow(image)
        axes[i, 0].contour(task.masks[i].numpy(), levels=[0.5], colors="white", linewidths=0.8)
        axes[i, 0].set_title(task.class_names[int(task.labels[i])], fontsize=8)
        for j, (method, relevance) in enumerate(zip(methods, maps), start=1):
            axes[i, j].imshow(relevance[i].numpy(), cmap="inferno")
            axes[i, j].contour(task.masks[i].numpy(), levels=[0.5], colors="cyan", linewidths=0.6)
            if i == 0:
                axes[i, j].set_title(method.name.replace(" (", "\n("), fontsize=7)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    with atomic_target(folder / "images_examples.png") as temporary:
        fig.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "images_examples.png"


def write_image_report(results, doc: Path, assets: Path, command: str, weights_root=None):
    """Write images.json, the plots and the image section of ``doc``; the doc is read and checked first
    (:func:`.results.read_doc`, ValueError), so a doc without the markers leaves every file as it was."""
    text = read_doc(doc, BEGIN, END)
    assets.mkdir(parents=True, exist_ok=True)
    write_atomically(assets / "images.json", json.dumps(results, indent=0) + "\n")
    _plots(results, assets)
    example_figure(assets, weights_root)
    section = "\n".join([
        BEGIN, "", f"Written by `{command}` ({results.get('seconds', '?')} s on 2 CPU cores, shared); the rows are in "
        "`docs/assets/faithfulness/images.json`. Held-out images only (a seed, or a split, no model saw).", "",
        _tables(results), "", "![maps of held-out shapes images, the planted object outlined]"
        "(assets/faithfulness/images_examples.png)", "",
        "![positive perturbation curves](assets/faithfulness/images_curves.png)", "", END])
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    write_atomically(doc, head + section + tail)
