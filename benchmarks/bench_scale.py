"""Benchmark the scale features (docs/scale.md): dispatched models, data-parallel runs, long sequences.

  python benchmarks/bench_scale.py dispatch [--length 256]
      A 130m-sized random Mamba saved as a checkpoint, explained undispatched and loaded with every weight offloaded
      to disk (``device_map={"": "disk"}``): the largest relative difference of the maps / attributions, and the peak
      memory of the process over its level after loading, against the checkpoint's size.
  python benchmarks/bench_scale.py parallel [--texts 2000]
      ``mamba-captum explain --dataset`` of the bundled demo model over generated sentences, and ``mamba-captum
      evaluate`` on eight shipped classifiers: one process (all cores) against ``accelerate launch`` with two.
  python benchmarks/bench_scale.py long [--lengths 1024 2048 4096 8192]
      A 130m-sized random Mamba: time and peak extra memory of the HF forward (with the library's fast scans, the
      logits of the last token only, as implicit_attention runs it) and of ``implicit_attention(model, ids,
      rows=[-1])`` against L.

Each measurement runs in a fresh subprocess; memory is the process RSS sampled every 2 ms (bench_implicit_attention's
PeakRSS, with freed heap memory returned to the OS), timings are wall clock on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2 ** 30


def _child(code: str, *args) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter; its parsed result."""
    result = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(HERE)})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


DISPATCH_CHILD = r"""
import json, sys, torch
from bench_implicit_attention import PeakRSS, release_freed_memory
import transformers as tf
import mamba_captum as mc
checkpoint, mode, length, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
placement = {} if mode == "plain" else {"device_map": {"": "disk"}, "offload_folder": checkpoint + "/offload"}
model = tf.MambaForCausalLM.from_pretrained(checkpoint, **placement).eval()
ids = torch.randint(0, 50000, (1, length), generator=torch.Generator().manual_seed(0))
release_freed_memory()
with PeakRSS() as maps_memory:
    maps = mc.implicit_attention(model, ids, rows=[-1])
release_freed_memory()
with PeakRSS() as attribution_memory:
    attribution = mc.MambaAttribution(model).attribute(ids, target=5)
torch.save({"maps": maps, "attribution": attribution}, out)
print(json.dumps({"maps_extra": maps_memory.extra, "attribution_extra": attribution_memory.extra,
                  "maps_peak": maps_memory.peak, "attribution_peak": attribution_memory.peak}))
"""


def bench_dispatch(length: int) -> None:
    import torch
    import transformers as tf

    from bench_implicit_attention import make_model

    with tempfile.TemporaryDirectory() as folder:
        make_model("mamba").save_pretrained(folder)
        size = sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))
        results = {}
        for mode in ("plain", "disk"):
            results[mode] = _child(DISPATCH_CHILD, folder, mode, length, f"{folder}/{mode}.pt")
        plain, disk = torch.load(f"{folder}/plain.pt"), torch.load(f"{folder}/disk.pt")
        difference = max([float((disk["maps"][k] - v).abs().max() / v.abs().max()) for k, v in plain["maps"].items()]
                         + [float((disk["attribution"] - plain["attribution"]).abs().max()
                                  / plain["attribution"].abs().max())])
        del tf
    print(f"130m-sized Mamba, L = {length}; checkpoint {size / GIB:.2f} GiB")
    print(f"largest relative difference, disk-offloaded vs undispatched: {difference:.1e}")
    print("| run | maps: peak extra | attribution: peak extra |")
    print("|---|---|---|")
    for mode, result in results.items():
        print(f"| {mode} | {result['maps_extra'] / GIB:.2f} GiB | {result['attribution_extra'] / GIB:.2f} GiB |")


def _timed(command: list[str], env=None) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return time.perf_counter() - start


def _launch(processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "mamba_captum.cli"]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "mamba_captum.cli"]


def bench_parallel(texts: int) -> None:
    from mamba_captum.demo import grammar, model_dir

    with tempfile.TemporaryDirectory() as folder:
        dataset = Path(folder) / "texts.jsonl"
        dataset.write_text("".join(json.dumps({"text": s.text}) + "\n" for s in grammar.sentences(texts, seed=7)))
        doc = Path(folder) / "faithfulness.md"
        from mamba_captum.evaluation.report import BEGIN, END

        rows = []
        for processes in (1, 2):
            explain = _timed([*_launch(processes), "explain", "--model", str(model_dir()), "--dataset", str(dataset),
                              "--jsonl", f"{folder}/explained{processes}.jsonl"])
            doc.write_text(f"# Faithfulness\n\n{BEGIN}\n{END}\n")
            evaluate = _timed([*_launch(processes), "evaluate", "--family", "mamba", "mamba2", "rwkv", "lfm2",
                               "--task", "counting", "negation", "--examples", "64", "--no-perturbation",
                               "--doc", str(doc), "--assets", f"{folder}/assets{processes}"])
            rows.append((processes, explain, evaluate))
    print(f"{os.cpu_count()} cores; explain: {texts} texts, all five methods; evaluate: 8 models × 28 methods, "
          "64 examples, localisation only")
    print("| processes | explain --dataset | evaluate |")
    print("|---|---|---|")
    for processes, explain, evaluate in rows:
        print(f"| {processes} | {explain:.1f} s | {evaluate:.1f} s |")
    print(f"| speed-up | {rows[0][1] / rows[1][1]:.2f}× | {rows[0][2] / rows[1][2]:.2f}× |")


LONG_CHILD = r"""
import json, sys, time, torch
from bench_implicit_attention import PeakRSS, make_model, release_freed_memory
import mamba_captum as mc
length, what = int(sys.argv[1]), sys.argv[2]
model = make_model("mamba")
ids = torch.randint(0, 50000, (1, length), generator=torch.Generator().manual_seed(0))
release_freed_memory()
with PeakRSS() as memory:
    start = time.perf_counter()
    if what == "forward":
        with torch.no_grad(), mc.fast_scans(model):
            model(ids, use_cache=False, logits_to_keep=1)  # as implicit_attention runs it
    else:
        mc.implicit_attention(model, ids, rows=[-1])
    seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "extra": memory.extra}))
"""


def bench_long(lengths: list[int]) -> None:
    print("130m-sized random Mamba (24 layers, d_model 768), one sequence, float32, "
          f"{os.cpu_count()} cores")
    print("| L | forward | forward: peak extra | rows=[-1] maps | maps: peak extra | maps s per 1k tokens |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        forward = _child(LONG_CHILD, length, "forward")
        maps = _child(LONG_CHILD, length, "maps")
        print(f"| {length} | {forward['seconds']:.1f} s | {forward['extra'] / GIB:.2f} GiB | {maps['seconds']:.1f} s "
              f"| {maps['extra'] / GIB:.2f} GiB | {maps['seconds'] / length * 1000:.2f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("dispatch").add_argument("--length", type=int, default=256)
    commands.add_parser("parallel").add_argument("--texts", type=int, default=2000)
    commands.add_parser("long").add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    if args.command == "dispatch":
        bench_dispatch(args.length)
    elif args.command == "parallel":
        bench_parallel(args.texts)
    else:
        bench_long(args.lengths)


if __name__ == "__main__":
    main()
