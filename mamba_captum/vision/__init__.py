"""The vision SSMs in plain PyTorch: Vision Mamba (Vim), VMamba, MambaVision, and timm's EfficientViM and MambaOut;
their checkpoints, images, and the layouts the library explains them through.

Each architecture has constructors of its released variants (``vim_tiny``, ``vmamba_tiny``, ``mambavision_tiny``,
``efficientvim_m2``, ``mambaout_femto`` ...) with the official module and parameter names, and a loader
(``load_vim``, ``load_vmamba``, ``load_mambavision``, ``load_efficientvim``, ``load_mambaout``; or
``load_image_model``, which tells the architecture from the checkpoint's keys) that detects the variant from the
tensors' shapes; a ``training.json`` beside a file gives the image size and class names. ``from_timm(model)`` gives
the library's copy of a timm EfficientViM or MambaOut, checked to compute the same logits. ``preprocess(path,
model=model)`` prepares an image. The library's entry points take these models as they take a transformers model:
``mc.implicit_attention(model, pixels)`` gives the maps over each block's tokens (Vim: one sequence, CLS included;
the multi-stage models: each stage's grid, :class:`StagedLayout`), and the Captum classes take pixels (B, 3, H, W)
and return pixel attributions (B, 1, H, W). See docs/vision.md; vision towers over packed patches (LFM3-VL's) are
described by :class:`PackedPatches`.
"""
from ..layout import PackedPatches, Stage, StagedLayout, TokenLayout, packed_tower, vision_layout
from .checkpoints import (VARIANTS, detect_config, load_vim, read_checkpoint, read_training_record, vim_base, vim_small,
                          vim_tiny)
from .checkpoints_mambavision import (load_mambavision, mambavision_base, mambavision_large, mambavision_large2,
                                      mambavision_large3, mambavision_small, mambavision_tiny, mambavision_tiny2)
from .checkpoints_vmamba import load_vmamba, vmamba_base, vmamba_small, vmamba_tiny
from .images import IMAGENET_MEAN, IMAGENET_STD, ImageError, ImageNotice, load_image, preprocess, to_display
from .modeling_efficientvim import (EfficientViM, efficientvim_m1, efficientvim_m2, efficientvim_m3, efficientvim_m4,
                                    load_efficientvim)
from .modeling_mambaout import MambaOut, load_mambaout, mambaout_base, mambaout_femto, mambaout_small, mambaout_tiny
from .modeling_mambavision import MambaVision, MambaVisionAttention, MambaVisionMixer
from .modeling_vim import RMSNorm, VimMixer, VisionMamba
from .modeling_vmamba import SS2D, VSSM
from .zoo import detect_architecture, from_timm, load_image_model

__all__ = ["EfficientViM", "IMAGENET_MEAN", "IMAGENET_STD", "ImageError", "ImageNotice", "MambaOut", "MambaVision",
           "MambaVisionAttention", "MambaVisionMixer", "PackedPatches", "RMSNorm", "SS2D", "Stage", "StagedLayout",
           "TokenLayout", "VARIANTS", "VSSM", "VimMixer", "VisionMamba", "detect_architecture", "detect_config",
           "efficientvim_m1", "efficientvim_m2", "efficientvim_m3", "efficientvim_m4", "from_timm",
           "load_efficientvim", "load_image", "load_image_model", "load_mambaout", "load_mambavision", "load_vim",
           "load_vmamba", "mambaout_base", "mambaout_femto", "mambaout_small", "mambaout_tiny", "mambavision_base",
           "mambavision_large", "mambavision_large2", "mambavision_large3", "mambavision_small", "mambavision_tiny",
           "mambavision_tiny2", "packed_tower", "preprocess", "read_checkpoint", "read_training_record",
           "to_display", "vim_base", "vim_small", "vim_tiny", "vision_layout", "vmamba_base", "vmamba_small",
           "vmamba_tiny"]
