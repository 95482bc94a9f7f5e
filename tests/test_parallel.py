"""Data-parallel, resumable work over a dataset (issue 20): ``mamba-captum explain --dataset`` and
``mamba-captum evaluate`` under ``accelerate launch`` (two processes, gloo on CPU) give the single-process output
line for line; an interrupted run is resumed without redoing what it wrote."""
import json
import os
import socket
import subprocess
import sys

import pytest

from mamba_captum import cli, explain
from mamba_captum.demo import grammar, model_dir
from mamba_captum.evaluation.models import one_thread
from mamba_captum.evaluation.report import BEGIN, END
from mamba_captum.parallel import Processes, ResumeError, run_jobs

DEMO = str(model_dir())


def jobs(count):
    return [{"line": i, "text": f"text {i}"} for i in range(count)]


def test_jobs_are_gathered_in_order_and_an_interrupted_run_is_resumed(tmp_path):
    output = tmp_path / "out.jsonl"
    done = []

    def failing(job):
        if job["line"] == 3:
            raise KeyboardInterrupt
        done.append(job["line"])
        return {"value": job["line"] * 10}

    with pytest.raises(KeyboardInterrupt):
        run_jobs(jobs(6), failing, output)
    assert done == [0, 1, 2] and not output.exists()
    part = tmp_path / "out.jsonl.part0"
    part.write_text(part.read_text() + '{"value": 30, "job": {"li')  # a line cut off by the kill
    done.clear()
    records = run_jobs(jobs(6), lambda job: done.append(job["line"]) or {"value": job["line"] * 10}, output)
    assert done == [3, 4, 5]  # the three written results are not recomputed
    assert records == [{"value": i * 10, "job": {"line": i, "text": f"text {i}"}} for i in range(6)]
    assert [json.loads(line) for line in output.open()] == records and not part.exists()
    # another run over the same jobs does nothing; over other jobs it is refused; --restart starts over
    assert run_jobs(jobs(6), lambda job: pytest.fail("recomputed"), output) == records
    other = [{"line": 0, "text": "changed"}]
    with pytest.raises(ResumeError, match="--restart"):
        run_jobs(other, lambda job: {}, output)
    assert run_jobs(other, lambda job: {"value": -1}, output, restart=True) == [{"value": -1, "job": other[0]}]
    with pytest.raises(ValueError, match="two jobs are the same"):
        run_jobs(jobs(2) * 2, lambda job: {}, tmp_path / "twice.jsonl")


# a damaged line of an earlier run's part file (after a good first line): (its bytes, what the error says)
DAMAGED_LINES = [
    (b"\xff\xfe{}", "byte 1 of the line is not UTF-8 text"),
    (b"42", "a JSON number, not a result object"),
    (b"[1, 2]", "a JSON array, not a result object"),
    (b'{"value": 1, "job": {"li', "not a JSON line"),  # cut, but a later line follows: not an interrupted write
    (b'{"value": 10}', 'a result without the "job" it was computed for'),
    (b'{"value": 10, "job": "line 1"}', 'a result whose "job" is a JSON string, not an object'),
    (b'{"value": 10, "job": {"line": 1, "text": "other text"}}', "a result of other work than asked for now"),
    (b'{"job": {"line": 1, "text": "text 1"}}', "the result of job {'line': 1, 'text': 'text 1'} has no 'value'"),
]


@pytest.mark.parametrize("line, message", DAMAGED_LINES, ids=[m for _, m in DAMAGED_LINES])
def test_a_damaged_line_of_an_earlier_run_is_refused_by_file_and_line(tmp_path, line, message):
    output = tmp_path / "out.jsonl"
    part = tmp_path / "out.jsonl.part0"
    good = json.dumps({"value": 0, "job": jobs(1)[0]}).encode()
    part.write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
    before = part.read_bytes()

    def check(record):
        return None if "value" in record else "has no 'value'"

    with pytest.raises(ResumeError) as refused:
        run_jobs(jobs(3), lambda job: pytest.fail("computed"), output, check=check)
    assert str(refused.value).startswith(f"{part}:2: {message}") and "--restart" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert part.read_bytes() == before and not output.exists()  # nothing changed, nothing written
    # --restart starts over
    assert run_jobs(jobs(3), lambda job: {"value": job["line"]}, output, restart=True, check=check)[2]["value"] == 2


@pytest.mark.parametrize("tail", [b'{"value": 20, "job": {"line": 2, "text": "text 2"}}', b'{"text": "\xc3'],
                         ids=["complete JSON without its newline", "cut inside a UTF-8 character"])
def test_a_last_line_cut_by_an_interrupted_write_is_dropped_with_a_note(tmp_path, capsys, tail):
    output = tmp_path / "out.jsonl"
    part = tmp_path / "out.jsonl.part0"
    part.write_bytes(b"".join(json.dumps({"value": i * 10, "job": job}).encode() + b"\n\n"  # blank lines skipped
                              for i, job in enumerate(jobs(2))) + tail)
    done = []
    records = run_jobs(jobs(3), lambda job: done.append(job["line"]) or {"value": job["line"] * 10}, output)
    assert done == [2]  # the cut line's job is computed again, the two whole lines are not
    assert records == [{"value": i * 10, "job": job} for i, job in enumerate(jobs(3))]
    note = capsys.readouterr().err.strip()
    assert note == f"mamba-captum: {part}: its last line was cut off by an interrupted write; dropped (that result " \
                   "is computed again)."


def test_processes_take_the_jobs_no_other_process_claimed(tmp_path):
    """Process 1 of 2 (its peer's waits stubbed) after its peer claimed pending jobs 0 and 2: it does the others
    and claims them; the main process gathers."""

    class Peer(Processes):
        def wait(self):
            pass

    claims = tmp_path / "o.jsonl.claims"
    claims.mkdir()
    for position in (0, 2):
        (claims / str(position)).touch()
    seen = []
    assert run_jobs(jobs(6), lambda job: seen.append(job["line"]) or {}, tmp_path / "o.jsonl",
                    group=Peer(index=1, count=2)) is None
    assert seen == [1, 3, 4, 5] and sorted(int(p.name) for p in claims.iterdir()) == list(range(6))
    assert [json.loads(line)["job"]["line"] for line in (tmp_path / "o.jsonl.part1").open()] == [1, 3, 4, 5]


def test_the_explain_command_resumes_a_dataset(tmp_path, capsys, monkeypatch):
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text("".join(json.dumps({"text": s.text}) + "\n" for s in grammar.sentences(4, seed=5)))
    fresh = tmp_path / "fresh.jsonl"
    assert cli.main(["explain", "--model", DEMO, "--dataset", str(dataset), "--jsonl", str(fresh),
                     "--method", "attribution"]) == 0
    calls = []
    real = explain.explain

    def interrupted(model, tokenizer, text, **options):
        calls.append(text)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, tokenizer, text, **options)

    monkeypatch.setattr(explain, "explain", interrupted)
    resumed = tmp_path / "resumed.jsonl"
    arguments = ["explain", "--model", DEMO, "--dataset", str(dataset), "--jsonl", str(resumed),
                 "--method", "attribution"]
    assert cli.main(arguments) == 130
    calls.clear()
    monkeypatch.setattr(explain, "explain", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    capsys.readouterr()
    assert cli.main(arguments) == 0
    assert len(calls) == 2 and "results: " in capsys.readouterr().out
    assert resumed.read_text() == fresh.read_text()
    # other settings over the same output: refused in one line, nothing recomputed
    assert cli.main([*arguments[:-1], "raw"]) == 2
    assert "other settings" in capsys.readouterr().err and resumed.read_text() == fresh.read_text()


def test_the_explain_command_refuses_a_damaged_result_by_line(tmp_path, capsys):
    texts = [s.text for s in grammar.sentences(2, seed=5)]
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    jsonl = tmp_path / "out.jsonl"
    arguments = ["explain", "--model", DEMO, "--dataset", str(dataset), "--jsonl", str(jsonl), "--method", "raw"]
    # the lines an earlier run wrote (as Explanation.to_dict writes them), for the jobs of this command
    first, second = [dict(text=text, tokens=["[CLS]", "the", "plot"], prediction="good", probability=0.7,
                          target="good", target_probability=0.7, relevance={"raw": [0.2, 0.3, 0.5]}, settings={},
                          job=dict(line=line, text=text, target=None, methods=["raw"], formulation="unified",
                                   labels=None)) for line, text in enumerate(texts, 1)]
    for damaged, message in [({**second, "relevance": {"raw": [0.5]}}, "has 1 raw scores for 3 tokens"),
                             ({k: v for k, v in second.items() if k != "tokens"}, "has no 'tokens'"),
                             ({**second, "probability": "high"}, "has a 'probability' that is not a number"),
                             ({**second, "text": "another text"}, "explains another text than its job's")]:
        jsonl.write_text(json.dumps(first) + "\n" + json.dumps(damaged) + "\n")
        capsys.readouterr()
        assert cli.main(arguments) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"mamba-captum explain: error: {jsonl}:2: the result of job ") and message in error
        assert "--restart" in error and "\n" not in error
        assert jsonl.read_text() == json.dumps(first) + "\n" + json.dumps(damaged) + "\n"  # left as it was


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(*arguments):
    """``accelerate launch`` of the CLI in two processes (gloo on CPU; one thread each, as torchrun sets it)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "mamba_captum.cli", *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def in_one_thread(*arguments):
    """The CLI in this process on one thread: the same float operations as each launched process runs."""
    with one_thread():
        assert cli.main(list(arguments)) == 0


def test_two_processes_explain_a_dataset_as_one_does(tmp_path):
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text("".join(json.dumps({"text": s.text}) + "\n" for s in grammar.sentences(7, seed=2)))
    in_one_thread("explain", "--model", DEMO, "--dataset", str(dataset), "--jsonl", str(tmp_path / "one.jsonl"))
    two = launch("explain", "--model", DEMO, "--dataset", str(dataset), "--jsonl", str(tmp_path / "two.jsonl"),
                 "--out", str(tmp_path / "report.html"))
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert [json.loads(line)["job"]["line"] for line in (tmp_path / "two.jsonl").open()] == list(range(1, 8))
    # one bar (the main process's) that starts once and reaches 100 % (tqdm may draw the full bar twice: at its
    # last update and again when it closes, depending on timing)
    assert two.stderr.count("(2 processes):   0%") == 1 and "(2 processes): 100%" in two.stderr
    assert two.stdout.count("results: ") == 1
    assert (tmp_path / "report.html").read_text().count("<section class='example'>") == 7
    assert not list(tmp_path.glob("*.part*")) and not list(tmp_path.glob("*.claims"))


def test_two_processes_evaluate_as_one_does(tmp_path):
    doc = tmp_path / "faithfulness.md"
    options = ["--family", "mamba", "rwkv", "--task", "counting", "negation", "--examples", "8",
               "--no-perturbation", "--method", "Saliency", "MambaLRP"]
    for name, run in (("one", in_one_thread), ("two", launch)):
        doc.write_text(f"# Faithfulness\n\n{BEGIN}\n{END}\n")
        run("evaluate", *options, "--doc", str(doc), "--assets", str(tmp_path / name))
    rows = {name: json.loads((tmp_path / name / "results.json").read_text())["rows"] for name in ("one", "two")}
    timeless = {name: [{k: v for k, v in row.items() if k != "seconds"} for row in value]
                for name, value in rows.items()}
    assert timeless["two"] == timeless["one"] and len(rows["one"]) == 4 * 2
    assert not (tmp_path / "two" / "results.partial.jsonl").exists()


def test_a_part_file_with_a_byte_order_mark_is_resumed_and_other_files_are_left_alone(tmp_path):
    output = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.part0").write_bytes(  # saved by a Windows editor: a byte-order mark first
        b"\xef\xbb\xbf" + json.dumps({"value": 0, "job": jobs(2)[0]}).encode() + b"\n")
    (tmp_path / "out.jsonl.partial").write_text("a user's own file, no part file of a run")
    done = []
    records = run_jobs(jobs(2), lambda job: done.append(job["line"]) or {"value": job["line"] * 10}, output)
    assert done == [1] and records == [{"value": i * 10, "job": jobs(2)[i]} for i in range(2)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.partial"]
    assert (tmp_path / "out.jsonl.partial").read_text() == "a user's own file, no part file of a run"
