"""The released MambaVision architectures and their checkpoint files.

``mambavision_tiny`` / ``tiny2`` / ``small`` / ``base`` / ``large`` / ``large2`` / ``large3`` build the official
architectures (``mamba_vision_T`` / ``T2`` / ``S`` / ``B`` / ``L`` / ``L2`` / ``L3_256_21k``) with random weights;
:func:`load_mambavision` reads an official checkpoint (``.pth.tar`` with the weights under ``"state_dict"``, a
``{"model": ...}`` file, a bare state dict, or the HF hub's ``model.safetensors`` whose keys start with
``model.``), detects the variant from the tensors' shapes and loads it key for key. A ``training.json`` beside the
file (:func:`mamba_captum.vision.read_training_record`) gives the image size, the evaluation crop and the class
names.
"""
from __future__ import annotations

import functools
import os
import re


from .checkpoints import (apply_training_record, check_dtype, check_float_weights, checkpoint_key,
                          load_state_dict_strictly, read_checkpoint, read_training_record, state_dict_of,
                          training_image_size)
from .modeling_mambavision import MambaVision, attention_blocks

_SMALL_HEADS = (2, 4, 8, 16)
_LARGE_HEADS = (4, 8, 16, 32)
_WINDOWS_224 = (8, 8, 14, 7)
_WINDOWS_512 = (8, 8, 32, 16)

# The official registered names (mambavision/models/mamba_vision.py) with their architectures, training image sizes
# and evaluation crops. The 21K-pretrained B and L have the 1K models' shapes (and L2_512_21k L2's): the image size
# tells L2 from L2_512_21k; B_21k and L_21k are reported as B and L.
VARIANTS = {
    "mamba_vision_T": dict(dim=80, in_dim=32, depths=(1, 3, 8, 4), num_heads=_SMALL_HEADS, window_size=_WINDOWS_224,
                           img_size=224, layer_scale=None, crop_pct=1.0),
    "mamba_vision_T2": dict(dim=80, in_dim=32, depths=(1, 3, 11, 4), num_heads=_SMALL_HEADS,
                            window_size=_WINDOWS_224, img_size=224, layer_scale=None, crop_pct=0.98),
    "mamba_vision_S": dict(dim=96, in_dim=64, depths=(3, 3, 7, 5), num_heads=_SMALL_HEADS, window_size=_WINDOWS_224,
                           img_size=224, layer_scale=None, crop_pct=0.93),
    "mamba_vision_B": dict(dim=128, in_dim=64, depths=(3, 3, 10, 5), num_heads=_SMALL_HEADS,
                           window_size=_WINDOWS_224, img_size=224, layer_scale=1e-5, crop_pct=1.0),
    "mamba_vision_L": dict(dim=196, in_dim=64, depths=(3, 3, 10, 5), num_heads=_LARGE_HEADS,
                           window_size=_WINDOWS_224, img_size=224, layer_scale=1e-5, crop_pct=1.0),
    "mamba_vision_L2": dict(dim=196, in_dim=64, depths=(3, 3, 12, 5), num_heads=_LARGE_HEADS,
                            window_size=_WINDOWS_224, img_size=224, layer_scale=1e-5, crop_pct=1.0),
    "mamba_vision_L2_512_21k": dict(dim=196, in_dim=64, depths=(3, 3, 12, 5), num_heads=_LARGE_HEADS,
                                    window_size=_WINDOWS_512, img_size=512, layer_scale=1e-5, crop_pct=0.93),
    "mamba_vision_L3_256_21k": dict(dim=256, in_dim=64, depths=(3, 3, 20, 10), num_heads=_LARGE_HEADS,
                                    window_size=(8, 8, 16, 8), img_size=256, layer_scale=1e-5, crop_pct=1.0),
    "mamba_vision_L3_512_21k": dict(dim=256, in_dim=64, depths=(3, 3, 20, 10), num_heads=_LARGE_HEADS,
                                    window_size=_WINDOWS_512, img_size=512, layer_scale=1e-5, crop_pct=0.93),
}
_ARCHITECTURE = ("dim", "in_dim", "depths", "num_heads", "window_size", "img_size", "layer_scale")


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(int(v) for v in size)


def _family(dim: int, in_dim: int, depths, layer_scale: bool) -> list[str]:
    """The released variants with these shapes, the first (smallest image size) first."""
    return [name for name, v in VARIANTS.items() if (v["dim"], v["in_dim"], tuple(v["depths"]),
                                                     v["layer_scale"] is not None) ==
            (dim, in_dim, tuple(depths), layer_scale)]


def _pick(names: list[str], img_size) -> str:
    """The variant of a family trained at ``img_size`` (None: the first), else the first: a model run at another
    size keeps the windows it was trained with, as the official code does (the grid is padded to whole windows)."""
    if img_size is not None:
        for name in names:
            if _pair(VARIANTS[name]["img_size"]) == _pair(img_size):
                return name
    return names[0]


def _build(name: str, overrides: dict) -> MambaVision:
    """The variant ``name`` with ``overrides``; with ``img_size`` given, the variant of the same shapes trained at
    that size if there is one (``mambavision_large2(img_size=512)`` is mamba_vision_L2_512_21k, windows 8/8/32/16)."""
    if "img_size" in overrides:
        base = VARIANTS[name]
        name = _pick(_family(base["dim"], base["in_dim"], base["depths"], base["layer_scale"] is not None),
                     overrides["img_size"])
    variant = VARIANTS[name]
    options = dict(mlp_ratio=4, num_classes=1000, **{key: variant[key] for key in _ARCHITECTURE})
    options.update(overrides)
    model = MambaVision(**options)
    model.variant = variant_name(options)
    model.crop_pct = variant["crop_pct"]
    return model


def mambavision_tiny(**overrides) -> MambaVision:
    """MambaVision-T (official ``mamba_vision_T``): dim 80, stem 32, depths 1/3/8/4, heads 2/4/8/16, windows
    8/8/14/7, 224², no layer scale, 1000 classes; random weights (crop_pct 1.0, the official evaluation crop).

    ``overrides``: any :class:`MambaVision` argument (``img_size``, ``num_classes``, ``depths``, ``window_size``,
    ...). ``model.variant`` is the official name when the architecture is the released one.
    """
    return _build("mamba_vision_T", overrides)


def mambavision_tiny2(**overrides) -> MambaVision:
    """MambaVision-T2 (``mamba_vision_T2``): as tiny with depths 1/3/11/4 (crop_pct 0.98)."""
    return _build("mamba_vision_T2", overrides)


def mambavision_small(**overrides) -> MambaVision:
    """MambaVision-S (``mamba_vision_S``): dim 96, stem 64, depths 3/3/7/5, heads 2/4/8/16 (crop_pct 0.93)."""
    return _build("mamba_vision_S", overrides)


def mambavision_base(**overrides) -> MambaVision:
    """MambaVision-B (``mamba_vision_B``; ``mamba_vision_B_21k`` has the same architecture): dim 128, stem 64,
    depths 3/3/10/5, heads 2/4/8/16, layer scale (γ) in the windowed blocks."""
    return _build("mamba_vision_B", overrides)


def mambavision_large(**overrides) -> MambaVision:
    """MambaVision-L (``mamba_vision_L``; ``mamba_vision_L_21k`` has the same architecture): dim 196, stem 64,
    depths 3/3/10/5, heads 4/8/16/32, layer scale."""
    return _build("mamba_vision_L", overrides)


def mambavision_large2(**overrides) -> MambaVision:
    """MambaVision-L2 (``mamba_vision_L2``): as large with depths 3/3/12/5. ``img_size=512`` gives
    ``mamba_vision_L2_512_21k`` (windows 8/8/32/16, crop_pct 0.93)."""
    return _build("mamba_vision_L2", overrides)


def mambavision_large3(**overrides) -> MambaVision:
    """MambaVision-L3 (``mamba_vision_L3_256_21k``): dim 256, depths 3/3/20/10, heads 4/8/16/32, windows
    8/8/16/8, 256², layer scale. ``img_size=512`` gives ``mamba_vision_L3_512_21k`` (windows 8/8/32/16)."""
    return _build("mamba_vision_L3_256_21k", overrides)


# -- reading files ------------------------------------------------------------------------------------------------
def mambavision_state(checkpoint) -> dict:
    """The state dict of a checkpoint (a path: :func:`mamba_captum.vision.read_checkpoint`, which reads the official
    ``.pth.tar`` (``"state_dict"``), ``{"model": ...}`` files, bare state dicts and ``.safetensors``; or a loaded dict),
    with the ``model.`` prefix of the HF hub's wrapper (``MambaVisionModelForImageClassification.model``) removed
    when every key has it.

    Raises:
        FileNotFoundError; ValueError naming what the file holds when it is not a checkpoint."""
    state = read_checkpoint(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else \
        state_dict_of(checkpoint, "the given dict")
    if all(key.startswith("model.") for key in state):
        state = {key.removeprefix("model."): value for key, value in state.items()}
    return state


# -- detection ----------------------------------------------------------------------------------------------------
def detect_mambavision_config(state: dict, img_size=None) -> dict:
    """The :class:`MambaVision` arguments that give ``state``'s keys and shapes (``num_heads`` and ``window_size``,
    which no shape tells, from the released variant with these shapes; None for them when no variant has them).

    The image size: ``img_size`` if given, else the variant's (224 for an unknown one). A released family trained at
    several sizes (L2 and L3: 224 / 256 and 512) takes the windows of the size given.

    Raises:
        ValueError: a key the detection needs is missing, or the attention blocks are not where the official model
            puts them.
    """
    need = functools.partial(checkpoint_key, state, what="a MambaVision")

    stem = need("patch_embed.conv_down.0.weight")  # (in_dim, in_chans, 3, 3)
    dim = need("patch_embed.conv_down.3.weight").shape[0]
    blocks = {}
    for key in state:
        if (match := re.match(r"levels\.(\d+)\.blocks\.(\d+)\.", key)):
            blocks.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
    if not blocks or sorted(blocks) != list(range(max(blocks) + 1)):
        raise ValueError(f"mamba_captum: the state dict's levels.{{i}}.blocks.{{j}} keys are missing or skip a level "
                         f"(levels {sorted(blocks)}): it is not a MambaVision checkpoint.")
    depths = [max(blocks[level]) + 1 for level in sorted(blocks)]
    if len(depths) < 3:
        raise ValueError(f"mamba_captum: the state dict has {len(depths)} levels; MambaVision has conv levels 0 and 1 "
                         "and windowed levels after them.")
    mamba = "levels.2.blocks.0.mixer."
    layer_scale = "levels.2.blocks.0.gamma_1" in state
    for level in range(2, len(depths)):
        where = [j for j in range(depths[level]) if f"levels.{level}.blocks.{j}.mixer.qkv.weight" in state]
        if where != list(attention_blocks(depths[level])):
            raise ValueError(f"mamba_captum: level {level} has attention in blocks {where}; the official model puts "
                             f"it in blocks {list(attention_blocks(depths[level]))} of {depths[level]}.")
    head = state.get("head.weight")
    config = dict(dim=dim, in_dim=stem.shape[0], in_chans=stem.shape[1], depths=depths,
                  mlp_ratio=need("levels.2.blocks.0.mlp.fc1.weight").shape[0]
                  / need("levels.2.blocks.0.norm1.weight").shape[0],
                  num_classes=0 if head is None else head.shape[0],
                  qkv_bias=any(key.endswith(".mixer.qkv.bias") for key in state),
                  qk_scale=any(key.endswith(".mixer.q_norm.weight") for key in state) or None,
                  layer_scale=1e-5 if layer_scale else None,  # the value is loaded; a number makes γ parameters
                  layer_scale_conv=1e-5 if "levels.0.blocks.0.gamma" in state else None,
                  d_state=need(mamba + "A_log").shape[1], d_conv=need(mamba + "conv1d_x.weight").shape[-1])
    if float(config["mlp_ratio"]).is_integer():
        config["mlp_ratio"] = int(config["mlp_ratio"])
    family = _family(dim, config["in_dim"], depths, layer_scale) if len(depths) == 4 else []
    name = _pick(family, img_size) if family else None
    config["num_heads"] = list(VARIANTS[name]["num_heads"]) if name else None
    config["window_size"] = list(VARIANTS[name]["window_size"]) if name else None
    config["img_size"] = img_size if img_size is not None else VARIANTS[name]["img_size"] if name else 224
    return config


def _normal(key: str, value):
    """A config value in one form for comparison: image sizes as pairs, sequences as tuples."""
    if key == "img_size":
        return _pair(value)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def variant_name(config: dict) -> str | None:
    """The official registered name of a config, if it is a released architecture at its training image size."""
    for name, variant in VARIANTS.items():
        if all(_normal(key, config[key]) == _normal(key, variant[key]) for key in _ARCHITECTURE[:-1]) \
                and (config.get("layer_scale") is None) == (variant["layer_scale"] is None) \
                and config.get("mlp_ratio", 4) == 4 and config.get("in_chans", 3) == 3 \
                and not config.get("qk_scale") and config.get("layer_scale_conv") is None:
            return name
    return None


def load_mambavision(checkpoint, *, img_size=None, dtype=None, device=None, **overrides) -> MambaVision:
    """Build the MambaVision that ``checkpoint`` was trained as and load its weights, key for key; eval mode.

    Args:
        checkpoint: a path (an official ``.pth.tar``, a ``{"model": ...}`` file, a bare state dict, or the HF hub's
            ``model.safetensors``) or a state dict (or a dict with it under ``"state_dict"`` / ``"model"``). A
            ``training.json`` beside the file gives ``img_size`` when it is not passed, the class names
            (``model.class_names``) and the evaluation crop (``model.crop_pct``).
        img_size: the input size (an int or (height, width); default: training.json's, else the variant's, 224 /
            256 / 512). A released family trained at several sizes takes the windows of the one given (L2 at 512:
            mamba_vision_L2_512_21k); another size keeps the default variant's windows (the grid is padded to whole
            windows, as the official code does). One that differs from training.json's is used, with an
            :class:`ImageNotice` warning.
        dtype: the model's dtype (default: the stored dtype of the stem's first conv).
        device: where to put the model (default: CPU).
        **overrides: :class:`MambaVision` arguments the weights cannot tell: ``num_heads`` and ``window_size``
            (required for shapes no released variant has), ``qkv_bias`` ...

    Returns:
        the :class:`MambaVision` in eval mode; ``model.variant`` the official name (None for another architecture),
        ``model.img_size`` and ``model.crop_pct`` what :func:`preprocess` takes.

    Raises:
        ValueError: naming every missing or unexpected key and shape mismatch, the tensors that are not floating
            point, shapes no variant has without ``num_heads=`` / ``window_size=``, a dtype that is not floating
            point, why a file is not a checkpoint; a damaged training.json, or class names that do not fit.
    """
    record = None
    if isinstance(checkpoint, (str, os.PathLike)):
        record = read_training_record(checkpoint)
    state = mambavision_state(checkpoint)
    img_size = training_image_size(checkpoint, record, img_size)
    config = (record or {}).get("config") if isinstance((record or {}).get("config"), dict) else {}
    # what no shape tells (the heads, the windows) from the training record, for a model trained at another size
    overrides = {**{key: config[key] for key in ("num_heads", "window_size") if key in config}, **overrides}
    check_float_weights(state, "a MambaVision")
    detected = detect_mambavision_config(state, img_size)
    config = {**detected, **overrides}
    unknown = [key for key in ("num_heads", "window_size") if config[key] is None]
    if unknown:
        raise ValueError(f"mamba_captum: no released MambaVision has these shapes (dim {detected['dim']}, stem "
                         f"{detected['in_dim']}, depths {detected['depths']}); pass "
                         f"{' and '.join(key + '=' for key in unknown)} (one value per level), which the weights "
                         "cannot tell.")
    check_dtype(dtype, "MambaVision")
    model = MambaVision(**config)
    model = model.to(state["patch_embed.conv_down.0.weight"].dtype if dtype is None else dtype)
    load_state_dict_strictly(model, state)
    model.variant = variant_name(config)
    if model.variant is not None:
        model.crop_pct = VARIANTS[model.variant]["crop_pct"]
    apply_training_record(model, record, checkpoint, config["num_classes"])
    if device is not None:
        model = model.to(device=device)
    return model.eval()
