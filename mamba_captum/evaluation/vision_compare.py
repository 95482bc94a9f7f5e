"""The image faithfulness comparison: our methods and Captum's baselines on the tiny trained vision SSMs (Vim,
VMamba, MambaOut, EfficientViM, MambaVision; :mod:`.vision_models`).

Every method gives a (B, 32, 32) pixel map over the task's images for the explained class: ours through the Captum
classes (first-stage token maps interpolated from the token centres, as the papers upsample); Saliency,
InputXGradient and IntegratedGradients (50 steps, black = 0 baseline) summed over the colour channels;
LayerGradCam on the last stage's output (Vim: the last block's tokens viewed as (B, D, L) channels × positions, CLS
dropped; the multi-stage models: the last stage's feature map (B, C, h, w)), Captum's Grad-CAM (ReLU of the channel
sum weighted by the position-mean gradients), interpolated from the token centres like ours; FeatureAblation with
one feature per first-stage token's pixels (baseline 0); random first-stage token values. The official recipes
(UIA / HMA) are Vim's (they read its CLS token): Vim only.

EfficientViM takes the task's images upsampled to 128 × 128 (:class:`.vision_models.Upsampled`): ours explain it
there and their maps are averaged back to 32 × 32 (:func:`.vision_models.task_pixels`); the Captum baselines and
the perturbation tests run on the upsampling model itself, so their pixels are the task's.

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
from .vision_models import (ARCHITECTURES, IMAGE_SIZE, VISION_TASKS, held_out, load_trained_vim, model_pixels,
                            on_task_pixels, task_pixels)

ARCH_NAMES = {"vim": "Vim", "vmamba": "VMamba", "mambaout": "MambaOut", "efficientvim": "EfficientViM",
              "mambavision": "MambaVision"}

BEGIN = "<!-- generated-images:begin (python -m mamba_captum.evaluation.vision) -->"
END = "<!-- generated-images:end -->"


@dataclass
class ImageMethod:
    """``run(model, images, targets) -> (B, H, W)`` pixel relevance for the target classes."""

    name: str
    group: str  # "ours", "official", "captum", "random"
    run: Callable
    class_agnostic: bool = False  # the same map whatever the class: explained once
    vim_only: bool = False  # a recipe of Vim's (its CLS token): not run on the other architectures

    def applies_to(self, arch: str) -> bool:
        return arch == "vim" or not self.vim_only


def _ours(cls, **options):
    def run(model, images, targets):
        maps = cls(model).attribute(model_pixels(model, images), target=targets, **options).detach()[:, 0]
        return task_pixels(maps)
    return run


def _channels_summed(cls, **options):
    def run(model, images, targets):
        return cls(on_task_pixels(model)).attribute(images, target=targets, **options).detach().sum(1)
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


def last_stage(model) -> tuple[nn.Module, int | None, bool]:
    """The module whose output is a multi-stage model's last feature map: (module, the map's index in a tuple
    output or None, whether the map is channel-last (B, h, w, C))."""
    kind = type(model).__name__
    if kind == "VSSM":
        return model.layers[-1], None, not model.channel_first
    if kind == "MambaOut":
        return model.stages[-1], None, True
    if kind == "EfficientViM":  # a stage returns (its input to the next stage, its output map, its state)
        return model.stages[-1], 1, False
    if kind == "MambaVision":
        return model.levels[-1], None, False
    raise ValueError(f"mamba_captum: no last-stage feature map known for a {kind}.")


class _StageMapView(nn.Module):
    """A multi-stage model (on the task's pixels) whose last stage's feature map passes, as (B, C, h, w), through
    an identity module: Captum's LayerGradCam on that module is Grad-CAM on the last stage's map."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.forward_model = on_task_pixels(model)
        self.feature_map = nn.Identity()

    def _route(self, module, inputs, output):
        stage_module, index, channel_last = last_stage(self.model)
        value = output if index is None else output[index]
        value = value.permute(0, 3, 1, 2) if channel_last else value
        value = self.feature_map(value)
        value = value.permute(0, 2, 3, 1) if channel_last else value
        if index is None:
            return value
        return (*output[:index], value, *output[index + 1:])

    def forward(self, pixel_values):
        handle = last_stage(self.model)[0].register_forward_hook(self._route)
        try:
            return self.forward_model(pixel_values)
        finally:
            handle.remove()


def _grad_cam(model, images, targets):
    layout = model.token_layout()
    if not hasattr(layout, "stages"):  # Vim: one sequence of tokens, CLS included
        view = _GridView(model)
        cam = LayerGradCam(view, view.tokens_as_channels).attribute(images, target=targets, relu_attributions=True)
        return layout.to_pixels(cam.detach()[:, 0])[:, 0]  # (B, 1, L) -> (B, H, W)
    view = _StageMapView(model)
    cam = LayerGradCam(view, view.feature_map).attribute(images, target=targets, relu_attributions=True)
    cam = cam.detach()[:, 0].flatten(1)  # (B, h·w) over the last stage's tokens
    return task_pixels(layout.stage_to_pixels(cam)[:, 0])


def patch_feature_mask(model) -> torch.Tensor:
    """(1, 1, 32, 32) long: one feature per first-stage token, over the task pixels that token sees."""
    rows, cols = model.token_layout().grid
    patch_h, patch_w = IMAGE_SIZE // rows, IMAGE_SIZE // cols
    index = torch.arange(rows * cols).reshape(rows, cols)
    return index.repeat_interleave(patch_h, 0).repeat_interleave(patch_w, 1)[None, None]


def _feature_ablation(model, images, targets):
    attributions = FeatureAblation(on_task_pixels(model)).attribute(
        images, target=targets, feature_mask=patch_feature_mask(model), perturbations_per_eval=16)
    return attributions.detach().sum(1)


def _random(model, images, targets):
    layout = model.token_layout()
    generator = torch.Generator().manual_seed(0)
    return task_pixels(layout.to_pixels(torch.rand(images.shape[0], layout.length, generator=generator))[:, 0])


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
                    _ours(MambaAttribution, formulation="unified", recipe="official"), vim_only=True),
        ImageMethod("HMA official (hidden attribution)", "official",
                    _ours(MambaAttribution, formulation="hidden", recipe="official"), vim_only=True),
        ImageMethod("HMA official (hidden rollout)", "official",
                    _ours(MambaRollout, formulation="hidden", recipe="official"), True, vim_only=True),
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
            curve = metrics.pixel_deletion_curve(on_task_pixels(model), task.images, relevance, task.labels,
                                                 most_relevant_first=first)
            curves[f"{order}_{which}"] = curve.tolist()
            row[f"{order}_{which}"] = metrics.deletion_auc(curve, clean_accuracy=clean_accuracy)
    row["curves"] = curves
    return row


def row_arch(row: dict) -> str:
    """The architecture of a result row or model record (rows written before there were several: Vim)."""
    return row.get("arch", row.get("family", "vim"))


def evaluate_images(tasks, examples: int = 128, weights_root=None, methods=None, log=print,
                    archs=("vim",)) -> dict:
    """Score every method on each architecture's shipped model of each task: ``{"models": [...], "rows": [...]}``
    (each row names its ``arch``)."""
    methods = image_methods() if methods is None else methods
    results = {"models": [], "rows": []}
    for arch in archs:
        for task_name in tasks:
            _evaluate_model(arch, task_name, examples, weights_root, methods, log, results)
    return results


def _evaluate_model(arch, task_name, examples, weights_root, methods, log, results):
    model, record = load_trained_vim(task_name, weights_root, arch)
    results["models"].append(record)
    task = held_out(task_name).subset(slice(0, examples))
    with torch.no_grad():
        predicted = on_task_pixels(model)(task.images).argmax(-1)
    clean_accuracy = float((predicted == task.labels).double().mean())
    for method in [m for m in methods if m.applies_to(arch)]:
        start = time.perf_counter()
        relevance_predicted = method.run(model, task.images, predicted)
        seconds = time.perf_counter() - start
        same = method.class_agnostic or bool((predicted == task.labels).all())
        relevance_label = relevance_predicted if same else method.run(model, task.images, task.labels)
        row = dict(arch=arch, task=task_name, method=method.name, group=method.group, seconds=round(seconds, 2),
                   examples=len(task), clean_accuracy=clean_accuracy,
                   **_scores(model, task, relevance_predicted, relevance_label, clean_accuracy))
        results["rows"].append(row)
        log({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "curves"})


# -- the report ----------------------------------------------------------------------------------------------------
def _fmt(value, digits=1):
    return "–" if value is None else f"{value:.{digits}f}"


def _archs(results) -> list[str]:
    """The architectures in ``results``, in :data:`.vision_models.ARCHITECTURES` order."""
    present = {row_arch(r) for r in results["rows"]} | {row_arch(m) for m in results["models"]}
    return [a for a in ARCHITECTURES if a in present]


def _side_by_side(rows, archs, cell) -> list[str]:
    """A table of one row per method (in the order first met) and one column per architecture."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = ["| method | " + " | ".join(ARCH_NAMES[a] for a in archs) + " |", "|---" * (len(archs) + 1) + "|"]
    by_key = {(row_arch(r), r["method"]): r for r in rows}
    for method in methods:
        cells = [cell(by_key[a, method]) if (a, method) in by_key else "–" for a in archs]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def _tables(results) -> str:
    archs = _archs(results)
    parts = ["### The models", "", "| architecture | task | classes | input | held-out accuracy | training steps | "
             "training time (s) | parameters |", "|---|---|---|---|---|---|---|---|"]
    task_order = {task: index for index, task in enumerate(VISION_TASKS)}
    for record in sorted(results["models"], key=lambda m: (archs.index(row_arch(m)), task_order.get(m["task"], 9))):
        size = record["config"].get("img_size", IMAGE_SIZE)
        size = size if isinstance(size, int) else size[0]
        upsampled = "" if size == IMAGE_SIZE else f" (32² upsampled to {size}²)"
        parts.append(f"| {ARCH_NAMES[row_arch(record)]} | {record['task']} | {record['config']['num_classes']} | "
                     f"{size}²{upsampled} | {record['held_out_accuracy']:.1%} ({record['held_out_examples']}) | "
                     f"{record['steps']} | {record['train_seconds']} | {record['parameters']:,} |")
    segmentation = [r for r in results["rows"] if "miou" in r]
    if segmentation:
        parts += ["", "### Segmentation of the planted object, side by side (`shapes`, predicted class)", "",
                  "mIoU ×100 / Binary-AUC of each method on each architecture's model (– : the method does not "
                  "apply: the official recipes read Vim's CLS token).", ""]
        parts += _side_by_side(segmentation, archs, lambda r: f"{100 * r['miou']:.1f} / {r['binary_auc']:.3f}")
    for task in dict.fromkeys(r["task"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["task"] == task]
        clean = ", ".join(f"{ARCH_NAMES[a]} {next(r['clean_accuracy'] for r in rows if row_arch(r) == a):.1%}"
                          for a in archs if any(row_arch(r) == a for r in rows))
        parts += ["", f"### Perturbation, side by side (`{task}`; clean accuracy {clean})", "",
                  "AUC ×100 of top-1 accuracy against the fraction of pixels zeroed (0, 10 … 90 %), explaining the "
                  "predicted class: positive (most relevant first, lower is better) / negative (least relevant "
                  "first, higher is better).", ""]
        parts += _side_by_side(rows, archs, lambda r: f"{_fmt(r['positive_predicted'])} / "
                                                      f"{_fmt(r['negative_predicted'])}")
    for arch in archs:
        parts += ["", f"<details><summary>{ARCH_NAMES[arch]}: every score</summary>", ""]
        parts += _arch_tables([r for r in results["rows"] if row_arch(r) == arch])
        parts += ["", "</details>"]
    return "\n".join(parts)


def _arch_tables(arch_rows) -> list[str]:
    """One architecture's full tables: segmentation and each task's perturbation (predicted and target class)."""
    parts = []
    segmentation = [r for r in arch_rows if "miou" in r]
    if segmentation:
        parts += ["#### Segmentation (`shapes`, predicted class)", "",
                  "| method | pixel accuracy | mIoU | mAP | Binary-AUC | seconds |", "|---|---|---|---|---|---|"]
        for r in sorted(segmentation, key=lambda r: -r["miou"]):
            parts.append(f"| {r['method']} | {100 * r['pixel_accuracy']:.1f} | {100 * r['miou']:.1f} | "
                         f"{100 * r['map']:.1f} | {r['binary_auc']:.3f} | {r['seconds']} |")
    for task in dict.fromkeys(r["task"] for r in arch_rows):
        rows = [r for r in arch_rows if r["task"] == task]
        parts += ["", f"#### Perturbation (`{task}`, clean accuracy {rows[0]['clean_accuracy']:.1%})", "",
                  "| method | positive, predicted ↓ | positive, target ↓ | negative, predicted ↑ | "
                  "negative, target ↑ |", "|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: r["positive_predicted"]):
            parts.append(f"| {r['method']} | {_fmt(r['positive_predicted'])} | {_fmt(r['positive_target'])} | "
                         f"{_fmt(r['negative_predicted'])} | {_fmt(r['negative_target'])} |")
    return parts


def _plots(results, folder: Path, examples=4) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    archs, tasks = _archs(results), list(dict.fromkeys(r["task"] for r in results["rows"]))
    fig, axes = plt.subplots(len(archs), len(tasks), figsize=(12, 4 * len(archs)), squeeze=False)
    steps = [0.0] + [i / 10 for i in range(1, 10)]
    for row_axes, arch in zip(axes, archs):
        for ax, task in zip(row_axes, tasks):
            for r in results["rows"]:
                if row_arch(r) == arch and r["task"] == task and (r["group"] != "ours" or r["method"] in (
                        "Attribution (unified)", "Attribution (unified, residual)", "Attribution (hidden)")):
                    ax.plot(steps, [r["clean_accuracy"]] + r["curves"]["positive_predicted"], label=r["method"])
            ax.set_title(f"{ARCH_NAMES[arch]}, {task}: positive perturbation (predicted class)", fontsize=9)
            ax.set_xlabel("fraction of pixels zeroed, most relevant first")
            ax.set_ylabel("top-1 accuracy")
        row_axes[-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    with atomic_target(folder / "images_curves.png") as temporary:
        fig.savefig(temporary, format="png", dpi=75, bbox_inches="tight")
    plt.close(fig)
    names.append("images_curves.png")
    return names


def examples_file(arch: str) -> str:
    """The example figure of ``arch``: ``images_examples.png`` (Vim), ``images_examples_<arch>.png``."""
    return "images_examples.png" if arch == "vim" else f"images_examples_{arch}.png"


def example_figure(folder: Path, weights_root=None, count: int = 4, methods=None, arch: str = "vim") -> str:
    """A grid of held-out ``shapes`` images (with the planted object outlined) and each method's map on ``arch``'s
    model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..vision import to_display

    model, _ = load_trained_vim("shapes", weights_root, arch)
    task = held_out("shapes").subset(slice(0, count))
    methods = methods or [m for m in image_methods() if m.applies_to(arch) and m.name in (
        "Attribution (unified)", "Attribution (unified, residual)", "Attribution (hidden)",
        "UIA official (unified attribution)",
        "HMA official (hidden attribution)", "Saliency", "IntegratedGradients", "LayerGradCam (last block)",
        "FeatureAblation (patches)")]
    with torch.no_grad():
        predicted = on_task_pixels(model)(task.images).argmax(-1)
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
    with atomic_target(folder / examples_file(arch)) as temporary:
        fig.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return examples_file(arch)


def write_image_report(results, doc: Path, assets: Path, command: str, weights_root=None,
                       examples_figures: bool = True):
    """Write images.json, the plots and the image section of ``doc``; the doc is read and checked first
    (:func:`.results.read_doc`, ValueError), so a doc without the markers leaves every file as it was."""
    text = read_doc(doc, BEGIN, END)
    assets.mkdir(parents=True, exist_ok=True)
    write_atomically(assets / "images.json", json.dumps(results, indent=0) + "\n")
    _plots(results, assets)
    archs = _archs(results)
    figures = []
    for arch in archs:
        if examples_figures:
            example_figure(assets, weights_root, arch=arch)
        figures += [f"![{ARCH_NAMES[arch]}: maps of held-out shapes images, the planted object outlined]"
                    f"(assets/faithfulness/{examples_file(arch)})", ""]
    commands = results.get("commands") or {}
    written = "; ".join(f"{ARCH_NAMES[a]}: `{commands.get(a, {}).get('command', command)}` "
                        f"({commands.get(a, {}).get('seconds', results.get('seconds', '?'))} s)" for a in archs)
    section = "\n".join([
        BEGIN, "", f"Written by {written} (on 2 CPU cores, shared); the rows are in "
        "`docs/assets/faithfulness/images.json`. Held-out images only (a seed, or a split, no model saw).", "",
        _tables(results), "", *figures,
        "![positive perturbation curves](assets/faithfulness/images_curves.png)", "", END])
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    write_atomically(doc, head + section + tail)
