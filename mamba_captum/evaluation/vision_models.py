"""Tiny vision SSM classifiers trained here, on CPU, for the image faithfulness suite.

``python -m mamba_captum.evaluation.vision --train shapes digits [--arch vim vmamba mambaout efficientvim
mambavision]`` trains them from fixed seeds; the weights ship as official-format checkpoints (``{"model":
state_dict}`` in ``weights/vim-<task>/vim.pth`` and ``weights/<arch>-<task>/model.pth``, loaded with
:func:`mamba_captum.vision.load_image_model`) with a ``training.json`` record (image size, class names, steps,
seconds, held-out accuracy) that the loaders read.

The models (:data:`TINY_CONFIGS`), each built by its released constructor with size overrides, so the blocks, stem
and downsampling are the released ones:

- Vim: bimamba v2 mixers, CLS token in the middle, RMSNorm; 32×32 images, 4-pixel patches (an 8×8 grid, L = 65
  tokens), 4 blocks of width 48, state size 8.
- VMamba (``vmamba_tiny``'s v05_noz SS2D, v2 stem, v3 downsampling): dims 16/32/48/64, depths 1/1/2/1; grids
  8×8, 4×4, 2×2, 1×1.
- MambaOut (``mambaout_femto``'s gated conv blocks, stride-4 stem): dims 16/32/48/64, depths 1/1/2/1; the same grids.
- MambaVision (``mambavision_tiny``'s conv levels then windowed Mamba / attention levels): dim 8 (doubled per
  level), MLP ratio 2, depths 1/1/2/2, windows 8/8/2/1 (one window per level grid); the same grids.
- EfficientViM (``efficientvim_m1``'s HSM-SSD blocks): embed 24/32/48, depths 1/1/1, states 16/8/4. Its stem has
  stride 16, a 2×2 grid at 32 px, so it is trained and explained on the 32×32 images bilinearly upsampled to
  128×128 (:class:`Upsampled`: grids 8×8, 4×4, 2×2, each first-stage token over 4×4 of the task's pixels, as the
  other models' are); its pixel maps are averaged back to 32×32 (:func:`task_pixels`) before they are scored.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..vision import (efficientvim_m1, load_image_model, load_vim, mambaout_femto, mambavision_tiny,
                      read_training_record, vim_tiny, vmamba_tiny)
from .images import IMAGE_SIZE, ImageTask, load_digits, make_shapes
from .models import one_thread, weights_root

VISION_TASKS = ("shapes", "digits")
TINY_VIM = dict(img_size=IMAGE_SIZE, patch_size=4, depth=4, embed_dim=48, d_state=8)
SHAPES_VALIDATION_SEED, SHAPES_TEST_SEED = 20_000, 30_000  # training batches use seeds 0, 1, 2, ...
# Validation accuracy at which training stops: digits' 200 validation images sit at 98.5 % (3 errors) from step 500
# to 900 and beyond, so 99 % would only spend the step budget.
TARGET_ACCURACY = {"shapes": 0.99, "digits": 0.98}
ARCHITECTURES = ("vim", "vmamba", "mambaout", "efficientvim", "mambavision")
# the released constructor of each architecture and the overrides that make it tiny (see the module docstring)
TINY_CONFIGS = {
    "vim": (vim_tiny, TINY_VIM),
    "vmamba": (vmamba_tiny, dict(img_size=IMAGE_SIZE, dims=[16, 32, 48, 64], depths=[1, 1, 2, 1])),
    "mambaout": (mambaout_femto, dict(img_size=IMAGE_SIZE, dims=(16, 32, 48, 64), depths=(1, 1, 2, 1))),
    "efficientvim": (efficientvim_m1, dict(img_size=128, embed_dim=(24, 32, 48), depths=(1, 1, 1),
                                           state_dim=(16, 8, 4))),
    "mambavision": (mambavision_tiny, dict(img_size=IMAGE_SIZE, dim=8, in_dim=16, depths=(1, 1, 2, 2),
                                           num_heads=(1, 2, 4, 8), window_size=(8, 8, 2, 1), mlp_ratio=2.0)),
}


class Upsampled(nn.Module):
    """``model`` on the task's images bilinearly resized to ``model.img_size``: what the Captum baselines and the
    perturbation tests run (their pixels are the task's 32×32), and how EfficientViM is trained."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(F.interpolate(pixel_values, size=tuple(self.model.img_size), mode="bilinear",
                                        align_corners=False))


def input_size(model) -> tuple[int, int]:
    """The (height, width) ``model`` takes."""
    size = model.token_layout().img_size
    return (size, size) if isinstance(size, int) else tuple(size)


def on_task_pixels(model):
    """``model`` as a function of the task's 32×32 pixels: itself, or :class:`Upsampled` when it takes larger ones."""
    return model if input_size(model) == (IMAGE_SIZE, IMAGE_SIZE) else Upsampled(model).eval()


def model_pixels(model, images: torch.Tensor) -> torch.Tensor:
    """The task's images (B, 3, 32, 32) as ``model`` takes them (bilinearly resized, as :class:`Upsampled`)."""
    size = input_size(model)
    if tuple(images.shape[-2:]) == size:
        return images
    return F.interpolate(images, size=size, mode="bilinear", align_corners=False)


def task_pixels(maps: torch.Tensor, size: int = IMAGE_SIZE) -> torch.Tensor:
    """Pixel maps (B, h, w) at a model's input size averaged back to the task's (B, size, size) (each task pixel:
    the mean of the model pixels it was upsampled to)."""
    if tuple(maps.shape[-2:]) == (size, size):
        return maps
    return F.adaptive_avg_pool2d(maps[:, None], size)[:, 0]


def new_model(num_classes: int, seed: int = 0, arch: str = "vim"):
    """A freshly initialised tiny ``arch`` (:data:`TINY_CONFIGS`) from ``seed``."""
    constructor, config = TINY_CONFIGS[arch]
    torch.manual_seed(seed)
    return constructor(**config, num_classes=num_classes)


def new_vim(num_classes: int, seed: int = 0):
    return new_model(num_classes, seed, "vim")


def vision_accuracy(model, task: ImageTask, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` on the task's images (a model taking larger images gets them resized)."""
    model = on_task_pixels(model)
    hits = 0
    with torch.no_grad():
        for start in range(0, len(task), batch_size):
            logits = model(task.images[start:start + batch_size])
            hits += int((logits.argmax(-1) == task.labels[start:start + batch_size]).sum())
    return hits / len(task)


def held_out(task_name: str, examples: int = 512) -> ImageTask:
    """The test set: ``shapes`` from a seed no training batch used; ``digits``' held-out split."""
    if task_name == "shapes":
        return make_shapes(examples, SHAPES_TEST_SEED)
    return load_digits()[1]


def train_vim(task_name: str, seed: int = 0, max_steps: int = 3000, batch: int = 64, lr: float = 2e-3,
              target_accuracy: float | None = None, check_every: int = 100, log=print, arch: str = "vim"):
    """Train a tiny ``arch`` (default Vim; :data:`TINY_CONFIGS`) on ``task_name``; stop at ``target_accuracy``
    (default :data:`TARGET_ACCURACY`) on a validation set (shapes: fresh seeds; digits: 200 images held out of the
    training split) or after ``max_steps``.

    Returns:
        (model in eval mode, record dict).
    """
    target_accuracy = TARGET_ACCURACY.get(task_name, 0.99) if target_accuracy is None else target_accuracy
    with one_thread():
        torch.manual_seed(seed)
        if task_name == "shapes":
            validation = make_shapes(512, SHAPES_VALIDATION_SEED)
            classes = len(validation.class_names)
            sample = lambda step: make_shapes(batch, seed * 1_000_003 + step)  # noqa: E731
        elif task_name == "digits":
            train, _ = load_digits()
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
            validation, train = train.subset(order[:200]), train.subset(order[200:])
            classes = len(train.class_names)
            generator = torch.Generator().manual_seed(seed)
            sample = lambda step: train.subset(torch.randint(0, len(train), (batch,), generator=generator))  # noqa
        else:
            raise ValueError(f"mamba_captum: no image task {task_name!r}; choose from {VISION_TASKS}.")
        model = new_model(classes, seed, arch)
        trained = on_task_pixels(model)
        optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: min(1.0, (step + 1) / 100))
        start, steps, validation_accuracy = time.perf_counter(), 0, 0.0
        for steps in range(1, max_steps + 1):
            data = sample(steps)
            model.train()
            loss = F.cross_entropy(trained(data.images), data.labels)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            schedule.step()
            if steps % check_every == 0:
                model.eval()
                validation_accuracy = vision_accuracy(model, validation)
                log(f"{task_name} step {steps}: loss {loss.item():.3f}, validation {validation_accuracy:.3f}")
                if validation_accuracy >= target_accuracy:
                    break
        seconds = time.perf_counter() - start
        model.eval()
        test = held_out(task_name)
        config = dict(TINY_CONFIGS[arch][1], num_classes=classes)
        if arch != "vim":  # the model's input size (the loaders read it), the task's images' size
            config.update(img_size=list(input_size(model)), task_img_size=IMAGE_SIZE)
        record = dict(family=arch, task=task_name, seed=seed, steps=steps, train_seconds=round(seconds, 1),
                      validation_accuracy=validation_accuracy, held_out_accuracy=vision_accuracy(model, test),
                      held_out_examples=len(test), parameters=sum(p.numel() for p in model.parameters()),
                      config=config, img_size=config["img_size"],
                      crop_pct=1.0,  # trained on whole 32×32 images: preprocess must not crop a file's border
                      lr=lr, batch=batch,
                      class_names=list(validation.class_names), target_accuracy=target_accuracy)
    return model, record


def vim_folder(task_name: str, root: Path | None = None, arch: str = "vim") -> Path:
    return (root or weights_root()) / f"{arch}-{task_name}"


def checkpoint_file(task_name: str, root: Path | None = None, arch: str = "vim") -> Path:
    """Where the shipped ``arch`` model of ``task_name`` is: ``vim-<task>/vim.pth``, ``<arch>-<task>/model.pth``."""
    return vim_folder(task_name, root, arch) / ("vim.pth" if arch == "vim" else "model.pth")


def save_vim(model, record: dict, root: Path | None = None) -> Path:
    """The official checkpoint format: the state dict under ``"model"``, beside ``training.json``."""
    arch = record.get("family", "vim")
    folder = vim_folder(record["task"], root, arch)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               checkpoint_file(record["task"], root, arch))
    (folder / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return folder


def load_trained_vim(task_name: str, root: Path | None = None, arch: str = "vim"):
    """(model, record) of the shipped tiny ``arch`` model for ``task_name``: the loader
    (:func:`mamba_captum.vision.load_image_model`, which tells the architecture from the keys) reads the image size
    and the class names from the ``training.json`` beside the checkpoint."""
    checkpoint = checkpoint_file(task_name, root, arch)
    record = read_training_record(checkpoint)
    if record is None:
        raise FileNotFoundError(f"mamba_captum: no training.json beside {str(checkpoint)!r}; train the model with "
                                "python -m mamba_captum.evaluation.vision --train.")
    model = load_vim(checkpoint) if arch == "vim" else load_image_model(checkpoint)
    if model.class_names is None:  # a loader that does not read training.json's names
        model.class_names = list(record["class_names"])
    return model, record
