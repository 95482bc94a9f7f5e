"""Image files in, pixel tensors out: the evaluation transform of the official Vim models (DeiT / timm's).

``preprocess(path)``: RGB, shorter side resized to ``int(size / crop_pct)`` (bicubic), centre crop ``size`` (as
torchvision's Resize and CenterCrop compute them), scaled to [0, 1], normalised with ImageNet's mean and std ->
(1, 3, size, size) float32. ``to_display`` undoes the
normalisation for ``captum.attr.visualization.visualize_image_attr`` (an (H, W, 3) array in [0, 1]).
"""
from __future__ import annotations

import os

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def load_image(path):
    """The image at ``path`` as an RGB ``PIL.Image`` (PNG, JPEG, anything Pillow reads).

    Raises:
        FileNotFoundError; ValueError when the file is not an image.
    """
    from PIL import Image, UnidentifiedImageError

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mamba_captum: no image file at {path!r}.")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"mamba_captum: {path!r} is not an image Pillow can read ({error}).") from None


def preprocess(image, size=224, crop_pct: float = 0.875, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """An image (a path or a PIL image) -> normalised pixels (1, 3, H, W), float32.

    As torchvision's ``Resize(int(size / crop_pct), BICUBIC)`` then ``CenterCrop(size)`` (the official evaluation
    transform): the shorter side to ``int(size / crop_pct)``, the longer one truncated in proportion, the centre
    crop's offsets rounded. ``crop_pct=1`` resizes the whole image to ``size`` × ``size``; a ``(height, width)``
    size (a model trained on non-square images) resizes to it without cropping.
    """
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = load_image(image)
    image = image.convert("RGB")
    height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if height != width or crop_pct >= 1:
        image = image.resize((width, height), Image.BICUBIC)
    else:
        scale = int(height / crop_pct)
        w, h = image.size
        new = (scale, int(scale * h / w)) if w <= h else (int(scale * w / h), scale)
        image = image.resize(new, Image.BICUBIC)
        top, left = int(round((new[1] - height) / 2.0)), int(round((new[0] - width) / 2.0))
        image = image.crop((left, top, left + width, top + height))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    pixels = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return pixels[None].contiguous()


def to_display(pixels: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> np.ndarray:
    """Normalised pixels (3, H, W) or (1, 3, H, W) -> an (H, W, 3) array in [0, 1] (for plotting)."""
    if pixels.dim() == 4:
        pixels = pixels[0]
    image = pixels.detach().float().cpu() * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    return image.clamp(0, 1).permute(1, 2, 0).numpy()
