"""Image tasks for the faithfulness suite: a planted-ground-truth task generated from a seed, and a real image set.

- ``shapes``: 32×32 noisy images with one red object (a filled square, a plus, a ring or a diagonal cross, 8×8
  pixels) among two to three blue or green distractor objects of random shapes. The class is the red object's
  shape; its pixels are the ground-truth mask (known by construction). A classifier must find the red object and
  read its shape: the distractors carry the same shapes in other colours, so relevance on them is wrong.
- ``digits``: scikit-learn's handwritten digits (1,797 8×8 grey images, 10 classes; shipped with scikit-learn),
  upscaled to 32×32 and given three channels. No masks: perturbation tests only.

Pixels are normalised (background noise around 0); "removing" a pixel in the perturbation tests sets it to 0, the
mean of the normalised data (as Chefer et al.'s perturbation code zeroes normalised pixels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IMAGE_SIZE = 32
SHAPE_NAMES = ("square", "plus", "ring", "cross")
OBJECT_SIZE = 8
# Colours in normalised units: the target is red, the distractors blue or green.
RED = (1.8, -0.9, -0.9)
DISTRACTOR_COLOURS = ((-0.9, -0.9, 1.8), (-0.9, 1.8, -0.9))
NOISE = 0.35


@dataclass
class ImageTask:
    """Images (N, 3, H, W) float32, labels (N,) long, masks (N, H, W) bool (None without ground truth)."""

    name: str
    images: torch.Tensor
    labels: torch.Tensor
    class_names: tuple
    masks: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def subset(self, index) -> "ImageTask":
        return ImageTask(self.name, self.images[index], self.labels[index], self.class_names,
                         None if self.masks is None else self.masks[index])


def shape_stamp(shape: int, size: int = OBJECT_SIZE) -> torch.Tensor:
    """(size, size) bool pixels of one of the four shapes."""
    index = torch.arange(size)
    rows, cols = index[:, None], index[None, :]
    middle = (size - 1) / 2
    if shape == 0:  # filled square
        return torch.ones(size, size, dtype=torch.bool)
    if shape == 1:  # plus: a 2-pixel-wide bar across each way
        return ((rows - middle).abs() <= 1) | ((cols - middle).abs() <= 1)
    if shape == 2:  # ring: the square's border, 2 pixels wide
        return (rows < 2) | (rows >= size - 2) | (cols < 2) | (cols >= size - 2)
    if shape == 3:  # diagonal cross
        return ((rows - cols).abs() <= 1) | ((rows + cols - (size - 1)).abs() <= 1)
    raise ValueError(f"mamba_captum: shape {shape} is not one of {SHAPE_NAMES}.")


def _free_spot(occupied: torch.Tensor, generator, size: int, margin: int = 1):
    """A top-left corner where an object (plus a margin) overlaps no other object."""
    limit = occupied.shape[0] - size
    for _ in range(200):
        top, left = (int(v) for v in torch.randint(0, limit + 1, (2,), generator=generator))
        box = occupied[max(0, top - margin):top + size + margin, max(0, left - margin):left + size + margin]
        if not bool(box.any()):
            return top, left
    raise RuntimeError("mamba_captum: no free spot for an object (too many objects for the image).")


def make_shapes(count: int, seed: int, size: int = IMAGE_SIZE) -> ImageTask:
    """The planted ``shapes`` task (see the module docstring): ``count`` images from ``seed``, balanced classes."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % len(SHAPE_NAMES)
    labels = labels[torch.randperm(count, generator=generator)]
    images = torch.randn(count, 3, size, size, generator=generator) * NOISE
    masks = torch.zeros(count, size, size, dtype=torch.bool)
    for n in range(count):
        occupied = torch.zeros(size, size, dtype=torch.bool)
        distractors = int(torch.randint(2, 4, (1,), generator=generator))
        objects = [(int(labels[n]), RED, True)] + [
            (int(torch.randint(0, len(SHAPE_NAMES), (1,), generator=generator)),
             DISTRACTOR_COLOURS[int(torch.randint(0, 2, (1,), generator=generator))], False)
            for _ in range(distractors)]
        for shape, colour, is_target in objects:
            top, left = _free_spot(occupied, generator, OBJECT_SIZE)
            stamp = shape_stamp(shape)
            region = (slice(top, top + OBJECT_SIZE), slice(left, left + OBJECT_SIZE))
            occupied[region] = True
            for channel, value in enumerate(colour):
                patch = images[n, channel][region]
                patch[stamp] = value + 0.2 * torch.randn(int(stamp.sum()), generator=generator)
            if is_target:
                masks[n][region] = stamp
    return ImageTask("shapes", images, labels, SHAPE_NAMES, masks)


def load_digits(size: int = IMAGE_SIZE, test_fraction: float = 0.25, seed: int = 0) -> tuple[ImageTask, ImageTask]:
    """scikit-learn's digits as (train, test) ``ImageTask``s: 8×8 grey levels 0..16 -> [0, 1], bilinearly upscaled
    to ``size``, three equal channels, normalised to mean 0 / std 1 per channel over the whole set; a seeded split.

    Raises:
        ImportError: naming the extra that installs scikit-learn.
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise ImportError("mamba_captum: the digits set ships with scikit-learn: pip install -e '.[evaluation]'.") \
            from error
    data = sklearn_digits()
    pixels = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0  # (N, 1, 8, 8)
    pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    pixels = (pixels - pixels.mean()) / pixels.std()
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(seed))
    split = int(round(labels.shape[0] * (1 - test_fraction)))
    names = tuple(str(d) for d in range(10))
    task = ImageTask("digits", pixels.contiguous(), labels, names)
    return task.subset(order[:split]), task.subset(order[split:])
