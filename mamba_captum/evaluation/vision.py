"""``python -m mamba_captum.evaluation.vision``: the image faithfulness suite (docs/faithfulness.md, "Images").

- ``--train shapes digits``: train the tiny Vims from their fixed seeds and save them into the package
  (:mod:`.vision_models`); the shipped weights are what this command writes.
- default: score every method on the shipped models (:mod:`.vision_compare`) and write the generated image
  section of ``docs/faithfulness.md``, its plots and ``docs/assets/faithfulness/images.json``
  (``--report-only`` rewrites the section from that file).
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
from .vision_models import VISION_TASKS, save_vim, train_vim

# what --assets holds after a run
ASSET_FILES = ("images.json", "images_curves.png", "images_examples.png")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_captum.evaluation.vision",
                                     description="The image faithfulness suite on tiny Vision Mamba models.")
    parser.add_argument("--train", nargs="+", choices=VISION_TASKS, default=None,
                        help="train and save these models instead of scoring")
    parser.add_argument("--max-steps", type=positive_int, default=3000)
    parser.add_argument("--task", nargs="+", choices=VISION_TASKS, default=list(VISION_TASKS))
    parser.add_argument("--examples", type=positive_int, default=128, help="held-out images scored per task")
    parser.add_argument("--doc", type=Path, default=Path("docs/faithfulness.md"))
    parser.add_argument("--assets", type=Path, default=Path("docs/assets/faithfulness"))
    parser.add_argument("--weights", type=Path, default=None)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if args.train:
        for task in args.train:
            model, record = train_vim(task, max_steps=args.max_steps)
            folder = save_vim(model, record, args.weights)
            print(json.dumps(record), f"-> {folder}", flush=True)
        return
    from .vision_compare import BEGIN, END, evaluate_images, write_image_report

    results = None
    try:  # before anything is run or written: no output may replace a shipped model's file or another output;
    # the doc must take the section, and --report-only's results be readable
        check_outputs([("--doc", args.doc)], [("--weights", args.weights or weights_root())],
                      [("--assets", args.assets, ASSET_FILES)])
        read_doc(args.doc, BEGIN, END)
        if args.report_only:
            results = read_image_results(args.assets / "images.json")
    except ValueError as error:  # FileClashError included
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    if args.report_only:
        write_image_report(results, args.doc, args.assets, results["command"])
        print(f"rewrote the image section of {args.doc} from {args.assets}/images.json")
        return
    start = time.perf_counter()
    results = evaluate_images(args.task, examples=args.examples, weights_root=args.weights,
                              log=lambda row: print(row, flush=True))
    given = sys.argv[1:] if argv is None else list(argv)
    results["command"] = " ".join(["python -m mamba_captum.evaluation.vision", *given])
    results["seconds"] = round(time.perf_counter() - start, 1)
    write_image_report(results, args.doc, args.assets, results["command"])
    print(f"wrote the image section of {args.doc} and {args.assets}/images.json")


if __name__ == "__main__":
    main()
