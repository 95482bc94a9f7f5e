"""Work over a dataset in several processes (``accelerate launch`` / ``torchrun``), resumable, gathered in order.

Each job is a JSON-able dict naming one unit of work (a dataset line and what to compute on it; a model of the
faithfulness suite). The processes take the jobs not done yet one at a time, first come first served (each claims
a job by creating its file in ``<output>.claims/``, which only one process can; models of the suite take very
different times, so a fixed share would leave one process waiting), append each result as one JSON line to their
own part file (``<output>.part<i>``) as they go, and once every process is done the main process writes the
output JSONL: every result, in job order, each with its job under ``"job"``. A rerun skips the jobs whose results
are in the output or in a part file left by an interrupted run (whatever the number of processes then), so an
interrupted run loses at most the jobs in flight.

Processes are those of ``torch.distributed`` as accelerate sets it up (``PartialState``; gloo on CPU). Without a
launcher (``WORLD_SIZE`` unset or 1) there is one process and nothing to set up.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ResumeError(ValueError):
    """The output (or a part file) holds results of other jobs than the ones asked for now."""


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


def _read(path: Path) -> list[dict]:
    """The complete JSON lines of ``path`` (a line cut off by an interrupted write is dropped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line of a killed run
    return records


def _drop_cut_line(path: Path) -> None:
    """Remove a last line that an interrupted write cut off, so that appending starts on a line of its own."""
    if path.exists():
        text = path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            path.write_text(text[:text.rfind("\n") + 1], encoding="utf-8")


def _parts(output: Path) -> list[Path]:
    return sorted(output.parent.glob(glob.escape(output.name) + ".part*"))


def _claim(claims: Path, position: int) -> bool:
    """Take pending job ``position`` for this process: True for exactly one of the processes asking."""
    try:
        os.close(os.open(claims / str(position), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _key(job: dict) -> str:
    return json.dumps(job, sort_keys=True)


def done_records(jobs: list[dict], output: Path) -> dict[str, dict]:
    """Results already computed for ``jobs`` (in ``output`` and in part files left by an interrupted run), by job.

    Raises:
        ResumeError: a result there belongs to no job asked for now (another dataset, other settings).
    """
    wanted = {_key(job) for job in jobs}
    done = {}
    for path in [output, *_parts(output)]:
        for record in _read(path):
            key = _key(record.get("job"))
            if key not in wanted:
                raise ResumeError(
                    f"{path} holds a result of other work than asked for now (job {record.get('job')!r}); it was "
                    "written for another dataset or with other settings. Choose another output file, delete it, "
                    "or start over with --restart.")
            done[key] = record
    return done


def run_jobs(jobs: list[dict], work: Callable[[dict], dict], output: Path, *, group: Processes | None = None,
             restart: bool = False, progress: str | None = None) -> list[dict] | None:
    """Do ``work(job)`` for every job not done yet, this process's share of them, and gather every result.

    Args:
        jobs: JSON-able dicts, distinct, in the order the output keeps.
        work: job -> a JSON-able dict (the job is added to it under ``"job"``).
        output: the JSONL of results (one line per job, in job order).
        group: the processes sharing the work (default: :func:`processes`).
        restart: ignore (and remove) results of an earlier run.
        progress: a progress bar's label on the main process (None: no bar).
    Returns:
        every job's result, in job order, on the main process; None on the others.
    """
    group = group or processes()
    keys = [_key(job) for job in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError("mamba_captum: two jobs are the same; each must name distinct work.")
    claims = output.with_name(output.name + ".claims")
    if group.main:
        if restart:
            for path in [output, *_parts(output)]:
                path.unlink(missing_ok=True)
        shutil.rmtree(claims, ignore_errors=True)  # an interrupted run's claims: its results are in the parts
        if group.count > 1:
            claims.mkdir(parents=True)
    group.wait()
    done = done_records(jobs, output)
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
        done = done_records(jobs, output)
        records = [done[key] for key in keys]
        staged = output.with_name(output.name + ".tmp")
        staged.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
        staged.replace(output)
        for path in _parts(output):
            path.unlink()
        shutil.rmtree(claims, ignore_errors=True)
    group.wait()
    return records
