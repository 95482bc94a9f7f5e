"""Loading the checkpoint a command names: on --device, or dispatched by accelerate (--device-map, --max-memory,
--offload-folder)."""
from __future__ import annotations

import json
from pathlib import Path

from ..explain import UsageError


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
    """The checkpoint on --device, or dispatched by accelerate with --device-map."""
    from ..explain import load

    if Path(model_dir).is_file():  # a text command needs a folder; say what the file is for
        raise UsageError(_file_for_texts(args, str(model_dir)))
    if args.device_map is not None and args.device is not None:
        raise UsageError("give --device or --device-map, not both (--device-map places every layer itself).")
    device = "cpu" if args.device is None else args.device
    return load(model_dir, device=device, dtype=args.dtype, device_map=parse_device_map(args.device_map),
                max_memory=parse_max_memory(args.max_memory), offload_folder=args.offload_folder)
