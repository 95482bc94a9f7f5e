"""The released Vim architectures and their checkpoint files.

``vim_tiny`` / ``vim_small`` / ``vim_base`` build the official architectures (stride 16; ``stride=8`` for the
stride-8 variants); :func:`load_vim` reads an official ``.pth`` file (the weights under ``"model"``, as published
under hustvl/ on the hub) or a state dict, detects the variant from the tensors' shapes and loads it key for key.
A ``training.json`` beside the file (:func:`read_training_record`; the record mamba_captum's training writes) gives
the image size and the class names.
"""
from __future__ import annotations

import functools
import argparse
import json
import math
import os
import re
import warnings
from pathlib import Path

import torch

from ..files import json_kind
from .images import ImageNotice, is_crop_pct, is_image_size
from .modeling_vim import VisionMamba

# The official registered names (timm) of the released models and their sizes; all bimamba v2, middle CLS token,
# RMSNorm, absolute position embeddings, if_divide_out.
VARIANTS = {
    "vim_tiny_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2": dict(embed_dim=192, stride=16),
    "vim_tiny_patch16_stride8_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2":
        dict(embed_dim=192, stride=8),
    "vim_small_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2": dict(embed_dim=384, stride=16),
    "vim_small_patch16_stride8_224_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2":
        dict(embed_dim=384, stride=8),
    "vim_base_patch16_224_bimambav2_final_pool_mean_abs_pos_embed_with_middle_cls_token_div2":
        dict(embed_dim=768, stride=16),
}
_DEFAULTS = dict(img_size=224, patch_size=16, depth=24, d_state=16, num_classes=1000, cls_position="middle")
TRAINING_RECORD = "training.json"  # the record beside a checkpoint file: image size, class names


def _build(embed_dim: int, overrides: dict) -> VisionMamba:
    options = {**_DEFAULTS, "embed_dim": embed_dim, **overrides}
    options.setdefault("stride", options["patch_size"])  # non-overlapping patches unless a stride is given
    return VisionMamba(**options)


def vim_tiny(**overrides) -> VisionMamba:
    """Vim-Ti (embed 192, 24 blocks, 16-pixel patches, 224², 1000 classes, CLS in the middle), randomly initialised.

    ``overrides``: any :class:`VisionMamba` argument, e.g. ``stride=8`` (Vim-Ti stride 8), ``depth``, ``img_size``,
    ``patch_size`` (the stride follows it unless given), ``num_classes``, ``cls_position``.
    """
    return _build(192, overrides)


def vim_small(**overrides) -> VisionMamba:
    """Vim-S (embed 384); as :func:`vim_tiny` otherwise."""
    return _build(384, overrides)


def vim_base(**overrides) -> VisionMamba:
    """Vim-B (embed 768); as :func:`vim_tiny` otherwise."""
    return _build(768, overrides)


def read_checkpoint(path, envelopes=("model", "state_dict")) -> dict:
    """The state dict of a checkpoint file: ``torch.load(path)["model"]`` (the official Vim and VMamba files),
    ``["state_dict"]`` (MambaVision's), the file itself when it is a plain state dict, loaded with
    ``weights_only=True`` (the training arguments, an ``argparse.Namespace``, are allowed as data); or a
    ``.safetensors`` file (timm's hub files).

    Raises:
        FileNotFoundError; ValueError naming what the file holds when it is not a checkpoint.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mamba_captum: no checkpoint file at {path!r}.")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return state_dict_of(load_file(path, device="cpu"), path, envelopes)
        except SafetensorError as error:
            raise ValueError(f"mamba_captum: {path!r} is not a readable safetensors file ({error}).") from None
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 — any unpickling failure gets the same advice
        raise ValueError(
            f"mamba_captum: {path!r} could not be read as a weights-only PyTorch checkpoint ({type(error).__name__}: "
            f"{_plain_first_line(error)}). If you trust the file, load it yourself with "
            "torch.load(path, weights_only=False) and pass checkpoint['model'] to load_vim.") from None
    return state_dict_of(checkpoint, path, envelopes)


def _plain_first_line(error) -> str:
    """The first line of an error's message without terminal escape codes (torch's weights-only refusal makes
    part of it bold), so the refusal stays plain text in a log or a file."""
    lines = str(error).splitlines()
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", lines[0]) if lines else ""


def state_dict_of(checkpoint, source, envelopes=("model", "state_dict")) -> dict:
    """The state dict in a loaded checkpoint: the dict itself when it holds tensors, else its first entry of
    ``envelopes`` that is a dict (``"model"``, ``"state_dict"``; EfficientViM's training files put ``"model_ema"``
    first, as timm does); a ``module.`` prefix (DataParallel's) removed.

    Raises:
        ValueError: naming ``source`` and the keys found, when there is no state dict."""
    if isinstance(checkpoint, dict) and not all(torch.is_tensor(v) for v in checkpoint.values()):
        for name in envelopes:
            if isinstance(checkpoint.get(name), dict):
                checkpoint = checkpoint[name]
                break
    if not isinstance(checkpoint, dict) or not checkpoint or not all(torch.is_tensor(v) for v in checkpoint.values()):
        keys = list(checkpoint)[:5] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"mamba_captum: {source} holds no state dict (expected tensors, or a dict with the "
                         f"weights under {' or '.join(repr(e) for e in envelopes)}; found {keys}).")
    return {key.removeprefix("module."): value for key, value in checkpoint.items()}


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(int(v) for v in size)


def _stride(patches: int, patch, img_size, stride, guessed_size: bool) -> int:
    """The stride that gives ``patches`` patches of size ``patch`` on ``img_size`` images (floor division, as the
    model's grid): the given one if it fits; else the patch size, or the largest overlapping stride that fits.
    Strides that leave gaps between patches (no released Vim has them) are only taken when given."""
    (height, width), (patch_h, patch_w) = _pair(img_size), _pair(patch)
    count = lambda s: ((height - patch_h) // s + 1) * ((width - patch_w) // s + 1)  # noqa: E731
    fits = [s for s in range(1, max(height, width) + 1) if height >= patch_h and width >= patch_w
            and count(s) == patches]
    where = f"{patches} patches of {patch_h}×{patch_w} pixels on {height}×{width} images"
    if stride is not None:
        if stride not in fits:
            raise ValueError(f"mamba_captum: stride={stride} does not give {where}; check img_size= and stride=.")
        return stride
    no_gaps = [s for s in fits if s <= min(patch_h, patch_w)]
    if patch_h == patch_w and patch_h in fits:
        return patch_h
    if no_gaps:
        return max(no_gaps)
    grid = math.isqrt(patches)  # the size a square grid of non-overlapping patches needs, as a suggestion
    fitting = f"; {grid * patch_h} fits {grid} × {grid} patches without overlap" \
        if grid * grid == patches and patch_h == patch_w else ""
    hint = f"{'pass' if guessed_size else 'check'} img_size= (the training image size{fitting})"
    if fits and not guessed_size:  # only strides with gaps give the count at this size
        hint += (f", or pass stride= ({' or '.join(map(str, fits))} "
                 f"fit{'s' if len(fits) == 1 else ''}) if the model was trained with gaps between patches")
    raise ValueError(f"mamba_captum: no stride without gaps gives {where} (the position embeddings' count); {hint}.")


def checkpoint_key(state: dict, key: str, what: str = "a Vim") -> torch.Tensor:
    """``state[key]``, a key the detection of ``what``'s config needs.

    Raises:
        ValueError: the key is missing: the state dict is not ``what``'s checkpoint (its first keys named)."""
    if key not in state:
        raise ValueError(f"mamba_captum: the state dict has no {key!r}: it is not {what} checkpoint (keys start with "
                         f"{sorted(state)[:4]}).")
    return state[key]


def detect_config(state: dict, img_size=None, stride=None) -> dict:
    """The :class:`VisionMamba` arguments that give ``state``'s keys and shapes.

    The stride is read from the number of position embeddings and the image size (224 unless given; an int or
    (height, width)): the patch size if it fits, else the largest overlapping stride that does. ``stride`` given
    is checked instead.

    Raises:
        ValueError: a key the detection needs is missing, or the shapes fit no Vim.
    """
    need = functools.partial(checkpoint_key, state, what="a Vim")

    proj = need("patch_embed.proj.weight")  # (D, C, patch height, patch width)
    embed_dim, channels, patch = proj.shape[0], proj.shape[1], (proj.shape[2], proj.shape[3])
    layers = {int(m.group(1)) for key in state if (m := re.match(r"layers\.(\d+)\.", key))}
    if not layers:
        raise ValueError("mamba_captum: the state dict has no layers.{i}.* keys: it is not a Vim checkpoint.")
    a_log = need("layers.0.mixer.A_log")  # (D_in, N)
    has_cls = "cls_token" in state
    tokens = need("pos_embed").shape[1]
    stride = _stride(tokens - has_cls, patch, 224 if img_size is None else img_size, stride, img_size is None)
    head = state.get("head.weight")
    img = 224 if img_size is None else img_size
    return dict(img_size=img, patch_size=patch[0] if patch[0] == patch[1] else patch, stride=stride,
                channels=channels, depth=max(layers) + 1,
                embed_dim=embed_dim, d_state=a_log.shape[1], expand=a_log.shape[0] / embed_dim,
                d_conv=need("layers.0.mixer.conv1d.weight").shape[-1],
                dt_rank=need("layers.0.mixer.dt_proj.weight").shape[1],
                num_classes=0 if head is None else head.shape[0],
                cls_position="middle" if has_cls else None)


def variant_name(config: dict) -> str | None:
    """The official registered name of a detected config, if it is a released one."""
    for name, sizes in VARIANTS.items():
        if (config["embed_dim"], config["stride"]) == (sizes["embed_dim"], sizes["stride"]) and \
                config["depth"] == 24 and config["patch_size"] == 16 and config["img_size"] == 224:
            return name
    return None


def check_float_weights(state: dict, what: str = "a Vim") -> None:
    """Every tensor of an image model's state dict is a floating-point weight (BatchNorm's step counters,
    ``num_batches_tracked``, excepted); an integer, boolean or complex tensor would be cast into a float parameter by
    ``load_state_dict`` without a word. ``what`` names the model in the message ("a Vim", "a VMamba" ...).

    Raises:
        ValueError: naming the tensors that are not floating point and their dtypes.
    """
    other = [f"{key} ({str(value.dtype).removeprefix('torch.')})" for key, value in state.items()
             if not value.is_floating_point() and not (key.endswith("num_batches_tracked")
                                                       and not value.is_complex() and value.dtype != torch.bool)]
    if other:
        raise ValueError(
            f"mamba_captum: the checkpoint holds {len(other)} tensor{'s' if len(other) > 1 else ''} that "
            f"{'are' if len(other) > 1 else 'is'} not floating point: {', '.join(other[:4])}"
            f"{f' and {len(other) - 4} more' if len(other) > 4 else ''}. {what[0].upper() + what[1:]}'s weights are "
            f"all float (float32 in the released checkpoints): this is not {what} model checkpoint, or a quantized "
            "one; dequantize it to float first.")


def check_dtype(dtype, what: str = "a Vim") -> None:
    """``dtype=`` of a loader: None or a floating-point torch dtype.

    Raises:
        ValueError: naming the dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"mamba_captum: dtype={dtype!r}; {what} computes in a floating-point dtype (torch.float32, "
                         "torch.float16, torch.bfloat16 or torch.float64).")


def load_state_dict_strictly(model, state: dict) -> None:
    """``model.load_state_dict(state)`` with an error that names every missing and unexpected key and every shape
    that differs (and the model's class). BatchNorm's ``num_batches_tracked`` may be missing (a training counter,
    which official loaders skip too)."""
    own = model.state_dict()
    missing = sorted(key for key in set(own) - set(state) if not key.endswith("num_batches_tracked"))
    unexpected = sorted(set(state) - set(own))
    mismatched = [f"{key} {tuple(state[key].shape)} (model: {tuple(own[key].shape)})"
                  for key in sorted(set(own) & set(state)) if state[key].shape != own[key].shape]
    if missing or unexpected or mismatched:
        parts = [f"{label} ({len(keys)}): {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                 for label, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                     ("shapes that differ", mismatched)) if keys]
        what = "Vim" if isinstance(model, VisionMamba) else type(model).__name__
        raise ValueError(f"mamba_captum: the checkpoint does not fit this {what}; " + "; ".join(parts) + ".")
    model.load_state_dict({**{key: own[key] for key in own if key not in state}, **state})


def read_training_record(checkpoint) -> dict | None:
    """The ``training.json`` beside the checkpoint file ``checkpoint`` (a JSON object: the record mamba_captum's
    training writes, or your own), or None when there is none.

    The fields :func:`load_vim` reads are checked: ``img_size`` (under ``"config"``, or at the top): a positive int
    or [height, width]; ``crop_pct``: a number in (0, 1], the share of the resized image the evaluation transform
    keeps (1: the model was trained on whole images); ``class_names``: a list of distinct strings, in class order.
    Two image sizes that disagree (under ``"config"`` and at the top) are refused. Read them with
    ``mamba_captum.vision.checkpoints.recorded_img_size(record)``, ``record.get("crop_pct")`` and
    ``record.get("class_names")``.

    Raises:
        ValueError: one line naming the file: not UTF-8 JSON, not an object, or one of those fields of another kind.
    """
    file = Path(os.fspath(checkpoint)).with_name(TRAINING_RECORD)
    if not file.is_file():
        return None
    fix = "fix it or remove it (it is read for the image size and the class names)"
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"mamba_captum: {str(file)!r} is not valid JSON ({error.msg}, line {error.lineno}); "
                         f"{fix}.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"mamba_captum: {str(file)!r} cannot be read as UTF-8 text ({error}); {fix}.") from None
    if not isinstance(record, dict):
        raise ValueError(f"mamba_captum: {str(file)!r} holds a JSON {json_kind(record)}, not an object; {fix}.")
    config = record.get("config")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"mamba_captum: {str(file)!r} has a 'config' that is a JSON {json_kind(config)}, not an "
                         f"object; {fix}.")
    size = recorded_img_size(record)
    if size is not None and not is_image_size(size):
        raise ValueError(f"mamba_captum: {str(file)!r} has an 'img_size' of {json.dumps(size)}, not a positive "
                         f"integer or [height, width]; {fix}.")
    crop = record.get("crop_pct")
    if crop is not None and not is_crop_pct(crop):
        raise ValueError(f"mamba_captum: {str(file)!r} has a 'crop_pct' of {json.dumps(crop)}, not a number in "
                         f"(0, 1]; {fix}.")
    names = record.get("class_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"mamba_captum: {str(file)!r} has 'class_names' that are not a list of strings; {fix}.")
    repeated = sorted({name for name in names or [] if names.count(name) > 1})
    if repeated:  # a name would stand for two classes: a target given by name would pick the first, silently
        raise ValueError(f"mamba_captum: {str(file)!r} repeats the class names {repeated}; give each class its own "
                         f"name, or {fix}.")
    top = record.get("img_size")
    if isinstance(config, dict) and config.get("img_size") is not None and top is not None \
            and not (is_image_size(top) and _pair(config["img_size"]) == _pair(top)):
        raise ValueError(f"mamba_captum: {str(file)!r} gives two image sizes, {json.dumps(config['img_size'])} "
                         f"under 'config' and {json.dumps(top)} at the top; keep one, or {fix}.")
    return record


def recorded_img_size(record: dict):
    """The image size a training record gives (``record["config"]["img_size"]``, else ``record["img_size"]``), or
    None."""
    config = record.get("config")
    if isinstance(config, dict) and config.get("img_size") is not None:
        return config["img_size"]
    return record.get("img_size")


def training_image_size(checkpoint, record: dict | None, img_size):
    """The image size to build a model at: ``img_size`` when given (with an :class:`ImageNotice` warning when it
    differs from the training.json's), else the record's, else None (the loader's default)."""
    recorded = recorded_img_size(record) if record is not None else None
    if recorded is None:
        return img_size
    recorded = recorded if isinstance(recorded, int) else tuple(recorded)
    if img_size is None:
        return recorded
    if _pair(img_size) != _pair(recorded):
        file = str(Path(os.fspath(checkpoint)).with_name(TRAINING_RECORD))
        warnings.warn(f"mamba_captum: img_size={img_size} differs from the img_size {recorded} in {file!r}; "
                      f"using img_size={img_size}.", ImageNotice, stacklevel=3)
    return img_size


def apply_training_record(model, record: dict | None, checkpoint, num_classes: int) -> None:
    """The class names (``model.class_names``) and evaluation crop (``model.crop_pct``) a training.json gives.

    Raises:
        ValueError: the record names another number of classes than the model has."""
    if record is None:
        return
    names = record.get("class_names")
    if names is not None:
        if len(names) != num_classes:
            file = str(Path(os.fspath(checkpoint)).with_name(TRAINING_RECORD))
            raise ValueError(f"mamba_captum: {file!r} has {len(names)} class_names for a model of {num_classes} "
                             "classes; fix it or remove the names.")
        model.class_names = list(names)
    if record.get("crop_pct") is not None:
        model.crop_pct = float(record["crop_pct"])


def load_vim(checkpoint, *, img_size=None, dtype=None, device=None, **overrides) -> VisionMamba:
    """Build the Vim that ``checkpoint`` was trained as and load its weights, key for key; eval mode.

    Args:
        checkpoint: a path to an official ``.pth`` file (weights under ``"model"``), a state dict, or a dict with
            the state dict under ``"model"``. A ``training.json`` beside the file (:func:`read_training_record`)
            gives ``img_size`` when it is not passed, the class names (``model.class_names``) and the evaluation
            crop (``model.crop_pct``).
        img_size: the image size the model was trained at (default: training.json's, else 224; an int or
            (height, width)): with the number of position embeddings it fixes the stride (16 or 8 for the released
            models). One that differs from training.json's is used, with an :class:`ImageNotice` warning.
        dtype: the model's dtype (default: the stored dtype of the patch embedding).
        device: where to put the model (default: CPU).
        **overrides: :class:`VisionMamba` arguments the weights cannot tell, e.g. ``cls_position="first"``.

    Returns:
        the :class:`VisionMamba`; ``model.img_size`` (height, width) is what :func:`preprocess` takes.

    Raises:
        ValueError: naming every missing or unexpected key and shape mismatch, the tensors that are not floating
            point (integer weights: not a model checkpoint, or a quantized one), a dtype that is not floating point
            (or why the file is not a checkpoint); a damaged training.json, or class names that are not one a class.
    """
    record = None
    if isinstance(checkpoint, (str, os.PathLike)):
        record = read_training_record(checkpoint)
        state = read_checkpoint(checkpoint)
    else:
        state = state_dict_of(checkpoint, "the given dict")
    img_size = training_image_size(checkpoint, record, img_size)
    config = {**detect_config(state, img_size, overrides.get("stride")), **overrides}
    check_float_weights(state)
    check_dtype(dtype)
    if float(config["expand"]).is_integer():
        config["expand"] = int(config["expand"])
    model = VisionMamba(**config)
    if dtype is None:  # the stored dtype (of the patch embedding; released checkpoints are float32)
        dtype = state["patch_embed.proj.weight"].dtype
    model = model.to(dtype)
    load_state_dict_strictly(model, state)
    model.variant = variant_name(config)
    apply_training_record(model, record, checkpoint, config["num_classes"])
    if device is not None:
        model = model.to(device=device)
    return model.eval()
