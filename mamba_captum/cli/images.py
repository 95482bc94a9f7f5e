"""``mamba-captum explain --image``: explain image files with a Vision Mamba checkpoint file."""
from __future__ import annotations

import json
from pathlib import Path

from ..explain import UsageError
from ..files import write_atomically
from .files import check_paths, writable_file


def explain_images_command(args):
    from ..html_report import render_image_html
    from ..explain.images import explain_images, load_vim_file

    # no output may replace the checkpoint, an image or the other output
    check_paths([("--jsonl", args.jsonl), ("--out", args.out)],
                [("--model", args.model), *(("--image", image) for image in args.image)],
                [("--offload-folder", args.offload_folder, ())])
    for path in (args.jsonl, args.out):
        if path is not None:
            writable_file(path)
    for image in args.image:  # every file, before the model is loaded
        if not image.is_file():
            raise UsageError(f"no image file at {str(image)!r}.")
    if args.device_map is not None:
        raise UsageError("--device-map loads HF checkpoints; a Vision Mamba file is loaded on --device.")
    device = "cpu" if args.device is None else args.device
    model = load_vim_file(args.model, device=device, dtype=args.dtype, img_size=args.img_size)
    if args.labels:  # class names, in class order
        if len(args.labels) != model.num_classes:
            raise UsageError(f"--labels gives {len(args.labels)} names for a model of {model.num_classes} classes.")
        model.class_names = list(args.labels)
    explanations = explain_images(model, [str(p) for p in args.image], target=args.target,
                                  methods=args.method or ("raw", "rollout", "attribution"),
                                  formulation=args.formulation)
    for item in explanations:
        item.settings["model"] = f"{Path(args.model).name} ({item.settings['model']})"
        peaks = {name: _peak_patch(scores) for name, scores in item.relevance.items()}
        print(f"{item.path}: class {item.prediction} (p = {item.probability:.3f}); explained: {item.target}; "
              "most relevant pixel (row, column): " + ", ".join(f"{k} {v}" for k, v in peaks.items()))
    if args.jsonl is not None:
        write_atomically(args.jsonl, "".join(json.dumps(item.to_dict()) + "\n" for item in explanations))
        print(f"results: {args.jsonl} ({len(explanations)} lines)")
    if args.out is not None:
        write_atomically(args.out, render_image_html(explanations, title=f"mamba-captum: {Path(args.model).name}"))
        print(f"report: {args.out}")


def _peak_patch(scores) -> tuple[int, int]:
    flat = int(scores.abs().argmax())
    return divmod(flat, scores.shape[-1])
