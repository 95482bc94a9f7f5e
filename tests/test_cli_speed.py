"""Usage errors answer at once (issue 33): each error that needs no model is found before ``mamba-captum`` imports
the library (torch, transformers, captum: seconds on a small machine). Not timed (benchmarks/cli_latency.py times
them): each case runs ``mamba_captum.cli.main`` in a fresh interpreter and the test reads the exit code, the one error
line and whether torch was imported. A --device that only torch can judge may import torch, never transformers or
captum."""
import json
import subprocess
import sys

import pytest

# one interpreter for many argument lists: each case's code, error line and the heavy modules loaded so far (the set
# only grows, so "none yet" after a case holds for every case before it)
RUN = """
import io, json, sys
from contextlib import redirect_stderr, redirect_stdout
from mamba_captum.cli import main

for args in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with redirect_stderr(err), redirect_stdout(out):
        code = main(args)
    lines = [line for line in err.getvalue().splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    heavy = sorted(m for m in ("torch", "transformers", "captum") if m in sys.modules)
    print(json.dumps([code, lines, out.getvalue()[:60], heavy]))
"""


def run_cases(cases: list[list[str]], cwd) -> list:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(cases)], capture_output=True, text=True, cwd=cwd,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture
def files(tmp_path):
    """A folder with a stand-in Vim file and image (only their existence is checked before the import) and an empty
    folder."""
    (tmp_path / "vim.pth").write_bytes(b"not read")
    (tmp_path / "x.png").write_bytes(b"not read")
    (tmp_path / "folder").mkdir()
    return tmp_path


TEXT = ["explain", "--model", "demo", "--text", "hi"]
IMAGE = ["explain", "--model", "vim.pth", "--image", "x.png"]
# argument list -> its one error line (the prefix "mamba-captum <command>: error: " left out, unless given)
USAGE_ERRORS = [
    (TEXT + ["--device-map", "auto", "--device", "cpu"],
     "give --device or --device-map, not both (--device-map places every layer itself)."),
    (TEXT + ["--out", "-"], "'-' is not standard output here; give a file name (e.g. report.html)."),
    (TEXT + ["--max-memory", "zz"], "--max-memory 'zz': give device=size pairs, e.g. 0=20GiB,cpu=60GiB."),
    (TEXT + ["--max-memory", "cpu=1GiB"],
     "max_memory (--max-memory) bounds what device_map='auto' places per device; give a device_map (--device-map "
     "auto) with it."),
    (TEXT + ["--device-map", "everywhere"],
     "--device-map 'everywhere' is neither one of auto, balanced, balanced_low_0, sequential nor a JSON object of "
     "module names to devices (e.g. '{\"\": \"cpu\"}')."),
    (TEXT + ["--device-map", "{}"],
     "--device-map '{}' names no module; give a non-empty JSON object of module names to devices (e.g. "
     "'{\"\": \"cpu\"}')."),
    (TEXT + ["--labels", "a", "a"], "the labels ['a', 'a'] repeat 'a'; give each label once."),
    (TEXT + ["--jsonl", "x.jsonl", "--out", "x.jsonl"], "--jsonl and --out both name 'x.jsonl'; give them different "
                                                        "files."),
    (["explain", "--model", "/nonexistent", "--text", "hi"],
     "model directory '/nonexistent' does not exist; pass a folder written by save_pretrained."),
    (["explain", "--model", "folder", "--text", "hi"],
     "'folder' holds no config.json: it is not a HF checkpoint directory."),
    (["explain", "--model", "demo", "--dataset", "nonexist.jsonl"], "dataset 'nonexist.jsonl' does not exist."),
    (["demo", "--out", "folder"], "'folder' is a directory; give a file name."),
    (TEXT + ["--img-size", "32"],
     "--img-size applies to --image (a Vision Mamba checkpoint); an HF checkpoint's texts need none: leave it out."),
    (["explain", "--model", "demo", "--dataset", "nonexist.jsonl", "--img-size", "32"],
     "--img-size applies to --image (a Vision Mamba checkpoint); an HF checkpoint's texts need none: leave it out."),
    (IMAGE + ["--method", "selection"],
     "--method selection is not available for images (a Vision Mamba checkpoint); choose among raw, rollout, "
     "attribution."),
    (IMAGE + ["--method", "raw", "--method", "lrp"],
     "--method lrp is not available for images (a Vision Mamba checkpoint); choose among raw, rollout, attribution."),
    (IMAGE + ["--labels", "cat", "cat"], "the labels ['cat', 'cat'] repeat 'cat'; give each label once."),
    (IMAGE + ["--max-memory", "cpu=1GiB"],
     "--max-memory bounds what --device-map places on each device; a Vision Mamba file is loaded whole on --device: "
     "leave it out."),
    (IMAGE + ["--offload-folder", "off"],
     "--offload-folder holds the weights --device-map puts on disk; a Vision Mamba file is loaded whole on --device: "
     "leave it out."),
    (TEXT + ["--offload-folder", "off"],
     "--offload-folder holds the weights --device-map puts on disk; without --device-map the model is loaded whole on "
     "--device: give --device-map (e.g. auto) with it, or leave it out."),
    (TEXT + ["--restart"], "--restart recomputes a --dataset run's results; --text and --image runs keep none: leave "
                           "it out."),
    (IMAGE + ["--restart"], "--restart recomputes a --dataset run's results; --text and --image runs keep none: leave "
                            "it out."),
    (["explain", "--model", "nothing.pth", "--image", "x.png"],
     "no Vim checkpoint file at 'nothing.pth'; pass a .pth file (the weights under 'model')."),
    # argparse's errors: a positive count, an option of another command
    (["matrices", "--model", "demo", "--text", "x", "--scale", "0"], "argument --scale: must be at least 1, not 0."),
    (IMAGE + ["--img-size", "0"], "argument --img-size: must be at least 1, not 0."),
    (["matrices", "--model", "demo", "--text", "x", "--img-size", "32"],  # the top parser's words: a whole line
     "mamba-captum: error: unrecognized arguments: --img-size 32"),
    (["evaluate", "--bogus"], "unrecognized arguments: --bogus"),
    (["evaluate", "--family", "nope"],
     "argument --family: invalid choice: 'nope' (choose from 'mamba', 'mamba2', 'rwkv', 'recurrent_gemma', "
     "'jamba', 'qwen3_next', 'lfm2', 'xlstm', 'gla', 'retnet', 'rwkv7', 'mamba3')"),
    (["evaluate", "--examples", "0"], "argument --examples: must be at least 1, not 0."),
]


def test_usage_errors_answer_before_torch_is_imported(files):
    results = run_cases([args for args, _ in USAGE_ERRORS] + [["--help"], ["--version"], ["evaluate", "--help"]],
                        files)
    for (args, message), (code, lines, _, heavy) in zip(USAGE_ERRORS, results):
        line = message if message.startswith("mamba-captum") else f"mamba-captum {args[0]}: error: {message}"
        assert (code, lines, heavy) == (2, [line], []), args
    assert [result[0] for result in results[-3:]] == [0, 0, 0]
    assert [result[2].split()[:2] for result in results[-3:]] == [["usage:", "mamba-captum"], ["mamba-captum", "0.1.0"],
                                                                  ["usage:", "mamba-captum"]]
    assert results[-1][3] == []  # evaluate --help: no torch either


def test_a_device_is_judged_by_torch_alone(files):
    import torch

    devices = {"nope": "device 'nope' is not available: it is not a torch device name; choose cpu, cuda or cuda:N.",
               "cuda:99": "device 'cuda:99' is not available", "": "device '' is not available"}
    if not torch.cuda.is_available():
        devices["cuda"] = "device 'cuda' is not available on this machine"
    cases = [["explain", "--model", model, source, name, "--device", device] for device in devices
             for model, source, name in (("demo", "--text", "hi"), ("vim.pth", "--image", "x.png"))]
    for args, (code, lines, _, heavy) in zip(cases, run_cases(cases, files)):
        assert code == 2 and len(lines) == 1, (args, lines)
        assert lines[0].startswith(f"mamba-captum explain: error: {devices[args[-1]]}"), (args, lines)
        assert heavy == ["torch"], args


def test_the_light_copies_are_the_librarys_names():
    # names the command line holds so as not to import the library, and the library's own
    from mamba_captum.cli.images import IMAGE_METHOD_NAMES
    from mamba_captum.cli.loading import DEVICE_MAP_STRATEGIES
    from mamba_captum.evaluation.models import FAMILIES
    from mamba_captum.evaluation.tasks import TASKS
    from mamba_captum.explain import DEVICE_MAP_STRATEGIES as LIBRARY_STRATEGIES
    from mamba_captum.explain.images import METHODS as IMAGE_METHODS
    from mamba_captum.usage import EVALUATION_FAMILIES, EVALUATION_TASKS

    assert DEVICE_MAP_STRATEGIES == LIBRARY_STRATEGIES and IMAGE_METHOD_NAMES == tuple(IMAGE_METHODS)
    assert (EVALUATION_FAMILIES, EVALUATION_TASKS) == (FAMILIES, TASKS + ("bbc_news",))


def test_usage_error_is_one_class_wherever_it_is_imported():
    import mamba_captum.explain
    import mamba_captum.explain.loading
    import mamba_captum.usage

    assert mamba_captum.explain.UsageError is mamba_captum.explain.loading.UsageError is mamba_captum.usage.UsageError
    assert mamba_captum.explain.check_device is mamba_captum.usage.check_device
