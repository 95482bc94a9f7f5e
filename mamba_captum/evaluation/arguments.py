"""Argument types of the command lines (``mamba-captum`` and the evaluation suite's ``python -m`` commands): a bad
value is argparse's usage error (one line, exit code 2) before anything is run or written.

:func:`positive_int` is :func:`mamba_captum.usage.positive_int`, defined where torch is not imported (this package
imports it), so that ``mamba-captum`` checks its arguments at once."""
from __future__ import annotations

from ..usage import positive_int

__all__ = ["positive_int"]
