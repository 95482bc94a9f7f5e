"""The released VMamba architectures and their checkpoint files.

``vmamba_tiny`` / ``vmamba_small`` / ``vmamba_base`` build the released v2 classification models (README of
MzeroMiko/VMamba: VMamba-T ``vssm1_tiny_0230s``, VMamba-S ``vssm_small_0229``, VMamba-B ``vssm_base_0229``);
:func:`load_vmamba` reads an official ``.pth`` file (the weights under ``"model"``; the file also holds the EMA
weights under ``"model_ema"`` and the training config, a yacs ``CfgNode``, read as plain data) or a state dict,
detects the variant from the tensors' shapes and loads it key for key. A ``training.json`` beside the file
(:func:`mamba_captum.vision.read_training_record`) gives the image size and the class names.
"""
from __future__ import annotations

import functools
import argparse
import math
import os
import re
from collections import OrderedDict

import torch

from .checkpoints import (apply_training_record, check_dtype, check_float_weights, checkpoint_key,
                          load_state_dict_strictly, read_training_record, training_image_size)
from .modeling_vmamba import VSSM

_V2 = dict(patch_size=4, ssm_d_state=1, ssm_dt_rank="auto", ssm_conv=3, ssm_conv_bias=False, forward_type="v05_noz",
           mlp_ratio=4.0, norm_layer="ln2d", downsample_version="v3", patchembed_version="v2", num_classes=1000,
           img_size=224)
_V0 = dict(patch_size=4, ssm_d_state=16, ssm_ratio=2.0, ssm_dt_rank="auto", ssm_conv=3, ssm_conv_bias=True,
           forward_type="v0", mlp_ratio=0.0, norm_layer="ln", downsample_version="v1", patchembed_version="v1",
           num_classes=1000, img_size=224)
# The official names of the released classification models (README, assets/performance.md) and their shapes.
VARIANTS = {
    "vssm1_tiny_0230s": dict(_V2, dims=96, depths=(2, 2, 8, 2), ssm_ratio=1.0),
    "vssm_small_0229": dict(_V2, dims=96, depths=(2, 2, 15, 2), ssm_ratio=2.0),
    "vssm_base_0229": dict(_V2, dims=128, depths=(2, 2, 15, 2), ssm_ratio=2.0),
    "vssm_tiny_v0": dict(_V0, dims=96, depths=(2, 2, 9, 2)),
    "vssm_small_v0": dict(_V0, dims=96, depths=(2, 2, 27, 2)),
    "vssm_base_v0": dict(_V0, dims=128, depths=(2, 2, 27, 2)),
}
# keys of the older official code, renamed as its own _load_from_state_dict does
_RENAMES = ((r"^patch_embed\.proj\.", "patch_embed.0."), (r"^patch_embed\.norm\.", "patch_embed.2."),
            (r"^(layers\.\d+\.blocks\.\d+\.)ln_1\.", r"\1norm."),
            (r"^(layers\.\d+\.blocks\.\d+\.)self_attention\.", r"\1op."),
            (r"^norm\.", "classifier.norm."), (r"^head\.", "classifier.head."))


def _build(name: str, overrides: dict) -> VSSM:
    return VSSM(**{**VARIANTS[name], **overrides})


def vmamba_tiny(**overrides) -> VSSM:
    """VMamba-T as released (``vssm1_tiny_0230s``: dims 96·2^i, depths 2-2-8-2, ssm_ratio 1, d_state 1, forward_type
    "v05_noz", v3 downsampling, v2 stem, 224², 1000 classes), randomly initialised. ``overrides``: any :class:`VSSM`
    argument (``depths``, ``dims``, ``img_size``, ``num_classes``, ...)."""
    return _build("vssm1_tiny_0230s", overrides)


def vmamba_small(**overrides) -> VSSM:
    """VMamba-S as released (``vssm_small_0229``: dims 96·2^i, depths 2-2-15-2, ssm_ratio 2); as :func:`vmamba_tiny`."""
    return _build("vssm_small_0229", overrides)


def vmamba_base(**overrides) -> VSSM:
    """VMamba-B as released (``vssm_base_0229``: dims 128·2^i, depths 2-2-15-2, ssm_ratio 2); as :func:`vmamba_tiny`."""
    return _build("vssm_base_0229", overrides)


class _Config:
    """What a yacs ``CfgNode`` (the training config inside the official files) unpickles into: an OrderedDict (a
    plain mapping, which the weights-only unpickler fills item by item and whose attributes it may set)."""

    def __new__(cls, *args):
        return OrderedDict()


def read_vmamba_checkpoint(path, weights: str = "model") -> dict:
    """The state dict of an official VMamba file: ``torch.load(path)[weights]`` (or the file itself when it is a
    plain state dict), weights-only (the training config, a yacs ``CfgNode``, and argparse namespaces are read as
    plain data; nothing else is executed).

    Raises:
        FileNotFoundError; ValueError naming what the file holds when it is not a checkpoint.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mamba_captum: no checkpoint file at {path!r}.")
    try:
        with torch.serialization.safe_globals([argparse.Namespace, (_Config, "yacs.config.CfgNode")]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 — any unpickling failure gets the same advice
        first = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", (str(error).splitlines() or [""])[0])
        raise ValueError(
            f"mamba_captum: {path!r} could not be read as a weights-only PyTorch checkpoint ({type(error).__name__}: "
            f"{first}). If you trust the file, load it yourself with torch.load(path, weights_only=False) and pass "
            "checkpoint['model'] to load_vmamba.") from None
    return vmamba_state_dict(checkpoint, path, weights)


def vmamba_state_dict(checkpoint, source="the given dict", weights: str = "model") -> dict:
    """The state dict in ``checkpoint`` (under ``weights``, else the dict itself), with the older official key names
    renamed and DataParallel's ``module.`` prefix removed.

    Raises:
        ValueError: no dict of tensors there.
    """
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get(weights), dict):
        checkpoint = checkpoint[weights]
    elif isinstance(checkpoint, dict) and weights != "model":
        raise ValueError(f"mamba_captum: {source} has no {weights!r} weights (keys {sorted(checkpoint)[:6]}).")
    if not isinstance(checkpoint, dict) or not checkpoint or not all(torch.is_tensor(v) for v in checkpoint.values()):
        keys = sorted(checkpoint)[:5] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"mamba_captum: {source} holds no VMamba state dict (expected tensors, or a dict with the "
                         f"weights under 'model'; found {keys}).")
    state = {}
    for key, value in checkpoint.items():
        key = key.removeprefix("module.")
        for pattern, replacement in _RENAMES:
            key = re.sub(pattern, replacement, key)
        state[key] = value
    return state


def _dt_rank(state: dict, dims) -> int | str:
    """"auto" (ceil(dim / 16) per stage, the official default) when every stage's Δ rank is that, else the one rank
    all stages share."""
    keys = [f"layers.{i}.blocks.0.op.dt_projs_weight" for i in range(len(dims))]
    if any(key not in state for key in keys):
        raise ValueError(f"mamba_captum: the state dict has no {next(k for k in keys if k not in state)!r}: it is not "
                         "a VMamba checkpoint.")
    ranks = [state[key].shape[2] for key in keys]
    if ranks == [math.ceil(dim / 16) for dim in dims]:
        return "auto"
    if len(set(ranks)) == 1:
        return ranks[0]
    raise ValueError(f"mamba_captum: the stages' Δ ranks {ranks} are neither ceil(dim / 16) nor one rank: no VMamba "
                     "variant has them.")


def detect_config(state: dict, img_size=None) -> dict:
    """The :class:`VSSM` arguments that give ``state``'s keys and shapes (``norm_layer``, which the weights cannot
    tell, follows the variant: "ln2d" for the v2 models, "ln" for v1 downsampling; both compute the same function).

    Raises:
        ValueError: a key the detection needs is missing, or the shapes fit no VMamba.
    """
    need = functools.partial(checkpoint_key, state, what="a VMamba")

    blocks = {}
    for key in state:
        if (match := re.match(r"layers\.(\d+)\.blocks\.(\d+)\.", key)):
            stage, block = int(match.group(1)), int(match.group(2))
            blocks[stage] = max(blocks.get(stage, 0), block + 1)
    if not blocks or sorted(blocks) != list(range(len(blocks))):
        raise ValueError("mamba_captum: the state dict has no layers.{i}.blocks.{j}.* keys for consecutive stages: "
                         "it is not a VMamba checkpoint.")
    depths = tuple(blocks[i] for i in range(len(blocks)))
    dims = [need(f"layers.{i}.blocks.0.norm.weight").shape[0] for i in range(len(depths))]
    op = "layers.0.blocks.0.op."
    conv = need(op + "conv2d.weight")  # (D_in, 1, k, k)
    d_inner = conv.shape[0]
    gated = need(op + "in_proj.weight").shape[0] == 2 * d_inner
    fc1 = state.get("layers.0.blocks.0.mlp.fc1.weight")
    mlp_ratio = 0.0 if fc1 is None else fc1.shape[0] / dims[0]
    if "patch_embed.5.weight" in state:
        patchembed, patch_size = "v2", 2 * (state["patch_embed.5.weight"].shape[-1] - 1)
    else:
        patchembed, patch_size = "v1", need("patch_embed.0.weight").shape[-1]
    if len(depths) == 1 or "layers.0.downsample.reduction.weight" in state:
        downsample = "v1"
    else:
        kernel = need("layers.0.downsample.1.weight").shape[-1]
        downsample = {2: "v2", 3: "v3"}.get(kernel)
        if downsample is None:
            raise ValueError(f"mamba_captum: a {kernel}×{kernel} downsampling conv fits no VMamba variant.")
    head = need("classifier.head.weight")
    forward_type = ("v0" if mlp_ratio == 0 else "v2") if gated else "v05_noz"
    ratio = d_inner / dims[0]
    return dict(patch_size=patch_size, in_chans=need("patch_embed.0.weight").shape[1], num_classes=head.shape[0],
                depths=depths, dims=dims, ssm_d_state=need(op + "A_logs").shape[1],
                ssm_ratio=int(ratio) if float(ratio).is_integer() else ratio,
                ssm_dt_rank=_dt_rank(state, dims), ssm_conv=conv.shape[-1],
                ssm_conv_bias=op + "conv2d.bias" in state, forward_type=forward_type, mlp_ratio=mlp_ratio,
                norm_layer="ln" if downsample == "v1" else "ln2d", downsample_version=downsample,
                patchembed_version=patchembed, img_size=224 if img_size is None else img_size)


def variant_name(config: dict) -> str | None:
    """The official name of a detected config, if it is a released one (at 224², 1000 classes)."""
    for name, variant in VARIANTS.items():
        dims = [variant["dims"] * 2 ** i for i in range(4)]
        if list(config["dims"]) == dims and tuple(config["depths"]) == variant["depths"] and all(
                config[key] == variant[key] for key in ("ssm_ratio", "ssm_d_state", "forward_type",
                                                        "downsample_version", "num_classes")):
            return name
    return None


def load_vmamba(checkpoint, *, img_size=None, weights: str = "model", dtype=None, device=None, **overrides) -> VSSM:
    """Build the VMamba that ``checkpoint`` was trained as and load its weights, key for key; eval mode.

    Args:
        checkpoint: a path to an official ``.pth`` file, a state dict, or a dict with the state dict under ``"model"``.
            A ``training.json`` beside the file gives ``img_size`` when it is not passed, the class names
            (``model.class_names``) and the evaluation crop (``model.crop_pct``).
        img_size: the image size (default: training.json's, else 224; an int or (height, width)). VMamba's weights
            fit any size; this one fixes the token grids (:meth:`VSSM.token_layout`).
        weights: "model" (default) or "model_ema" (the EMA weights the official files also hold).
        dtype: the model's dtype (default: the stored dtype of the stem). device: where to put it (default: CPU).
        **overrides: :class:`VSSM` arguments the weights cannot tell (e.g. ``norm_layer``).

    Raises:
        ValueError: naming every missing or unexpected key and shape mismatch, the tensors that are not floating
            point, a dtype that is not floating point (or why the file is not a checkpoint); a damaged training.json,
            or class names that are not one a class.
    """
    record = None
    if isinstance(checkpoint, (str, os.PathLike)):
        record = read_training_record(checkpoint)
        state = read_vmamba_checkpoint(checkpoint, weights)
    else:
        state = vmamba_state_dict(checkpoint, weights=weights)
    img_size = training_image_size(checkpoint, record, img_size)
    check_float_weights(state, "a VMamba")
    config = {**detect_config(state, img_size), **overrides}
    check_dtype(dtype, "a VMamba")
    model = VSSM(**config)
    model = model.to(state["patch_embed.0.weight"].dtype if dtype is None else dtype)
    load_state_dict_strictly(model, state)
    model.variant = variant_name(config)
    apply_training_record(model, record, checkpoint, config["num_classes"])
    if device is not None:
        model = model.to(device=device)
    return model.eval()
