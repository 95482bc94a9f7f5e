"""Regenerate the shipped tiny classifiers: ``python -m mamba_captum.evaluation.train [--family F ...] [--task T ...]``.

Trains each family × task from fixed seeds (models.py), prints one record per model and saves it with
``save_pretrained`` under ``mamba_captum/evaluation/weights/`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .arguments import positive_int
from .models import FAMILIES, save_classifier, train_classifier
from .tasks import TASKS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--task", nargs="*", default=list(TASKS), choices=list(TASKS) + ["bbc_news"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=positive_int, default=1500)
    parser.add_argument("--out", type=Path, default=None, help="folder for the weights (default: the package's)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    for task in args.task:
        for family in args.family:
            model, record = train_classifier(family, task, seed=args.seed, max_steps=args.max_steps,
                                             log=print if args.verbose else None)
            path = save_classifier(model, record, args.out)
            print(json.dumps(record), "->", path, flush=True)


if __name__ == "__main__":
    main()
