"""The files a command reads and writes: outputs checked against the inputs (no output replaces an input, a file of
the checkpoint folder or another output) and checked writable, and a JSONL dataset read and checked, before any model
work; the HTML report written at the end, whole or not at all (:mod:`mamba_captum.files`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..usage import UsageError
from ..files import FileClashError, check_folder_writable, check_outputs, write_atomically


def check_paths(outputs, inputs, folders=()) -> None:
    """:func:`mamba_captum.files.check_outputs` (the options' (name, path) pairs), its refusal as a
    :class:`UsageError`; called before anything is written or loaded."""
    try:
        check_outputs(outputs, inputs, folders)
    except FileClashError as error:
        raise UsageError(str(error)) from None


def writable_file(path: Path) -> Path:
    """Check an output file can be written before any model work (the parent is created; a file this check creates
    is removed again, so a run refused later leaves no empty output behind). A link whose file is not there yet is
    written through later (the file created, the link kept); this check creates neither."""
    if str(path) == "-":  # argparse hands "-" over as a file name: the output would be a file called "-"
        raise UsageError("'-' is not standard output here; give a file name (e.g. report.html).")
    try:
        if path.is_dir():
            raise UsageError(f"{str(path)!r} is a directory; give a file name.")
        if path.is_symlink() and not path.exists():  # a dangling link: its target's folder must take the file
            _check_link_target(path)
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with path.open("a", encoding="utf-8"):
            pass
        if not existed:
            path.unlink()
        real = Path(os.path.realpath(path))
        if real.is_file() or not real.exists():  # replaced by a temporary beside it, which must be creatable
            check_folder_writable(real.parent)
    except OSError as error:
        raise UsageError(f"cannot write {str(path)!r}: {error.strerror or error}.") from None
    return path


def _check_link_target(link: Path) -> None:
    """A link to no file: the file it names is created by the write (the link kept), so that file's folder must
    exist and take a new file; nothing is created here but the probe, removed again."""
    target = Path(os.path.realpath(link))
    if os.path.lexists(target):  # realpath stopped at a link: the links go round in a loop
        raise UsageError(f"{str(link)!r} is a symbolic link that leads round in a loop; give a file name.")
    if not target.parent.is_dir():
        raise UsageError(f"{str(link)!r} links to {str(target)!r}, whose folder does not exist; create it or give "
                         "another file name.")
    check_folder_writable(target.parent)


def writable_dir(path: Path) -> Path:
    """Create an output folder and check a file can be written in it, before any model work."""
    try:
        check_folder_writable(path)
    except OSError as error:
        raise UsageError(f"cannot write into {str(path)!r}: {error.strerror or error}.") from None
    return path


def read_dataset(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) for each non-empty line; every row checked before any model work."""
    if path.is_dir():
        raise UsageError(f"dataset {str(path)!r} is a directory; give a JSONL file.")
    if not path.exists():  # a pipe (--dataset <(...)) exists without being a regular file, and reads as one
        raise UsageError(f"dataset {str(path)!r} does not exist.")
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first line's JSON
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as error:
        raise UsageError(f"dataset {str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start}).") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}:{number} is not JSON ({error.msg}).") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UsageError(f'{path}:{number} has no "text" string; each line must be {{"text": ..., '
                             '"target": ... (optional)}.')
        rows.append((number, row))
    if not rows:
        raise UsageError(f"dataset {str(path)!r} holds no lines.")
    return rows


def write_report(explanations, out: Path, title: str, notes=()):
    """The HTML report of ``explanations`` at ``out``; ``notes``: paragraphs shown under the title."""
    from ..html_report import render_html

    write_atomically(out, render_html(explanations, title=title, notes=notes))
    print(f"report: {out}")
