"""Loading the checkpoint a command names: on --device, or dispatched by accelerate (--device-map, --max-memory,
--offload-folder)."""
from __future__ import annotations

import json

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


def load_model(args, model_dir):
    """The checkpoint on --device, or dispatched by accelerate with --device-map."""
    from ..explain import load

    if args.device_map is not None and args.device is not None:
        raise UsageError("give --device or --device-map, not both (--device-map places every layer itself).")
    device = "cpu" if args.device is None else args.device
    return load(model_dir, device=device, dtype=args.dtype, device_map=parse_device_map(args.device_map),
                max_memory=parse_max_memory(args.max_memory), offload_folder=args.offload_folder)
