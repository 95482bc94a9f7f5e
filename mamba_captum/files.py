"""The files the applications write: an output never replaces an input, and is written whole or not at all.

- :func:`check_outputs`: before any work, every output path against every input (files, and checkpoint folders whose
  files an output must not replace) and against the other outputs, with symlinks, ``..`` and, on a case-insensitive
  file system, case resolved; :class:`FileClashError` (one line naming both options and the path) on a match.
- :func:`atomic_target` / :func:`write_atomically`: the content goes to a temporary file beside the output, renamed
  onto it (``os.replace``) once complete, so an interrupted run leaves the old file whole; the temporary is removed
  on failure.

The command line (``mamba_captum.cli``) and the evaluation suite (``mamba_captum.evaluation``) both use it.
"""
from __future__ import annotations

import os
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator


class FileClashError(ValueError):
    """An output would replace an input, a file of an input folder, or another output."""


def is_case_insensitive(directory) -> bool:
    """Whether the file system holding the existing ``directory`` matches names regardless of case (macOS and
    Windows by default): the directory (or its nearest ancestor with a cased letter in its name) is looked up under
    its other case, which writes nothing."""
    path = os.path.realpath(directory)
    while True:
        parent, name = os.path.split(path)
        if name != name.swapcase():
            try:
                return os.path.samefile(path, os.path.join(parent, name.swapcase()))
            except OSError:  # the other case does not exist: names are case-sensitive here
                return False
        if not name or parent == path:  # the root, and no cased name on the way: the platform's convention
            return os.path.normcase("A") == "a"
        path = parent


def path_key(path) -> tuple:
    """What a path names, comparable between paths: (device, inode) of its longest existing part after symlinks and
    ``..`` are resolved (so two existing paths compare as :func:`os.path.samefile` does), then the names still to be
    created, case-folded where the file system ignores case."""
    real = Path(os.path.realpath(path))
    existing, missing = real, []
    while True:
        try:
            found = os.stat(existing)
            break
        except OSError:  # not there (yet): the name the write would create
            if existing.parent == existing:
                raise
            missing.append(existing.name)
            existing = existing.parent
    if missing and is_case_insensitive(existing):
        missing = [name.casefold() for name in missing]
    return found.st_dev, found.st_ino, tuple(reversed(missing))


def _identity(path):
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _inside(output, folder) -> bool:
    """Whether the existing ``output`` is a file of ``folder``: below it (through the link's folder or the link's
    target), or one of its entries' targets (a Hugging Face cache snapshot links its files to ``blobs/``)."""
    folder_id, output_id = _identity(folder), _identity(output)
    if folder_id is None or output_id is None or not os.path.isdir(folder):
        return False
    for start in (os.path.realpath(output), os.path.realpath(os.path.dirname(os.path.abspath(output)))):
        if any(_identity(above) == folder_id for above in [start, *Path(start).parents]):
            return True
    try:
        return any(_identity(entry.path) == output_id for entry in os.scandir(folder))
    except OSError:
        return False


def check_outputs(outputs: Iterable[tuple[str, object]], inputs: Iterable[tuple[str, object]] = (),
                  folders: Iterable[tuple[str, object, Iterable[str]]] = ()) -> None:
    """Refuse, before anything is written, an output that would replace what a run reads or another output.

    Args:
        outputs: (option, path) of each file to be written; a None path is skipped.
        inputs: (option, path) of each file or folder read (a checkpoint folder: no output may be the folder or
            replace a file in it); a None path is skipped.
        folders: (option, path, names) of each output folder and the file names written into it: the folder must be
            no input and no other output, and its files are checked as outputs.
    Raises:
        FileClashError: one line naming both options and the path.
    """
    inputs = [(option, Path(path)) for option, path in inputs if path is not None]
    folders = [(option, Path(path), tuple(names)) for option, path, names in folders if path is not None]
    files = [(option, Path(path)) for option, path in outputs if path is not None]
    files += [(option, path / name) for option, path, names in folders for name in names]
    read = {}
    for option, path in inputs:
        read.setdefault(path_key(path), option)
    written = {}
    for option, path, is_file in [(o, p, False) for o, p, _ in folders] + [(o, p, True) for o, p in files]:
        key = path_key(path)
        if key in read:
            raise FileClashError(f"{read[key]} and {option} both name {str(path)!r}; an output never replaces "
                                 f"an input: give {option} another path.")
        # an output folder inside a checkpoint folder replaces nothing there: only its files are checked for that
        for folder_option, folder in inputs if is_file else ():
            if _inside(path, folder):
                raise FileClashError(f"{option} {str(path)!r} is a file of {folder_option} {str(folder)!r} and "
                                     "would replace it; write outputs outside that folder.")
        if key in written:
            raise FileClashError(f"{written[key]} and {option} both name {str(path)!r}; give them different files.")
        written[key] = option


def _probe_name(target: Path) -> Path:
    return target.with_name(f".{target.stem}.{uuid.uuid4().hex[:8]}.tmp{target.suffix}")


@contextmanager
def atomic_target(path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write the whole output to; renamed onto ``path`` (``os.replace``) when
    the block ends, removed if it raises, so ``path`` holds the old file or the new one, never a part.

    Through a symlink the file it points to is replaced (the link is kept); an existing target keeps its permission
    bits. A target that is not a regular file (``/dev/stdout``, a pipe) cannot be replaced and is yielded itself.
    """
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file():
        yield target
        return
    temporary = _probe_name(target)
    try:
        yield temporary
        if target.exists():
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temporary, target)
    except BaseException:  # Ctrl-C included: no temporary left behind
        temporary.unlink(missing_ok=True)
        raise


def write_atomically(path, content: str | bytes, encoding: str = "utf-8") -> None:
    """Write ``content`` (text in ``encoding``, or bytes) to ``path`` whole or not at all (:func:`atomic_target`),
    flushed to the disk before the rename."""
    data = content.encode(encoding) if isinstance(content, str) else content
    with atomic_target(path) as temporary, open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        if temporary.is_file():  # a pipe or a terminal has nothing to sync
            os.fsync(handle.fileno())


def check_folder_writable(folder) -> None:
    """Create ``folder`` (and its parents) and check a file can be created in it, as :func:`atomic_target` will;
    ``OSError`` if not. The probe file is removed again."""
    folder = Path(os.path.realpath(folder))
    folder.mkdir(parents=True, exist_ok=True)
    probe = _probe_name(folder / "write-test")
    probe.touch(exist_ok=False)
    probe.unlink()


def json_kind(value) -> str:
    """The JSON name of a parsed value's type (for messages about a damaged JSON file)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string"}.get(type(value), "number")
