"""Argument types of the command lines (``mamba-captum`` and the evaluation suite's ``python -m`` commands): a bad
value is argparse's usage error (one line, exit code 2) before anything is run or written."""
from __future__ import annotations

import argparse


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
