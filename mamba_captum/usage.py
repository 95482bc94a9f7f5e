"""What the command lines and the library share about a bad request, importable without torch: :class:`UsageError`
(re-exported by :mod:`mamba_captum.explain`), the argparse type :func:`positive_int`, :func:`check_device` and the
parser of ``mamba-captum evaluate`` (:func:`evaluate_parser`, also ``python -m mamba_captum.evaluation``'s).

The ``mamba-captum`` command checks what it was asked before it imports the library (torch, transformers, captum:
seconds), so that a usage error answers at once; these are the pieces of those checks that the library and the
evaluation suite use too (the evaluation package imports torch on import, so its parser cannot live there).
"""
from __future__ import annotations

import argparse
from pathlib import Path

# mamba_captum.evaluation's FAMILIES and TASKS (+ bbc_news), named here without importing it (torch);
# tests/test_cli_speed.py checks they are the same
EVALUATION_FAMILIES = ("mamba", "mamba2", "rwkv", "recurrent_gemma", "jamba", "qwen3_next", "lfm2", "xlstm", "gla",
                       "retnet", "rwkv7", "mamba3")
EVALUATION_TASKS = ("needle", "negation", "long_range", "counting", "real_words", "gated_recall", "conjunction",
                    "order", "bbc_news")


class UsageError(ValueError):
    """A problem with what the user asked for (a path, a target, a text): the CLI prints it as one line."""


def positive_int(text: str) -> int:
    """argparse ``type=`` of a count or a size (examples, training steps, pixels): a whole number of at least 1.

    Raises:
        argparse.ArgumentTypeError: anything else, with what was given.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one of at least 1.") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}.")
    return value


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    if lines[0].endswith(":") and len(lines) > 1:  # "Validation error for field 'x':" says nothing alone
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def check_device(device) -> torch.device:  # noqa: F821 (torch is imported when called)
    """``device`` (a name such as ``"cpu"``, ``"cuda:1"``, or a ``torch.device``) as a torch device that can hold
    this run's tensors, else :class:`UsageError` (before any loading, so a typo costs no model load). Imports torch
    (about a second), not transformers or captum."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device {device!r} is not available: it is not a torch device name; choose cpu, cuda or "
                         "cuda:N.") from None
    if parsed.type == "meta":  # meta tensors have shapes but no values: nothing to explain
        raise UsageError(f"device {device!r} holds no data (only tensor shapes), so nothing can be computed on it; "
                         "choose cpu, cuda or cuda:N.")
    if parsed.type == "cuda" and torch.cuda.is_available() and (parsed.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"device {device!r} is not available: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    try:
        torch.empty(1, device=parsed)
    except Exception as error:  # AssertionError (no CUDA build), NotImplementedError (no backend), ModuleNotFoundError
        reason = _first_line(error).split(". ")[0]
        raise UsageError(f"device {device!r} is not available on this machine ({reason}); choose cpu or an "
                         "available cuda:N.") from None
    return parsed


def evaluate_parser() -> argparse.ArgumentParser:
    """The arguments of ``mamba-captum evaluate`` / ``python -m mamba_captum.evaluation``
    (:func:`mamba_captum.evaluation.report.main`), built without importing the evaluation suite: the command line
    answers --help and refuses a bad value at once."""
    parser = argparse.ArgumentParser(prog="mamba-captum evaluate", description="The faithfulness comparison "
                                     "(docs/faithfulness.md) on the shipped tiny classifiers.")
    # choices: an unknown name must not run nothing and then overwrite the committed results with an empty report
    parser.add_argument("--family", nargs="+", default=list(EVALUATION_FAMILIES), choices=EVALUATION_FAMILIES)
    parser.add_argument("--task", nargs="+", default=list(EVALUATION_TASKS), choices=EVALUATION_TASKS)
    parser.add_argument("--examples", type=positive_int, default=64, help="held-out examples per task (default 64)")
    parser.add_argument("--no-perturbation", action="store_true", help="localisation only (much faster)")
    parser.add_argument("--doc", type=Path, default=Path("docs/faithfulness.md"))
    parser.add_argument("--assets", type=Path, default=Path("docs/assets/faithfulness"))
    parser.add_argument("--weights", type=Path, default=None,
                        help="the classifiers' folder (default: the shipped ones, mamba_captum/evaluation/weights)")
    parser.add_argument("--report-only", action="store_true", help="rewrite the tables and plots from the existing "
                        "results.json without running any model")
    parser.add_argument("--update", action="store_true", help="keep the other models' rows of the existing "
                        "results.json and replace only the models run now")
    parser.add_argument("--method", nargs="+", default=None, metavar="NAME",
                        help="run only the methods whose name contains one of these strings (with --update, only "
                             "their rows are replaced; the other methods' rows of the same models are kept)")
    parser.add_argument("--restart", action="store_true", help="discard the results an interrupted run left in "
                        "ASSETS/results.partial.jsonl instead of resuming from them")
    return parser
