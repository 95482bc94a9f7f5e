"""``python -m mamba_captum.evaluation.vision``: the image faithfulness suite (docs/faithfulness.md, "Images").

- ``--train shapes digits [--arch vim vmamba mambaout efficientvim mambavision]``: train the tiny models (default:
  the Vims) from their fixed seeds and save them into the package (:mod:`.vision_models`); the shipped weights are
  what this command writes.
- default: score every method on the shipped models (:mod:`.vision_compare`) and write the generated image
  section of ``docs/faithfulness.md``, its plots and ``docs/assets/faithfulness/images.json``
  (``--report-only`` rewrites the section from that file). ``--arch`` scores only those architectures and keeps
  the others' rows (and the commands that made them) from the ``images.json`` already in ``--assets``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..files import check_outputs
from .arguments import positive_int
from .models import weights_root
from .results import read_doc, read_image_results
from .vision_models import ARCHITECTURES, VISION_TASKS, save_vim, train_vim

# what --assets holds after a run
ASSET_FILES = ("images.json", "images_curves.png", "images_examples.png",
               *(f"images_examples_{arch}.png" for arch in ARCHITECTURES if arch != "vim"))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_captum.evaluation.vision",
                                     description="The image faithfulness suite on tiny vision SSMs (Vim, VMamba, "
                                                 "MambaOut, EfficientViM, MambaVision).")
    parser.add_argument("--train", nargs="+", choices=VISION_TASKS, default=None,
                        help="train and save these models instead of scoring")
    parser.add_argument("--arch", nargs="+", choices=ARCHITECTURES, default=None,
                        help="the architectures to train or score (training: default vim; scoring: default all, the "
                             "rows of the others kept from --assets' images.json)")
    parser.add_argument("--max-steps", type=positive_int, default=3000)
    parser.add_argument("--task", nargs="+", choices=VISION_TASKS, default=list(VISION_TASKS))
    parser.add_argument("--examples", type=positive_int, default=128, help="held-out images scored per task")
    parser.add_argument("--doc", type=Path, default=Path("docs/faithfulness.md"))
    parser.add_argument("--assets", type=Path, default=Path("docs/assets/faithfulness"))
    parser.add_argument("--weights", type=Path, default=None)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if args.train:
        for arch in args.arch or ["vim"]:
            for task in args.train:
                model, record = train_vim(task, max_steps=args.max_steps, arch=arch)
                folder = save_vim(model, record, args.weights)
                print(json.dumps(record), f"-> {folder}", flush=True)
        return
    from .vision_compare import BEGIN, END, evaluate_images, row_arch, write_image_report

    results = None
    try:  # before anything is run or written: no output may replace a shipped model's file or another output;
    # the doc must take the section, and --report-only's results be readable
        check_outputs([("--doc", args.doc)], [("--weights", args.weights or weights_root())],
                      [("--assets", args.assets, ASSET_FILES)])
        read_doc(args.doc, BEGIN, END)
        if args.report_only:
            results = read_image_results(args.assets / "images.json")
        elif args.arch and (args.assets / "images.json").exists():  # the other architectures' rows are kept
            results = read_image_results(args.assets / "images.json")
    except ValueError as error:  # FileClashError included
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    if args.report_only:
        write_image_report(results, args.doc, args.assets, results["command"])
        print(f"rewrote the image section of {args.doc} from {args.assets}/images.json")
        return
    archs = args.arch or list(ARCHITECTURES)
    kept = {"models": [], "rows": [], "commands": {}}
    if results is not None:
        old_commands = results.get("commands") or {}
        kept["models"] = [m for m in results["models"] if row_arch(m) not in archs]
        kept["rows"] = [r for r in results["rows"] if row_arch(r) not in archs]
        for arch in {row_arch(r) for r in kept["rows"]}:  # rows of a run before there were several: its command
            kept["commands"][arch] = old_commands.get(arch) or dict(command=results["command"],
                                                                    seconds=results.get("seconds", "?"))
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m mamba_captum.evaluation.vision", *given])
    results = {"models": [], "rows": [], "commands": {}}
    total = time.perf_counter()
    for arch in archs:
        start = time.perf_counter()
        scored = evaluate_images(args.task, examples=args.examples, weights_root=args.weights,
                                 log=lambda row: print(row, flush=True), archs=[arch])
        results["models"] += scored["models"]
        results["rows"] += scored["rows"]
        results["commands"][arch] = dict(command=command, seconds=round(time.perf_counter() - start, 1))
    results["command"] = command
    results["seconds"] = round(time.perf_counter() - total, 1)
    results = {**results, "models": kept["models"] + results["models"], "rows": kept["rows"] + results["rows"],
               "commands": {**kept["commands"], **results["commands"]}}
    write_image_report(results, args.doc, args.assets, results["command"], args.weights)
    print(f"wrote the image section of {args.doc} and {args.assets}/images.json")


if __name__ == "__main__":
    main()
