"""Vision Mamba (Vim): the official architectures in plain PyTorch, their checkpoints, and image explanations.

``vim_tiny(**overrides)`` / ``vim_small`` / ``vim_base`` build the official architectures with the official module
and parameter names; ``load_vim(path_or_state_dict)`` loads an official checkpoint (detecting the variant; a
``training.json`` beside the file gives the image size and class names), and ``preprocess(path,
img_size=vim.img_size)`` prepares an image for it. The
library's entry points take the model as they take a transformers model: ``mc.implicit_attention(vim, pixels)``
gives (B, L, L) maps over the tokens in the model's order (CLS included), and the Captum classes take pixels
(B, 3, H, W) and return pixel attributions (B, 1, H, W). See docs/vision.md; vision towers over packed patches
(LFM3-VL's) are described by :class:`PackedPatches`.
"""
from .checkpoints import (VARIANTS, detect_config, load_vim, read_checkpoint, read_training_record, vim_base, vim_small,
                          vim_tiny)
from .images import IMAGENET_MEAN, IMAGENET_STD, ImageError, ImageNotice, load_image, preprocess, to_display
from ..layout import PackedPatches, TokenLayout, packed_tower, vision_layout
from .modeling_vim import RMSNorm, VimMixer, VisionMamba

__all__ = ["VARIANTS", "IMAGENET_MEAN", "IMAGENET_STD", "ImageError", "ImageNotice", "PackedPatches", "RMSNorm",
           "TokenLayout", "VimMixer", "VisionMamba", "detect_config", "load_image", "load_vim", "packed_tower",
           "preprocess", "read_checkpoint", "read_training_record", "to_display", "vim_base", "vim_small", "vim_tiny",
           "vision_layout"]
