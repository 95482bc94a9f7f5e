"""Loading a checkpoint: a local HF checkpoint directory -> (model, tokenizer), offline, and every problem with it
(a missing folder, a damaged or incomplete checkpoint, a model with no supported mixer, an unusable device or device
map) as one :class:`UsageError`.

:class:`UsageError` and :func:`check_device` (from :mod:`mamba_captum.usage`), :data:`DTYPES` and the model checks
(:func:`is_classifier`, :func:`check_supported`) are shared by the texts, the pipeline and the images
(:mod:`mamba_captum.explain.images`).
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from ..families import SUPPORTED_MIXERS
from ..fla_cpu import fla_available, import_fla_models
# defined where torch is not imported, so that the command line checks a request before it imports the library
from ..usage import UsageError, check_device

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def check_supported(model) -> None:
    """Raise :class:`UsageError` unless ``model`` is a causal LM or sequence classifier with a supported mixer."""
    name = type(model).__name__
    if not (is_classifier(model) or getattr(model, "get_output_embeddings", lambda: None)() is not None):
        raise UsageError(f"{name} is neither a *ForCausalLM nor a *ForSequenceClassification model; explain it with "
                         "the Python API and a forward_func instead.")
    if not any(type(module).__name__ in SUPPORTED_MIXERS for module in model.modules()):
        raise UsageError(f"model type {model.config.model_type!r} has no token mixer mamba-captum explains "
                         f"(supported: Mamba, Mamba-2, RWKV, RecurrentGemma and the hybrids; see the README).")


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    if lines[0].endswith(":") and len(lines) > 1:  # "Validation error for field 'x':" says nothing alone
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def _weight_files(path: Path) -> list[Path]:
    """The weight files ``from_pretrained`` reads from a checkpoint directory (safetensors first, as HF does)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            try:
                shards = json.loads((path / index).read_text(encoding="utf-8"))["weight_map"].values()
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                raise UsageError(f"the weights index {str(path / index)!r} is not a valid index file (JSON with a "
                                 "\"weight_map\"); re-save the checkpoint with save_pretrained.") from None
            return [path / shard for shard in sorted(set(map(str, shards)))]
    return []


def _corrupt(files, detail: str) -> UsageError:
    if len(files) == 1:
        named, them = f"file {str(files[0])!r} is", "it"
    else:  # a .bin shard torch.load could not read, among several
        named, them = f"files {', '.join(repr(str(f)) for f in files)} are", "them"
    return UsageError(f"the weights {named} corrupt or truncated ({detail}); re-save {them} with save_pretrained or "
                      f"download {them} again.")


def _check_weight_files(path: Path) -> None:
    """Refuse a corrupt or truncated safetensors file by name: its header must describe exactly the file's bytes,
    which a cut-off copy or a file of other bytes does not (reading the header is cheap; the tensors stay on disk)."""
    from safetensors import SafetensorError, safe_open

    for file in _weight_files(path):
        if file.suffix != ".safetensors" or not file.is_file():
            continue  # a missing shard: from_pretrained names it
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError as error:
            raise _corrupt([file], _first_line(error)) from None


def _check_vocabulary(tokenizer, path: Path) -> None:
    if not set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):
        # transformers builds an empty tokenizer when the files are missing: every text would read as nothing
        raise UsageError(f"the tokenizer in {str(path)!r} has no vocabulary (its tokenizer.json / vocabulary files "
                         "are missing); save it there with tokenizer.save_pretrained(DIR).")


# transformers' own model types that fla registers its configs under: a checkpoint of fla's says so by the loss
# switches every fla config writes (transformers' configs have none)
FLA_SHARED_TYPES = ("mamba", "mamba2", "bitnet")


def _fla_config(path: Path):
    """The checkpoint's config as flash-linear-attention's config class, when it is an fla checkpoint that
    transformers would otherwise read (fla's model types transformers does not know: fla's models are imported so
    that ``AutoConfig`` knows them, :func:`mamba_captum.fla_cpu.import_fla_models`; fla's ``mamba`` / ``mamba2`` /
    ``bitnet``, which transformers would read as its own different models: fla's config class itself), else None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        raw = json.loads((path / "config.json").read_text())
        model_type = raw.get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # AutoConfig reports the unreadable file
    if not isinstance(model_type, str):
        return None
    if model_type not in CONFIG_MAPPING:  # fla is imported (seconds) only for a checkpoint that may be fla's
        if fla_available():
            import_fla_models()
        return None
    if model_type in FLA_SHARED_TYPES and "fuse_cross_entropy" in raw and fla_available():
        fla_models = import_fla_models()
        config_class = next((c for c in vars(fla_models).values() if isinstance(c, type)
                             and getattr(c, "model_type", None) == model_type and hasattr(c, "from_pretrained")),
                            None)
        return None if config_class is None else config_class.from_pretrained(path)
    return None


def load(model_dir, *, device: str = "cpu", dtype: str = "float32", device_map=None, max_memory=None,
         offload_folder=None):
    """A local HF checkpoint directory -> (model in eval mode, tokenizer), offline. Errors are :class:`UsageError`.

    ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"`` or a dict module name -> device / ``"cpu"`` /
    ``"disk"``), with ``max_memory`` (device -> size, e.g. ``{0: "20GiB", "cpu": "60GiB"}``) and ``offload_folder``
    (for ``"disk"``; default a temporary folder removed at exit), loads the model dispatched by accelerate instead
    of on ``device`` (docs/scale.md).
    """
    import transformers as tf
    from safetensors import SafetensorError

    path = Path(model_dir)
    if path.is_file():  # a Vision Mamba .pth most often: it has its own loader
        raise UsageError(f"{str(path)!r} is a file, not a checkpoint directory: load() reads a folder written by "
                         "save_pretrained (a Vision Mamba .pth file loads with mamba_captum.vision.load_vim).")
    if not path.is_dir():
        raise UsageError(f"model directory {str(path)!r} does not exist; pass a folder written by save_pretrained.")
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} holds no config.json: it is not a HF checkpoint directory.")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    placement = {"dtype": DTYPES[dtype]}
    if device_map is None and max_memory is not None:
        raise UsageError("max_memory (--max-memory) bounds what device_map='auto' places per device; give a "
                         "device_map (--device-map auto) with it.")
    if device_map is not None:
        _check_device_map(device_map)
        placement.update(device_map=device_map, max_memory=max_memory,
                         offload_folder=str(offload_folder or _offload_folder()))
    else:
        check_device(device)
    fla_config = _fla_config(path)
    try:
        config = fla_config or tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as error:  # only the file is read here: malformed JSON, an unknown model_type, a wrong field
        raise UsageError(f"the config.json in {str(path)!r} cannot be read: {_first_line(error)}") from None
    _check_weight_files(path)
    try:
        architectures = config.architectures or []
        if any(a.endswith("ForSequenceClassification") for a in architectures):
            auto = tf.AutoModelForSequenceClassification
        elif any(a.endswith("ForConditionalGeneration") for a in architectures):
            # a vision-language checkpoint (Qwen3.5, GLM-5-Next, LFM2-VL, ...): text in, its language model explained
            auto = tf.AutoModelForImageTextToText
        else:
            auto = tf.AutoModelForCausalLM
        # mismatched shapes are reported below, by name, rather than raised with the details only in HF's log
        model, loading = auto.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                              ignore_mismatched_sizes=True, config=config, **placement)
    except ValueError as error:  # transformers' "Unrecognized configuration class ..."
        raise UsageError(f"model type {config.model_type!r} cannot be loaded as a causal LM or sequence "
                         f"classifier: {_first_line(error)}") from None
    except OSError as error:  # no weights file
        raise UsageError(f"the weights in {str(path)!r} cannot be loaded: {_first_line(error)}") from None
    except (SafetensorError, pickle.UnpicklingError, EOFError) as error:
        raise _corrupt(_weight_files(path) or [path], _first_line(error).split(". ")[0]) from None
    except RuntimeError as error:
        if "PytorchStreamReader" in str(error):  # torch.load of a cut-off .bin (a zip archive)
            raise _corrupt(_weight_files(path) or [path], _first_line(error).split(". ")[0]) from None
        raise UsageError(f"the model in {str(path)!r} cannot be built from its config.json and weights: "
                         f"{_first_line(error).split('. ')[0]}; re-save it with save_pretrained or download it "
                         "again.") from None
    missing, mismatched = sorted(loading["missing_keys"]), sorted(loading["mismatched_keys"])
    if missing:  # transformers would fill them with random values: explanations of a model nobody trained
        raise UsageError(f"the weights in {str(path)!r} lack {len(missing)} tensor(s) the model needs "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the checkpoint is "
                         "incomplete or for another architecture; re-save it with save_pretrained.")
    if mismatched:
        name, stored, expected = mismatched[0]
        raise UsageError(f"the weights in {str(path)!r} do not fit its config.json: {name} is stored as "
                         f"{list(stored)} but the config makes it {list(expected)} ({len(mismatched)} tensor(s) "
                         "differ); use the config.json the weights were saved with.")
    check_supported(model)
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"no tokenizer could be loaded from {str(path)!r}: {_first_line(error)}") from None
    _check_vocabulary(tokenizer, path)
    if device_map is not None:  # accelerate placed it
        return model.eval(), tokenizer
    try:
        model = model.to(device)
    except (RuntimeError, AssertionError) as error:
        raise UsageError(f"device {device!r} is not available: {_first_line(error)}") from None
    return model.eval(), tokenizer


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _check_device_map(device_map) -> None:
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES:
        return
    if not isinstance(device_map, dict) or not device_map:
        raise UsageError(f"device_map {device_map!r} is neither one of {', '.join(DEVICE_MAP_STRATEGIES)} nor a "
                         'non-empty mapping of module names to devices (e.g. {"": "cpu"}).')
    for name, place in device_map.items():
        if place == "disk":
            continue
        try:
            torch.device(place)
        except (RuntimeError, TypeError):
            raise UsageError(f"device_map puts {name!r} on {place!r}, which is not a device; use cpu, cuda:N, N or "
                             "disk.") from None


def _offload_folder() -> Path:
    """A temporary folder for disk-offloaded weights, removed when the process exits."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="mamba-captum-offload-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
