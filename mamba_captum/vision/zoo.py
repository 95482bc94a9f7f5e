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
