"""The command line's arguments: one parser, a subcommand each (``mamba-captum demo | explain | matrices``; ``evaluate``
parses its own, :func:`mamba_captum.usage.evaluate_parser`)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from .._version import __version__
from ..usage import positive_int

# Parsing imports only argparse and these light modules (--help, --version and usage errors answer at once): the
# choices are named here rather than read from mamba_captum.explain, which imports torch and transformers;
# tests/test_cli.py checks that they are explain's DTYPES and METHODS.
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
METHOD_NAMES = ("attribution", "raw", "rollout", "selection", "lrp")  # the default first

# The largest side of a `matrices` PNG: 4096² RGB pixels are 48 MiB in memory and seconds to encode; a bigger map
# shows no more (one entry per token) and would need gigabytes (a 5-token text at --scale 100000 asks for 750 GB).
MAX_MAP_PIXELS = 4096

COMMANDS = {"demo": "explain the bundled demo model's test sentences and write an HTML report",
            "explain": "explain texts or a JSONL dataset with a local HF checkpoint directory",
            "matrices": "save each layer's implicit-attention map of a text as a PNG",
            "evaluate": "the faithfulness comparison on the shipped tiny classifiers (docs/faithfulness.md)"}


def model_path(text: str) -> str:
    """argparse ``type=`` of --model: the path as given; ``demo``, unless a file or folder of that name is here, is
    the bundled demo model's folder (mamba_captum.demo.model_dir())."""
    if text == "demo" and not os.path.lexists(text):
        from ..demo import model_dir

        return str(model_dir())
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2 (argparse prints usage first)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common(parser, model_required=True):
    if model_required:
        parser.add_argument("--model", required=True, type=model_path,
                            help="a local HF checkpoint directory (save_pretrained), or demo: the bundled demo model; "
                            "with --image, an image model's checkpoint file (Vim, VMamba, EfficientViM, MambaOut, "
                            "MambaVision: .pth or .safetensors; a training.json beside it gives the image size and "
                            "class names), or an architecture name with --weights")
    parser.add_argument("--formulation", choices=("unified", "hidden"), default="unified")
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default cpu; under "
                        "accelerate launch with cuda, each process its own GPU)")
    parser.add_argument("--device-map", default=None, metavar="MAP",
                        help="load the model dispatched by accelerate: auto, balanced, sequential, or a JSON object "
                        'module name -> device / "cpu" / "disk" (docs/scale.md)')
    parser.add_argument("--max-memory", default=None, metavar="SIZES",
                        help="with --device-map auto: the most each device holds, e.g. 0=20GiB,cpu=60GiB (the rest "
                        "is offloaded to disk)")
    parser.add_argument("--offload-folder", type=Path, default=None,
                        help="where disk-offloaded weights go (default: a temporary folder, removed at exit)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="weights' dtype (default float32)")


def _method_args(parser):
    parser.add_argument("--method", action="append", choices=METHOD_NAMES,
                        help="attribution (MambaAttribution's default recipe), raw, rollout, selection or lrp; repeat for "
                        "several (default: every one the model supports; raw, rollout and attribution for an image)")
    parser.add_argument("--target", default=None,
                        help="what to explain: a label word / token, or an id (default: the prediction)")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="a causal LM's candidate answer tokens (default: config.label_words if set); with "
                        "--image, the class names in class order (default: the checkpoint's training.json)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mamba-captum", description="Implicit-attention explanations of Mamba-family models.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mamba-captum {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, text in COMMANDS.items():
        sub = commands.add_parser(name, help=text, description=text, add_help=name != "evaluate")
        if name == "demo":
            sub.add_argument("--out", type=Path, default=Path("mamba-captum-demo.html"), help="the HTML report")
            _common(sub, model_required=False)
        elif name == "explain":
            _common(sub)
            _method_args(sub)
            source = sub.add_mutually_exclusive_group(required=True)
            source.add_argument("--text", action="append", help="a text to explain (repeatable)")
            source.add_argument("--dataset", type=Path, help='a JSONL file, one {"text": ..., "target": ...} a line')
            source.add_argument("--image", action="append", type=Path,
                                help="an image file (PNG, JPEG, ...) to explain with an image model's checkpoint "
                                "(repeatable)")
            sub.add_argument("--img-size", type=positive_int, default=None,
                             help="with --image: the Vim's training image size (default: the img_size of the "
                             "training.json beside the checkpoint, else 224)")
            sub.add_argument("--weights", type=Path, default=None,
                             help="with --image and an architecture name as --model (vmamba_tiny, efficientvim_m2, "
                             "mambaout_femto, ...): its weights file (.pth, .safetensors); checked to be that "
                             "variant's")
            sub.add_argument("--out", type=Path, default=None, help="write an HTML report here")
            sub.add_argument("--jsonl", type=Path, default=None,
                             help="the results as JSONL (default with --dataset: DATASET.explained.jsonl); with "
                             "--dataset, a rerun skips the lines already there")
            sub.add_argument("--restart", action="store_true",
                             help="with --dataset: recompute every line, discarding the results of an earlier run")
        elif name == "matrices":
            _common(sub)
            sub.add_argument("--text", required=True)
            sub.add_argument("--out-dir", type=Path, default=Path("matrices"))
            sub.add_argument("--scale", type=positive_int, default=8,
                             help=f"pixels per map entry (default 8; a map is at most {MAX_MAP_PIXELS} pixels a side)")
    return parser
