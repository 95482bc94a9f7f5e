"""Which image model a checkpoint holds, and its loader: Vim, VMamba, EfficientViM, MambaOut, MambaVision.

The checkpoints of the five architectures share no module name that matters: each one's state dict has keys only it
has (:data:`SIGNATURES`), so a file is loaded by the right loader without being told what it is. An architecture
name (a released variant: ``vmamba_tiny``, ``efficientvim_m2``, ``mambaout_femto`` ...) with a weights file loads the
file and checks that it is that variant.
"""
from __future__ import annotations

import importlib
import os

from .checkpoints import read_checkpoint, state_dict_of

# architecture -> (a key only its checkpoints hold (a suffix of one of its keys), "module:loader")
SIGNATURES = {
    "vim": ("layers.0.mixer.A_b_log", "checkpoints:load_vim"),
    "vmamba": (".op.x_proj_weight", "checkpoints_vmamba:load_vmamba"),
    "efficientvim": (".mixer.BCdt_proj.conv.weight", "modeling_efficientvim:load_efficientvim"),
    "mambaout": ("stem.conv1.weight", "modeling_mambaout:load_mambaout"),
    "mambavision": ("patch_embed.conv_down.0.weight", "checkpoints_mambavision:load_mambavision"),
}


def detect_architecture(state: dict) -> str:
    """The architecture of a state dict (its keys, :data:`SIGNATURES`).

    Raises:
        ValueError: none matches, naming a few of its keys."""
    found = [name for name, (key, _) in SIGNATURES.items() if any(k.endswith(key) for k in state)]
    if len(found) != 1:
        raise ValueError(f"mamba_captum: the checkpoint is {'none' if not found else ' and '.join(found)} of the "
                         f"image models the library builds ({', '.join(SIGNATURES)}); its first keys: "
                         f"{list(state)[:4]}.")
    return found[0]


def loader(architecture: str):
    """The loader function of ``architecture`` (``load_vim``, ``load_vmamba`` ...)."""
    module, function = SIGNATURES[architecture][1].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def load_image_model(checkpoint, *, variant: str | None = None, **options):
    """Load a checkpoint of any of the library's image models: a file path (``.pth``, ``.pt``, ``.safetensors``)
    or a state dict; ``options`` go to the architecture's loader (``img_size=``, ``dtype=``, ``device=``).

    Args:
        variant: a released variant's name (``vmamba_tiny``, ``efficientvim_m2``, ``mambaout_femto``, a Vim's
            registered name ...): the weights must be that variant's (checked, not assumed).

    Raises:
        ValueError: the checkpoint is no image model of the library's, or another variant than ``variant``."""
    state = read_checkpoint(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else \
        state_dict_of(checkpoint, "the given dict")
    architecture = detect_architecture(state)
    plain = None if variant is None else variant.lower().replace("_", "").replace("vssm", "vmamba")
    if plain is not None and not plain.startswith(architecture):
        raise ValueError(f"mamba_captum: the weights are a {architecture} checkpoint, not {variant!r}'s.")
    model = loader(architecture)(checkpoint, **options)
    found = getattr(model, "variant", None)
    if plain is not None and found is not None and found.lower().replace("_", "").replace("vssm", "vmamba") != plain:
        raise ValueError(f"mamba_captum: the weights are {found}'s, not {variant}'s (their shapes say so).")
    return model


def from_timm(model, *, img_size=None, check: bool = True, tolerance: float = 1e-4):
    """The library's copy of a timm model (``timm.create_model("efficientvim_m2")``, ``"mambaout_femto"`` ...): the
    same architecture in :mod:`mamba_captum.vision`, with the timm model's weights, dtype and device, in eval mode.
    The library explains the copy (timm's modules do not say their stages: see docs/vision.md).

    Args:
        img_size: the image size to explain at (default: timm's ``pretrained_cfg["input_size"]``, else 224).
        check: run both on one random image and refuse the copy unless its logits equal timm's within
            ``tolerance`` (relative to timm's largest logit): a timm release that changed the architecture's math
            is refused, never explained as the old one.

    Raises:
        ValueError: not an architecture of the library's, or logits that differ (naming the difference)."""
    import torch

    state = {key: value.detach() for key, value in model.state_dict().items()}
    architecture = detect_architecture(state)
    if img_size is None:
        size = getattr(model, "pretrained_cfg", {}).get("input_size") if isinstance(
            getattr(model, "pretrained_cfg", None), dict) else None
        img_size = tuple(size[1:]) if size else 224
    parameter = next(model.parameters())
    copy = loader(architecture)(state, img_size=img_size).to(device=parameter.device, dtype=parameter.dtype).eval()
    if check:
        was_training = model.training
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn(1, 3, *copy.token_layout().img_size, generator=generator)
        pixels = pixels.to(device=parameter.device, dtype=parameter.dtype)
        try:
            model.eval()
            with torch.no_grad():
                theirs, ours = model(pixels), copy(pixels)
        finally:
            model.train(was_training)
        theirs = theirs[0] if isinstance(theirs, (tuple, list)) else theirs
        scale = float(theirs.abs().max().clamp(min=1e-12))
        error = float((theirs.float() - ours.float()).abs().max()) / scale
        if not error <= tolerance:
            raise ValueError(f"mamba_captum: the library's {architecture} gives other logits than this "
                             f"{type(model).__name__} (relative difference {error:.2g} > {tolerance:g}): its timm "
                             "release computes something the library does not; please report the timm version.")
    return copy
