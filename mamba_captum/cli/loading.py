"""Loading the checkpoint a command names: on --device, or dispatched by accelerate (--device-map, --max-memory,
--offload-folder).

:func:`check_loading` refuses what is wrong with those options and with --model before the library is imported
(torch, transformers, captum: seconds), so that a usage error answers at once; :func:`load_model` then loads."""
from __future__ import annotations

import json
from pathlib import Path

from ..usage import UsageError, check_device

# mamba_captum.explain.DEVICE_MAP_STRATEGIES, named here without importing it (tests/test_cli_speed.py checks them)
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_device_map(text: str | None):
    """--device-map: a strategy name, or a JSON object module name -> device."""
    if text is None or not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--device-map {text!r} is not a JSON object ({error.msg}); e.g. "
                         '\'{"model.embeddings": "cpu", "model.layers": "disk"}\'.') from None


def parse_max_memory(text: str | None):
    """--max-memory 0=20GiB,cpu=60GiB -> {0: "20GiB", "cpu": "60GiB"}."""
    if text is None:
        return None
    sizes = {}
    for item in text.split(","):
        device, equals, size = item.strip().partition("=")
        if not equals or not device or not size:
            raise UsageError(f"--max-memory {text!r}: give device=size pairs, e.g. 0=20GiB,cpu=60GiB.")
        sizes[int(device) if device.isdigit() else device] = size
    return sizes


def check_labels(labels) -> None:
    """--labels: each name once (a repeated label word would be both a candidate and its own rival; a repeated class
    name would make --target NAME ambiguous)."""
    if labels:
        repeated = sorted({word for word in labels if labels.count(word) > 1})
        if repeated:
            raise UsageError(f"the labels {list(labels)} repeat {', '.join(map(repr, repeated))}; give each label "
                             "once.")


def check_options(args) -> None:
    """--device-map, --max-memory and --device together, without torch (:func:`check_device` comes last)."""
    if args.device_map is not None and args.device is not None:
        raise UsageError("give --device or --device-map, not both (--device-map places every layer itself).")
    device_map = parse_device_map(args.device_map)
    if isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
        raise UsageError(f"--device-map {device_map!r} is neither one of {', '.join(DEVICE_MAP_STRATEGIES)} nor a "
                         'JSON object of module names to devices (e.g. \'{"": "cpu"}\').')
    if device_map == {}:
        raise UsageError(f"--device-map {args.device_map!r} names no module; give a non-empty JSON object of module "
                         'names to devices (e.g. \'{"": "cpu"}\').')
    parse_max_memory(args.max_memory)
    if args.max_memory is not None and args.device_map is None:  # load()'s words: tests/test_dispatch.py
        raise UsageError("max_memory (--max-memory) bounds what device_map='auto' places per device; give a "
                         "device_map (--device-map auto) with it.")
    if args.offload_folder is not None and args.device_map is None:  # it would be ignored: said instead
        raise UsageError("--offload-folder holds the weights --device-map puts on disk; without --device-map the "
                         "model is loaded whole on --device: give --device-map (e.g. auto) with it, or leave it out.")


def check_device_option(device: str | None) -> None:
    """--device: no check for the default (cpu), else :func:`mamba_captum.usage.check_device`, which imports torch
    (about a second, not transformers or captum): only torch knows whether a device name is usable here. Called after
    every check that needs no torch, so that those answer at once whatever the device."""
    if device is not None and device != "cpu":
        check_device(device)


def check_model_dir(args, path) -> None:
    """--model of a text command: a checkpoint folder with a config.json (load()'s first checks, before the import)."""
    path = Path(path)
    if path.is_file():  # a text command needs a folder; say what the file is for
        raise UsageError(_file_for_texts(args, str(path)))
    if not path.is_dir():
        raise UsageError(f"model directory {str(path)!r} does not exist; pass a folder written by save_pretrained.")
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} holds no config.json: it is not a HF checkpoint directory.")


def check_loading(args, model_dir, device: bool = True) -> None:
    """Everything about loading ``model_dir`` that can be refused before the model is: the folder, --device-map,
    --max-memory, then (unless ``device`` is False) --device (:func:`check_device_option`, which may import torch)."""
    check_model_dir(args, model_dir)
    check_options(args)
    if device:
        check_device_option(args.device)


def _file_for_texts(args, path: str) -> str:
    """Why a file given as --model cannot explain texts, and what to give instead."""
    if Path(path).suffix.lower() in (".pth", ".pt"):
        if args.command == "matrices":
            return (f"--model {path!r} is a Vision Mamba checkpoint file (.pth), which explains images, not texts: "
                    f"`matrices` needs an HF checkpoint directory; explain images with `mamba-captum explain --model "
                    f"{path} --image FILE`.")
        given = "--dataset" if getattr(args, "dataset", None) is not None else "--text"
        return (f"--model {path!r} is a Vision Mamba checkpoint file (.pth): it explains --image files, not "
                f"{given}; give --image FILE, or an HF checkpoint directory as --model for texts.")
    return (f"--model {path!r} is a file, not a checkpoint directory: give the folder written by save_pretrained "
            "(with --image, a Vision Mamba .pth file).")


def load_model(args, model_dir):
    """The checkpoint on --device, or dispatched by accelerate with --device-map (after :func:`check_loading`)."""
    from ..explain import load

    device = "cpu" if args.device is None else args.device
    return load(model_dir, device=device, dtype=args.dtype, device_map=parse_device_map(args.device_map),
                max_memory=parse_max_memory(args.max_memory), offload_folder=args.offload_folder)
