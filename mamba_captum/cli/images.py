"""``mamba-captum explain --image``: explain image files with a Vision Mamba checkpoint file.

What the library says in Python words (``img_size=``) is said here in the CLI's (``--img-size``); its
:class:`~mamba_captum.vision.ImageNotice` warnings (a grayscale image copied to RGB, a small image upscaled, an
--img-size that differs from training.json's) are one line each on stderr.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from pathlib import Path

from ..files import write_atomically
from ..usage import UsageError
from .files import check_paths, writable_file
from .loading import check_device_option, check_labels
from .notices import quiet_library, scoped_warnings

# mamba_captum.explain.images.METHODS, named here without importing it (tests/test_cli_speed.py checks them)
IMAGE_METHOD_NAMES = ("raw", "rollout", "attribution")


def explain_images_command(args):
    """``explain --image``: every check that needs no model (paths, options, methods, then --device), then the
    library is imported and each image explained."""
    weights = getattr(args, "weights", None)
    checkpoint = args.model if weights is None else weights
    # no output may replace the checkpoint, an image or the other output
    check_paths([("--jsonl", args.jsonl), ("--out", args.out)],
                [("--model" if weights is None else "--weights", checkpoint),
                 *(("--image", image) for image in args.image)],
                [("--offload-folder", args.offload_folder, ())])
    for path in (args.jsonl, args.out):
        if path is not None:
            writable_file(path)
    for image in args.image:  # every file, before the model is loaded
        if not image.is_file():
            raise UsageError(f"no image file at {str(image)!r}.")
    if args.device_map is not None:
        raise UsageError("--device-map loads HF checkpoints; a Vision Mamba file is loaded on --device.")
    if args.max_memory is not None:  # --device-map is refused above: nothing for it to bound
        raise UsageError("--max-memory bounds what --device-map places on each device; a Vision Mamba file is loaded "
                         "whole on --device: leave it out.")
    if args.offload_folder is not None:  # nothing is offloaded without --device-map
        raise UsageError("--offload-folder holds the weights --device-map puts on disk; a Vision Mamba file is loaded "
                         "whole on --device: leave it out.")
    if weights is not None:  # --model names the architecture: the file is --weights
        if os.path.lexists(args.model):
            raise UsageError(f"--weights goes with an architecture name as --model (vmamba_tiny, efficientvim_m2, "
                             f"...); {args.model!r} is a file or folder: pass the checkpoint file as --model alone.")
        if not Path(weights).is_file():
            raise UsageError(f"no weights file at {str(weights)!r}; pass a .pth or .safetensors file.")
    elif Path(args.model).is_dir():
        raise UsageError(f"--model {args.model!r} is a folder (an HF checkpoint, which explains --text); --image needs "
                         "a Vision Mamba checkpoint file (.pth).")
    elif not Path(args.model).is_file():  # load_vim_file's words, before the import
        raise UsageError(f"no Vim checkpoint file at {args.model!r}; pass a .pth file (the weights under 'model').")
    unavailable = [name for name in args.method or () if name not in IMAGE_METHOD_NAMES]
    if unavailable:
        raise UsageError(f"--method {unavailable[0]} is not available for images (a Vision Mamba checkpoint); "
                         f"choose among {', '.join(IMAGE_METHOD_NAMES)}.")
    check_labels(args.labels)
    check_device_option(args.device)
    quiet_library()
    from ..explain.images import explain_images, load_vim_file
    from ..html_report import probability_text, render_image_html

    device = "cpu" if args.device is None else args.device
    with _notices():
        try:
            model = load_vim_file(checkpoint, device=device, dtype=args.dtype, img_size=args.img_size,
                                  variant=None if weights is None else args.model)
        except UsageError as error:
            raise UsageError(cli_words(str(error))) from None
    if args.labels:  # class names, in class order
        if len(args.labels) != model.num_classes:
            raise UsageError(f"--labels gives {len(args.labels)} names for a model of {model.num_classes} classes.")
        model.class_names = list(args.labels)
    with _notices():
        explanations = explain_images(model, [str(p) for p in args.image], target=args.target,
                                      methods=args.method or IMAGE_METHOD_NAMES,
                                      formulation=args.formulation)
    for item in explanations:
        item.settings["model"] = f"{Path(checkpoint).name} ({item.settings['model']})"
        peaks = ", ".join(f"{name} {_peak_pixel(scores)}" for name, scores in item.relevance.items())
        explained = item.target if item.target == item.prediction else \
            f"{item.target} ({probability_text(item.target_probability)})"
        print(f"{item.path}: class {item.prediction} ({probability_text(item.probability)}); explained: {explained}; "
              f"most relevant pixel (largest |relevance|: row, column, score): {peaks}")
    if args.jsonl is not None:
        write_atomically(args.jsonl, "".join(json.dumps(item.to_dict()) + "\n" for item in explanations))
        print(f"results: {args.jsonl} ({len(explanations)} lines)")
    if args.out is not None:
        write_atomically(args.out, render_image_html(explanations, title=f"mamba-captum: {Path(checkpoint).name}"))
        print(f"report: {args.out}")


def cli_words(text: str) -> str:
    """A library message in the CLI's words: the keyword ``img_size=`` is the option ``--img-size``; a hint to pass
    ``stride=`` is dropped (the CLI has no --stride: it loads models whose patches leave no gaps, as released Vims)."""
    text = re.sub(r", or pass stride=[^;.]*", "", text)
    return re.sub(r"\bimg_size=(?=\w)", "--img-size ", text).replace("img_size=", "--img-size")


@contextlib.contextmanager
def _notices():
    """The :class:`ImageNotice` warnings of the block as one line each on stderr (even when the block fails: the
    notice may explain the error); other warnings as Python shows them."""
    from ..vision.images import ImageNotice

    caught = []
    try:
        with scoped_warnings(record=True) as (caught, own):
            warnings.simplefilter("always", ImageNotice)  # each image's notice, not only the first of a kind
            own.append(warnings.filters[0])
            yield
    finally:
        for warning in caught:
            if issubclass(warning.category, ImageNotice):
                text = cli_words(str(warning.message).removeprefix("mamba_captum: "))
                print(f"mamba-captum explain: note: {text}", file=sys.stderr)
            else:
                warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


def _peak_pixel(scores) -> str:
    """``(row, column) value`` of the pixel of largest |relevance| in ``scores`` (H, W), its value signed: a pixel
    that lowers the score (negative) can be the largest, e.g. in a raw map whose scores are all negative."""
    row, column = divmod(int(scores.abs().argmax()), scores.shape[-1])
    return f"({row}, {column}) {float(scores[row, column]):+.2g}"
