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


@dataclass(frozen=True)
class Stage:
    """One resolution of a multi-stage image model (VMamba, EfficientViM, MambaOut, MambaVision).

    Attributes:
        grid: (rows, columns) of the stage's tokens (row-major: token ``r · columns + c``).
        blocks: how many consecutive entries of the model's ``stage_blocks()`` run at this resolution.
        downsample: (kernel, stride, padding) of the layer that made this stage's tokens from the previous
            stage's (a strided conv; patch merging is kernel = stride = 2, padding 0). None for the first stage,
            whose tokens the stem makes from the pixels.
    """

    grid: tuple[int, int]
    blocks: int
    downsample: tuple[int, int, int] | None = None

    @property
    def length(self) -> int:
        return self.grid[0] * self.grid[1]


def _window_matrix(fine: tuple[int, int], coarse: tuple[int, int], kernel: int, stride: int,
                   padding: int) -> torch.Tensor:
    """(L_coarse, L_fine) float64: row i spreads 1 evenly over the fine tokens inside coarse token i's kernel window
    (zero padding excluded)."""
    def axis(n_fine: int, n_coarse: int) -> torch.Tensor:  # (coarse, fine) 0/1: is fine j in coarse i's window
        start = torch.arange(n_coarse)[:, None] * stride - padding
        j = torch.arange(n_fine)[None, :]
        return ((j >= start) & (j < start + kernel)).double()

    rows, cols = axis(fine[0], coarse[0]), axis(fine[1], coarse[1])
    window = torch.einsum("ar,bc->abrc", rows, cols).reshape(coarse[0] * coarse[1], fine[0] * fine[1])
    return window / window.sum(-1, keepdim=True)


@dataclass(frozen=True)
class StagedLayout:
    """The tokens of a multi-stage image model: a grid per stage, each made from the previous one by a strided conv
    (patch merging), and a head that reads the mean of the last stage's tokens. No CLS token.

    The maps of a block are over its stage's tokens. The explanations cross a downsampling layer by its window: a
    token of the coarser stage reads the finer tokens inside its kernel window, each with the same weight (the
    layer's receptive field, row-normalised: :meth:`transition`); relevance on a coarse token is spread so over its
    window, and the pixel attributions are laid over the first stage's grid.

    Attributes:
        img_size: (height, width) of the model's images. stages: the :class:`Stage` s in order.
        stream: how the blocks hold their residual stream: ``"channels_first"`` (B, C, H, W), ``"channels_last"``
            (B, H, W, C), ``"tokens"`` (B, L, C), or None (told from the shape, which fails where the width equals
            a side of the grid).
    """

    img_size: tuple[int, int]
    stages: tuple[Stage, ...]
    stream: str | None = None

    cls_index = None  # the head pools: no CLS token
    pooled = True

    def __post_init__(self):
        if self.stream not in (None, "channels_first", "channels_last", "tokens"):
            raise ValueError(f"mamba_captum: stream={self.stream!r}; choose channels_first, channels_last or tokens.")
        if not self.stages or self.stages[0].downsample is not None \
                or any(stage.downsample is None for stage in self.stages[1:]):
            raise ValueError("mamba_captum: a StagedLayout's first stage comes from the stem (downsample None) and "
                             "every later stage from a downsampling layer.")
        for before, after in zip(self.stages, self.stages[1:]):
            kernel, stride, padding = after.downsample
            expected = tuple((n + 2 * padding - kernel) // stride + 1 for n in before.grid)
            if expected != tuple(after.grid):
                raise ValueError(f"mamba_captum: a {kernel}×{kernel} stride-{stride} downsample with padding "
                                 f"{padding} makes a {before.grid} grid {expected}, not {after.grid}.")

    @property
    def grid(self) -> tuple[int, int]:
        """The first stage's grid (the finest): the pixel attributions are laid over it."""
        return self.stages[0].grid

    @property
    def stride(self) -> int:
        """Pixels per first-stage token along the rows (the stem's stride)."""
        return self.img_size[0] // self.grid[0]

    @property
    def patch_size(self) -> tuple[int, int]:
        return (self.img_size[0] // self.grid[0], self.img_size[1] // self.grid[1])

    @property
    def length(self) -> int:
        """L of the first stage, the tokens the relevance ends on."""
        return self.stages[0].length

    @property
    def num_blocks(self) -> int:
        return sum(stage.blocks for stage in self.stages)

    def stage_of_block(self, block: int) -> int:
        """The stage of entry ``block`` of ``stage_blocks()``."""
        end = 0
        for index, stage in enumerate(self.stages):
            end += stage.blocks
            if block < end:
                return index
        raise IndexError(f"mamba_captum: block {block} of {self.num_blocks}.")

    def stage_of_length(self, length: int) -> int:
        """The stage whose grid holds ``length`` tokens (the stages' lengths differ: every downsample shrinks)."""
        for index, stage in enumerate(self.stages):
            if stage.length == length:
                return index
        raise ValueError(f"mamba_captum: no stage of this model has {length} tokens "
                         f"({[stage.length for stage in self.stages]}).")

    def transition(self, stage: int, dtype=torch.float64, device=None) -> torch.Tensor:
        """(L_stage, L_{stage−1}): how stage ``stage``'s tokens read the previous stage's (its downsample's window,
        each row summing to 1)."""
        if stage <= 0:
            raise ValueError("mamba_captum: the first stage has no transition (the stem reads pixels).")
        kernel, stride, padding = self.stages[stage].downsample
        window = _window_matrix(self.stages[stage - 1].grid, self.stages[stage].grid, kernel, stride, padding)
        return window.to(dtype=dtype, device=device)

    def carry(self, rows: torch.Tensor, to_stage: int = 0) -> torch.Tensor:
        """Rows over one stage's tokens (..., L_s) -> rows over stage ``to_stage`` ≤ s (..., L_to): each coarse
        token's value spread evenly over its window, stage by stage (the total is kept)."""
        stage = self.stage_of_length(rows.shape[-1])
        if to_stage > stage:
            raise ValueError(f"mamba_captum: cannot carry rows of stage {stage} up to stage {to_stage}.")
        for current in range(stage, to_stage, -1):
            rows = rows @ self.transition(current, rows.dtype, rows.device)
        return rows

    def as_tokens(self, tensor: torch.Tensor, stage: int) -> torch.Tensor:
        """A block's tensor over stage ``stage``'s grid as tokens: (B, C, H, W) channel-first, (B, H, W, C)
        channel-last or (B, L, C) -> (B, L, C), tokens row-major.

        Raises:
            ValueError: the tensor is not over the stage's grid (or its shape fits both orders)."""
        rows, cols = self.stages[stage].grid
        shape = tuple(tensor.shape)
        if tensor.dim() == 3 and shape[1] == rows * cols and self.stream in (None, "tokens"):
            return tensor
        if tensor.dim() == 4:
            last, first = shape[1:3] == (rows, cols), shape[2:] == (rows, cols)
            if self.stream == "channels_last" or self.stream == "channels_first":
                last, first = last and self.stream == "channels_last", first and self.stream == "channels_first"
            if last != first:
                return tensor.reshape(shape[0], rows * cols, shape[3]) if last else tensor.flatten(2).transpose(1, 2)
        raise ValueError(f"mamba_captum: a block of stage {stage} ({rows}×{cols} tokens) holds a tensor of shape "
                         f"{shape}, which is not (B, C, {rows}, {cols}), (B, {rows}, {cols}, C) or "
                         f"(B, {rows * cols}, C) (or fits two of them).")

    def query_weights(self, batch: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """(B, L_last): the head's read-out, the mean of the last stage's tokens."""
        length = self.stages[-1].length
        return torch.full((batch, length), 1.0 / length, dtype=dtype, device=device)

    def patch_grid(self, relevance: torch.Tensor) -> torch.Tensor:
        """(B, L_0) first-stage relevance -> (B, rows, columns)."""
        return relevance.reshape(relevance.shape[0], *self.grid)

    def to_pixels(self, relevance: torch.Tensor) -> torch.Tensor:
        """(B, L_s) relevance over any stage's tokens -> (B, 1, H, W): carried to the first stage, then each token's
        value at its centre, interpolated bilinearly (as :meth:`TokenLayout.to_pixels`)."""
        first = self.carry(relevance, 0)
        flat = TokenLayout(self.grid, None, tuple(self.img_size), self.patch_size, self.stride)
        return flat.to_pixels(first)

    def stage_to_pixels(self, relevance: torch.Tensor) -> torch.Tensor:
        """(B, L_s) -> (B, 1, H, W) at the stage's own resolution: its grid interpolated from its token centres
        (a map of one stage, not carried through the windows)."""
        stage = self.stages[self.stage_of_length(relevance.shape[-1])]
        size = (self.img_size[0] // stage.grid[0], self.img_size[1] // stage.grid[1])
        flat = TokenLayout(tuple(stage.grid), None, tuple(self.img_size), size, size[0])
        return flat.to_pixels(relevance)


def check_image_size(pixel_values: torch.Tensor, img_size: tuple[int, int], fix: str) -> None:
    """A model built for ``img_size`` (height, width) images refuses pixels of another size (its token layout would
    not describe the grids the forward runs on).

    Raises:
        ValueError: naming both sizes and ``fix`` (how to resize, or to rebuild the model)."""
    height, width = pixel_values.shape[-2:]
    if (height, width) != tuple(img_size):
        raise ValueError(f"mamba_captum: the image is {height}×{width}; this model takes {img_size[0]}×{img_size[1]} "
                         f"({fix}).")


def vision_layout(model: nn.Module) -> TokenLayout | StagedLayout | None:
    """The model's :class:`TokenLayout` (or :class:`StagedLayout`, a multi-stage model) if it is an image model (it
    has ``token_layout()``), else None."""
    layout = getattr(model, "token_layout", None)
    return layout() if callable(layout) else None


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def refuse_attention_mask(attention_mask) -> None:
    """An image has no padding tokens: an attention mask is refused (it would be ignored by the model)."""
    if attention_mask is not None:
        raise ValueError("mamba_captum: an image has no padding: pass no attention_mask to an image model.")


def check_pixels_match_model(pixel_values: torch.Tensor, model) -> None:
    """Refuse pixel values on another device or in another dtype than the model's (images and packed patches alike).

    Raises:
        ValueError: another device. TypeError: another dtype. Both name the fix.
    """
    from .checks import input_device

    device = input_device(model)
    if pixel_values.device != device:
        raise ValueError(f"mamba_captum: the pixel values are on {pixel_values.device}, the model on {device}; move "
                         f"them with pixel_values.to({str(device)!r}).")
    dtype = model_dtype(model)
    if pixel_values.dtype != dtype:
        raise TypeError(f"mamba_captum: the pixel values are {pixel_values.dtype}, the model {dtype}; pass "
                        f"pixel_values.to({dtype}).")


def check_pixels(model: nn.Module, pixel_values, layout: TokenLayout, attention_mask=None) -> int:
    """Pixels (B, C, H, W) of the model's size, dtype and device, B ≥ 1, and no attention mask. Returns B.

    Raises:
        TypeError / ValueError naming the problem and the fix.
    """
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
    check_pixels_match_model(pixel_values, model)
    return batch


# ---------------------------------------------------------------------------------------------------------------
# Packed patch sequences: vision towers that take pixel_values (N, P) and grid_thw (n, 3) (LFM3-VL)


@dataclass(frozen=True)
class PackedPatches:
    """The token sequence of a vision tower that takes packed patches, ``pixel_values`` (N, P) and ``grid_thw``
    (n_items, 3) (LFM3-VL's ``Lfm3VlVisionModel``): the items (images or videos) one after another, each item's
    frames one after another, each frame's ``height × width`` patches in **merge-block order**: the
    ``merge × merge`` blocks of the grid row-major, and inside a block its patches row-major. Patch ``(row, col)``
    of frame ``f`` of an item is token ``start + f·h·w + ((row // m)·(w // m) + col // m)·m² + (row % m)·m + col % m``
    (m = ``merge``, the tower's ``spatial_merge_size``), the order transformers' ``get_vision_position_ids`` and the
    processor give.

    Attributes:
        grid_thw: per item (frames, height, width) in patches.  merge: the spatial merge size m.
    """

    grid_thw: tuple[tuple[int, int, int], ...]
    merge: int

    @classmethod
    def from_grid(cls, grid_thw, merge: int) -> "PackedPatches":
        rows = grid_thw.tolist() if torch.is_tensor(grid_thw) else [list(r) for r in grid_thw]
        return cls(tuple(tuple(int(v) for v in row) for row in rows), int(merge))

    @property
    def item_lengths(self) -> list[int]:
        return [t * h * w for t, h, w in self.grid_thw]

    @property
    def length(self) -> int:
        """N: the packed sequence's tokens."""
        return sum(self.item_lengths)

    def item_slices(self) -> list[slice]:
        """Each item's tokens in the packed sequence."""
        out, start = [], 0
        for n in self.item_lengths:
            out.append(slice(start, start + n))
            start += n
        return out

    def raster_tokens(self, item: int) -> torch.Tensor:
        """(T, H, W) long: the packed index of each patch of item ``item``, frames and grid in raster order."""
        t, h, w = self.grid_thw[item]
        m = self.merge
        start = self.item_slices()[item].start
        row = torch.arange(h)[:, None]
        col = torch.arange(w)[None, :]
        within = ((row // m) * (w // m) + col // m) * m * m + (row % m) * m + col % m  # (H, W)
        return start + torch.arange(t)[:, None, None] * (h * w) + within[None]

    def frames(self) -> torch.Tensor:
        """(N,) long: the frame each token belongs to, numbered over the whole packed sequence (the attention
        segments of ``cu_seqlens``; the conv does not cross them either)."""
        sizes = [h * w for t, h, w in self.grid_thw for _ in range(t)]
        return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.long))

    def neighbours(self, kernel, device=None) -> torch.Tensor:
        """(kh·kw, N) long: for each tap (a, b) of a ``kernel = (kh, kw)`` 2-D conv with 'same' zero padding
        (``padding = k // 2``, stride and dilation 1), row-major over (a, b) like ``Conv2d.weight[c, 0]``, the
        packed index of the patch that the tap reads for each output token: ``(row + a − kh//2, col + b − kw//2)``
        of the same frame, or −1 outside the frame (never another frame or item)."""
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else tuple(kernel)
        out = torch.full((kh * kw, self.length), -1, dtype=torch.long)
        for item in range(len(self.grid_thw)):
            grid = self.raster_tokens(item)  # (T, H, W)
            _, h, w = grid.shape
            padded = torch.nn.functional.pad(grid, (kw // 2, kw // 2, kh // 2, kh // 2), value=-1)
            for a in range(kh):
                for b in range(kw):
                    out[a * kw + b, grid.flatten()] = padded[:, a:a + h, b:b + w].flatten()
        return out.to(device)

    def query_weights(self, dtype=torch.float32, device=None) -> torch.Tensor:
        """(1, N): a pooled query that reads the mean of each item's tokens (1 / n_item on them), so that each
        item's relevance is what the item alone would get."""
        weights = torch.zeros(1, self.length, dtype=dtype, device=device)
        for part in self.item_slices():
            weights[:, part] = 1.0 / (part.stop - part.start)
        return weights

    def to_grids(self, relevance: torch.Tensor) -> list[torch.Tensor]:
        """Per-token values (N,) or (1, N) -> per item a (T, H, W) tensor, frames and patch grid in raster order
        (for the Captum classes' (N, P) attributions pass ``attributions[:, 0]``)."""
        values = relevance.reshape(-1)
        if values.numel() != self.length:
            raise ValueError(f"mamba_captum: {values.numel()} values for {self.length} packed patches.")
        return [values[self.raster_tokens(item).to(values.device)] for item in range(len(self.grid_thw))]


def packed_tower(model: nn.Module) -> bool:
    """Whether the model is a vision tower over packed patches: its forward takes ``pixel_values`` and ``grid_thw``
    and it has a ``spatial_merge_size`` (LFM3-VL's ``Lfm3VlVisionModel``)."""
    import inspect

    from .checks import underlying_forward

    if getattr(model, "spatial_merge_size", None) is None:
        return False
    try:
        parameters = inspect.signature(underlying_forward(model)).parameters
    except (TypeError, ValueError):
        return False
    return "pixel_values" in parameters and "grid_thw" in parameters


def check_packed(model: nn.Module, pixel_values, grid_thw, attention_mask=None) -> PackedPatches:
    """Packed patches (N, P) of the model's patch width, dtype and device, and a ``grid_thw`` (n, 3) of positive
    integers whose frames hold N patches and whose heights and widths the merge size divides; no attention mask.

    Raises:
        TypeError / ValueError naming the problem and the fix.
    """
    if attention_mask is not None:
        raise ValueError("mamba_captum: a packed vision tower takes no attention_mask: its items are separated by "
                         "grid_thw.")
    if grid_thw is None:
        raise ValueError("mamba_captum: this vision tower takes packed patches: pass grid_thw= (n_items, 3), the "
                         "(frames, height, width) of each item's patch grid, with pixel_values (N, P).")
    if not torch.is_tensor(pixel_values) or not pixel_values.is_floating_point():
        raise TypeError("mamba_captum: the vision tower takes pixel_values, a floating-point tensor (N, P) of packed "
                        "patches (what the model's image processor returns); got "
                        f"{type(pixel_values).__name__ if not torch.is_tensor(pixel_values) else pixel_values.dtype}.")
    if pixel_values.dim() != 2:
        raise ValueError(f"mamba_captum: packed pixel_values must be (N, P), one row per patch; got shape "
                         f"{tuple(pixel_values.shape)}.")
    if not torch.is_tensor(grid_thw):  # transformers reads grid_thw.device and grid_thw.tolist()
        raise TypeError(f"mamba_captum: grid_thw must be a tensor (n_items, 3), as the processor returns it; got "
                        f"{type(grid_thw).__name__}: pass torch.tensor(grid_thw).")
    grid = grid_thw
    if grid.dtype.is_floating_point or grid.dtype == torch.bool or grid.dim() != 2 or grid.shape[-1] != 3 \
            or grid.shape[0] == 0 or bool((grid <= 0).any()):
        raise ValueError(f"mamba_captum: grid_thw must be (n_items, 3) positive integers (frames, height, width); "
                         f"got {grid.tolist() if grid.numel() <= 12 else tuple(grid.shape)}.")
    merge = int(model.spatial_merge_size)
    if bool(((grid[:, 1:] % merge) != 0).any()):
        raise ValueError(f"mamba_captum: grid_thw={grid.tolist()}: heights and widths must be multiples of the "
                         f"tower's spatial_merge_size {merge}.")
    layout = PackedPatches.from_grid(grid, merge)
    if pixel_values.shape[0] != layout.length:
        raise ValueError(f"mamba_captum: grid_thw={grid.tolist()} holds {layout.length} patches, pixel_values "
                         f"{pixel_values.shape[0]}.")
    width = getattr(getattr(model, "patch_embed", None), "in_features", None)
    if width is not None and pixel_values.shape[1] != width:
        raise ValueError(f"mamba_captum: the patches have {pixel_values.shape[1]} values, the tower's patch embedding "
                         f"takes {width}.")
    check_pixels_match_model(pixel_values, model)
    return layout
