"""Where an image model's tokens are: the patch grid, the CLS token, how the head pools; pixels in, pixels out.

A vision model takes pixels (B, C, H, W) and mixes a sequence of L tokens: the patches of a grid in row-major order,
with (or without) a CLS token at some index. The maps and the explanations are over these L tokens; Captum-style
image attributions are the patch values placed at the patch centres and bilinearly interpolated to the image
(for stride = patch size this is exactly the papers' ``interpolate(scale_factor=patch, mode="bilinear")``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TokenLayout:
    """The token sequence of an image model.

    Attributes:
        grid: (rows, columns) of patches. cls_index: the CLS token's index in the sequence, or None (the head
            reads the mean over all tokens). img_size, patch_size: (height, width) pairs; stride: the patch stride.
    """

    grid: tuple[int, int]
    cls_index: int | None
    img_size: tuple[int, int]
    patch_size: tuple[int, int]
    stride: int

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def length(self) -> int:
        """L: patches plus the CLS token."""
        return self.num_patches + (self.cls_index is not None)

    @property
    def pooled(self) -> bool:
        """True when the head reads the mean over tokens (no CLS token)."""
        return self.cls_index is None

    def patch_indices(self) -> torch.Tensor:
        """(num_patches,) the sequence index of each patch, row-major."""
        index = torch.arange(self.length)
        return index if self.cls_index is None else index[index != self.cls_index]

    def query_weights(self, batch: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """(B, L): how the head reads the tokens: one-hot on the CLS token, or uniform 1 / L for mean pooling."""
        if self.cls_index is None:
            return torch.full((batch, self.length), 1.0 / self.length, dtype=dtype, device=device)
        weights = torch.zeros(batch, self.length, dtype=dtype, device=device)
        weights[:, self.cls_index] = 1
        return weights

    def patch_grid(self, relevance: torch.Tensor) -> torch.Tensor:
        """(B, L) token relevance -> (B, rows, columns) patch relevance (the CLS token dropped)."""
        patches = relevance[:, self.patch_indices().to(relevance.device)]
        return patches.reshape(relevance.shape[0], *self.grid)

    def _interpolation(self, axis: int, dtype, device) -> torch.Tensor:
        """(pixels, patches) bilinear weights along one axis, patch values placed at the patch centres."""
        pixels, patches = self.img_size[axis], self.grid[axis]
        centre = (self.patch_size[axis] - 1) / 2
        position = ((torch.arange(pixels, dtype=torch.float64) - centre) / self.stride).clamp(0, patches - 1)
        low = position.floor().long().clamp(max=patches - 1)
        high = (low + 1).clamp(max=patches - 1)
        frac = position - low
        weights = torch.zeros(pixels, patches, dtype=torch.float64)
        weights[torch.arange(pixels), low] += 1 - frac
        weights[torch.arange(pixels), high] += frac
        return weights.to(dtype=dtype, device=device)

    def to_pixels(self, relevance: torch.Tensor) -> torch.Tensor:
        """(B, L) token relevance -> (B, 1, H, W) pixel relevance: the CLS token dropped, the patch grid bilinearly
        interpolated from the patch centres (the papers' ×16 bilinear upsampling for 16-pixel patches)."""
        grid = self.patch_grid(relevance)
        rows = self._interpolation(0, grid.dtype, grid.device)
        cols = self._interpolation(1, grid.dtype, grid.device)
        return torch.einsum("hr,brc,wc->bhw", rows, grid, cols)[:, None]


def vision_layout(model: nn.Module) -> TokenLayout | None:
    """The model's :class:`TokenLayout` if it is an image model (it has ``token_layout()``), else None."""
    layout = getattr(model, "token_layout", None)
    return layout() if callable(layout) else None


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def refuse_attention_mask(attention_mask) -> None:
    """An image has no padding tokens: an attention mask is refused (it would be ignored by the model)."""
    if attention_mask is not None:
        raise ValueError("mamba_captum: an image has no padding: pass no attention_mask to an image model.")


def check_pixels(model: nn.Module, pixel_values, layout: TokenLayout, attention_mask=None) -> int:
    """Pixels (B, C, H, W) of the model's size, dtype and device, B ≥ 1, and no attention mask. Returns B.

    Raises:
        TypeError / ValueError naming the problem and the fix.
    """
    from ..checks import input_device

    refuse_attention_mask(attention_mask)
    if not torch.is_tensor(pixel_values) or not pixel_values.is_floating_point():
        raise TypeError("mamba_captum: an image model takes pixel values, a floating-point tensor (B, C, H, W); "
                        f"got {type(pixel_values).__name__ if not torch.is_tensor(pixel_values) else pixel_values.dtype}"
                        " (mamba_captum.vision.preprocess turns an image file into one).")
    channels = getattr(getattr(getattr(model, "patch_embed", None), "proj", None), "in_channels", None)
    if pixel_values.dim() != 4:
        raise ValueError(f"mamba_captum: pixel values must be (B, C, H, W); got shape {tuple(pixel_values.shape)}."
                         + (" Add a batch dimension with pixel_values[None]." if pixel_values.dim() == 3 else ""))
    batch, given_channels, height, width = pixel_values.shape
    if batch == 0:
        raise ValueError("mamba_captum: the pixel values hold no images (batch size 0).")
    if channels is not None and given_channels != channels:
        raise ValueError(f"mamba_captum: the images have {given_channels} channels; the model takes {channels}.")
    if (height, width) != tuple(layout.img_size):
        raise ValueError(f"mamba_captum: the images are {height}×{width}; the model takes "
                         f"{layout.img_size[0]}×{layout.img_size[1]} (mamba_captum.vision.preprocess resizes).")
    device = input_device(model)
    if pixel_values.device != device:
        raise ValueError(f"mamba_captum: the pixel values are on {pixel_values.device}, the model on {device}; move "
                         f"them with pixel_values.to({str(device)!r}).")
    dtype = model_dtype(model)
    if pixel_values.dtype != dtype:
        raise TypeError(f"mamba_captum: the pixel values are {pixel_values.dtype}, the model {dtype}; pass "
                        f"pixel_values.to({dtype}).")
    return batch
