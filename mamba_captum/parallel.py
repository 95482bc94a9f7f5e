"""Work over a dataset in several processes (``accelerate launch`` / ``torchrun``), resumable, gathered in order.

Each job is a JSON-able dict naming one unit of work (a dataset line and what to compute on it; a model of the
faithfulness suite). The processes take the jobs not done yet one at a time, first come first served (each claims
a job by creating its file in ``<output>.claims/``, which only one process can; models of the suite take very
different times, so a fixed share would leave one process waiting), append each result as one JSON line to their
own part file (``<output>.part<i>``) as they go, and once every process is done the main process writes the
output JSONL: every result, in job order, each with its job under ``"job"``. A rerun skips the jobs whose results
are in the output or in a part file left by an interrupted run (whatever the number of processes then), so an
interrupted run loses at most the jobs in flight. A last line its interruption cut off is dropped (with a note);
any other line that is not a result of the jobs asked for is refused by file and line (:class:`ResumeError`).

Processes are those of ``torch.distributed`` as accelerate sets it up (``PartialState``; gloo on CPU). Without a
launcher (``WORLD_SIZE`` unset or 1) there is one process and nothing to set up.
"""
from __future__ import annotations

import codecs
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .files import json_kind


class ResumeError(ValueError):
    """The output (or a part file) holds results of other jobs than the ones asked for now, or a line that is no
    result (a damaged file); the message names the file and the line."""


@dataclass
class Processes:
    """This process's place among the processes working on one dataset."""

    index: int = 0
    count: int = 1
    state: object = None  # accelerate's PartialState when there are several

    @property
    def main(self) -> bool:
        return self.index == 0

    def wait(self) -> None:
        """Block until every process gets here."""
        if self.count > 1:
            self.state.wait_for_everyone()


def processes(cpu: bool = True) -> Processes:
    """The processes started by ``accelerate launch`` / ``torchrun`` (one, without a launcher). ``cpu``: the work
    runs on CPU (torch.distributed's gloo backend), else on each process's own accelerator."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Processes()
    from accelerate import PartialState

    state = PartialState(cpu=cpu)
    return Processes(state.process_index, state.num_processes, state)


def _read(path: Path, wanted: set[str], check: Callable[[dict], str | None] | None = None
          ) -> tuple[list[dict], bool]:
    """The results in ``path`` and whether its last line was cut off by an interrupted write.

    Each result is one line, written whole with its newline; text after the last newline is a write the interrupted
    run did not finish: it is dropped (its job runs again), never read as a result. Every complete line must be a
    JSON object with the ``"job"`` of one of the ``wanted`` jobs (keys of :func:`_key`) and pass ``check``
    (the result's own fields; it returns what is wrong, or None). Blank lines are skipped.

    Raises:
        ResumeError: naming the file, the line and what is wrong with it.
    """
    if not path.exists():
        return [], False
    data = path.read_bytes()
    # a byte-order mark (Windows editors write one) is not part of the first line's JSON, as for the dataset reader
    *lines, tail = data.removeprefix(codecs.BOM_UTF8).split(b"\n")
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        problem, record = _problem(raw, wanted, check)
        if problem is not None:
            raise ResumeError(f"{path}:{number}: {problem}")
        records.append(record)
    return records, tail != b""


_DAMAGED = "; the file is damaged. Delete it, or start over with --restart (its results are then computed again)."


def _problem(raw: bytes, wanted: set[str], check) -> tuple[str | None, dict | None]:
    """(what is wrong with one complete line of results, or None; the result)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"byte {error.start + 1} of the line is not UTF-8 text" + _DAMAGED, None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return f"not a JSON line ({error.msg} at column {error.colno})" + _DAMAGED, None
    if not isinstance(record, dict):
        return f"a JSON {json_kind(record)}, not a result object" + _DAMAGED, None
    if "job" not in record:
        return "a result without the \"job\" it was computed for" + _DAMAGED, None
    if not isinstance(record["job"], dict):
        return f"a result whose \"job\" is a JSON {json_kind(record['job'])}, not an object" + _DAMAGED, None
    if _key(record["job"]) not in wanted:
        return (f"a result of other work than asked for now (job {record['job']!r}); it was written for another "
                "dataset or with other settings. Choose another output file, delete it, or start over with "
                "--restart."), None
    problem = None if check is None else check(record)
    if problem is not None:
        return f"the result of job {record['job']!r} {problem}" + _DAMAGED, None
    return None, record


def _drop_cut_line(path: Path) -> None:
    """Remove a last line that an interrupted write cut off, so that appending starts on a line of its own."""
    if path.exists():
        data = path.read_bytes()  # bytes: a write cut inside a character leaves no UTF-8 text
        if data and not data.endswith(b"\n"):
            path.write_bytes(data[:data.rfind(b"\n") + 1])


def _parts(output: Path) -> list[Path]:
    """The part files of ``output`` there now: ``<output>.part<i>`` (digits only: ``<output>.partial`` or
    ``<output>.part-report.html`` is a user's file, never read or deleted here)."""
    pattern = re.compile(re.escape(output.name) + r"\.part[0-9]+")
    try:
        names = [entry.name for entry in os.scandir(output.parent) if pattern.fullmatch(entry.name)]
    except OSError:  # no folder (yet): no parts
        return []
    return sorted(output.parent / name for name in names)


def _claims(output: Path) -> Path:
    return output.with_name(output.name + ".claims")


def _staged(output: Path) -> Path:
    return output.with_name(output.name + ".tmp")


def side_files(output: Path) -> list[Path]:
    """Every path besides ``output`` that :func:`run_jobs` may create, write or delete for it: the staged
    ``<output>.tmp``, the ``<output>.claims/`` folder and the files in it, the part files ``<output>.part<i>`` there
    now (the ones a run creates are new names, which replace nothing). They are outputs too: an application checks
    them against its inputs before it runs (:func:`mamba_captum.files.check_outputs`)."""
    output = Path(output)
    claims = _claims(output)
    try:
        claimed = sorted(claims.iterdir()) if claims.is_dir() and not claims.is_symlink() else []
    except OSError:
        claimed = []
    return [_staged(output), claims, *claimed, *_parts(output)]


def _claim(claims: Path, position: int) -> bool:
    """Take pending job ``position`` for this process: True for exactly one of the processes asking."""
    try:
        os.close(os.open(claims / str(position), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _key(job: dict) -> str:
    return json.dumps(job, sort_keys=True)


def done_records(jobs: list[dict], output: Path, check: Callable[[dict], str | None] | None = None,
                 note: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Results already computed for ``jobs`` (in ``output`` and in part files left by an interrupted run), by job.

    ``check(record)``: what is wrong with a result's own fields, or None (see :func:`run_jobs`). ``note``: told, in
    one line, of each last line that an interrupted write cut off (dropped: its job runs again).

    Raises:
        ResumeError: a line there is no result (naming the file and line: not UTF-8, not JSON, not a result object,
            no job, a result ``check`` refuses), or a result belongs to no job asked for now (another dataset,
            other settings).
    """
    wanted = {_key(job) for job in jobs}
    done = {}
    for path in [output, *_parts(output)]:
        records, cut = _read(path, wanted, check)
        if cut and note is not None:
            note(f"{path}: its last line was cut off by an interrupted write; dropped (that result is computed "
                 "again).")
        for record in records:
            done[_key(record["job"])] = record
    return done


def run_jobs(jobs: list[dict], work: Callable[[dict], dict], output: Path, *, group: Processes | None = None,
             restart: bool = False, progress: str | None = None,
             check: Callable[[dict], str | None] | None = None) -> list[dict] | None:
    """Do ``work(job)`` for every job not done yet, this process's share of them, and gather every result.

    Args:
        jobs: JSON-able dicts, distinct, in the order the output keeps.
        work: job -> a JSON-able dict (the job is added to it under ``"job"``).
        output: the JSONL of results (one line per job, in job order).
        group: the processes sharing the work (default: :func:`processes`).
        restart: ignore (and remove) results of an earlier run.
        progress: a progress bar's label on the main process (None: no bar).
        check: ``check(record)`` -> what is wrong with a result read back from an earlier run (e.g. "has no
            'rows'"), or None; a result refused raises :class:`ResumeError` naming its file and line.
    Returns:
        every job's result, in job order, on the main process; None on the others.
    """
    group = group or processes()
    keys = [_key(job) for job in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError("mamba_captum: two jobs are the same; each must name distinct work.")
    claims = _claims(output)
    if group.main:
        if restart:
            for path in [output, *_parts(output)]:
                path.unlink(missing_ok=True)
        shutil.rmtree(claims, ignore_errors=True)  # an interrupted run's claims: its results are in the parts
        if group.count > 1:
            claims.mkdir(parents=True)
    group.wait()
    # a cut last line is noted once, by the main process, on stderr (where the progress bar is)
    done = done_records(jobs, output, check, note=(lambda line: print(f"mamba-captum: {line}", file=sys.stderr))
                        if group.main else None)
    group.wait()  # every process has read the earlier results before any writes
    pending = [job for job in jobs if _key(job) not in done]
    part = output.with_name(f"{output.name}.part{group.index}")
    _drop_cut_line(part)
    bar = None
    if progress and group.main:
        from tqdm.auto import tqdm

        # counts the jobs taken, by any process, as the main process goes through the queue
        label = progress if group.count == 1 else f"{progress} ({group.count} processes)"
        bar = tqdm(total=len(pending), desc=label, unit="job")
    try:
        with part.open("a", encoding="utf-8") as handle:
            for position, job in enumerate(pending):
                if group.count > 1 and not _claim(claims, position):
                    if bar is not None:
                        bar.update()
                    continue  # another process took it
                record = {**work(job), "job": job}
                handle.write(json.dumps(record) + "\n")
                handle.flush()  # as it goes: an interrupted run keeps what it did
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    group.wait()
    records = None
    if group.main:
        done = done_records(jobs, output)  # the earlier results were checked above; this run's are its own
        records = [done[key] for key in keys]
        staged = _staged(output)
        staged.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
        staged.replace(output)
        for path in _parts(output):
            path.unlink()
        shutil.rmtree(claims, ignore_errors=True)
    group.wait()
    return records
