"""How long ``mamba-captum`` takes to answer --help, --version and each usage error that needs no model (issue 33's
target: under 2 s on a quiet 2-core machine), each in a fresh process, as a user runs it.

    python benchmarks/cli_latency.py [--repeats 3]

Runs the ``mamba-captum`` console script beside this Python (else ``python -m mamba_captum.cli``) in a temporary folder
holding the few files the cases name (a stand-in .pth and image: only their existence is checked before the library
loads), and prints, per case, the median wall time of the repeats, the exit code and the error line. A --device that
only torch can judge imports torch (about 1.5 s): those rows are marked.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXT = ["explain", "--model", "demo", "--text", "hi"]
IMAGE = ["explain", "--model", "vim.pth", "--image", "x.png"]
CASES = [
    ["--help"], ["--version"], ["explain", "--help"],
    TEXT + ["--device-map", "auto", "--device", "cpu"],
    TEXT + ["--out", "-"],
    TEXT + ["--max-memory", "zz"],
    TEXT + ["--labels", "a", "a"],
    TEXT + ["--jsonl", "x.jsonl", "--out", "x.jsonl"],
    TEXT + ["--img-size", "32"],
    ["explain", "--model", "/nonexistent", "--text", "hi"],
    ["explain", "--model", "demo", "--dataset", "nonexist.jsonl"],
    ["demo", "--out", "folder"],
    IMAGE + ["--method", "selection"],
    IMAGE + ["--img-size", "0"],
    ["matrices", "--model", "demo", "--text", "x", "--scale", "0"],
    ["evaluate", "--help"], ["evaluate", "--bogus"], ["evaluate", "--family", "nope"], ["evaluate", "--examples", "0"],
    TEXT + ["--device", "nope"],  # torch judges these two
    TEXT + ["--device", "cuda:99"],
]


def judged_by_torch(args: str) -> bool:
    """Whether the case's --device is judged by torch (imported for it)."""
    return "--device " in args and "--device-map" not in args
def command() -> list[str]:
    script = Path(sys.executable).with_name("mamba-captum")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mamba_captum.cli"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    base = command()
    with tempfile.TemporaryDirectory() as folder:
        for name in ("vim.pth", "x.png"):
            Path(folder, name).write_bytes(b"not read")
        Path(folder, "folder").mkdir()
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        rows = []
        for args in CASES:
            times = []
            for _ in range(options.repeats):
                start = time.perf_counter()
                done = subprocess.run(base + args, capture_output=True, text=True, cwd=folder, env=env)
                times.append(time.perf_counter() - start)
            errors = [line for line in done.stderr.splitlines() if "error:" in line]
            said = errors[-1] if errors else (done.stdout.splitlines() or [""])[0]
            rows.append((statistics.median(times), done.returncode, " ".join(args), said))
    print(f"{' '.join(base[-1:])}: median of {options.repeats} fresh processes, on {os.cpu_count()} CPU(s)\n")
    print(f"{'seconds':>7}  {'code':>4}  {'arguments':<70}  answer")
    for seconds, code, args, said in rows:
        mark = " (torch)" if judged_by_torch(args) else ""
        print(f"{seconds:7.2f}  {code:4d}  {args[:70]:<70}  {said[:110]}{mark}")
    slowest = max(seconds for seconds, _, args, _ in rows if not judged_by_torch(args))
    print(f"\nslowest without torch: {slowest:.2f} s")


if __name__ == "__main__":
    main()
