"""Benchmark: implicit-attention maps (reduce="mean", all layers) on 130m-sized random Mamba and Mamba-2 configs.

For each config and length L it reports
  forward   the model's own HF forward (no_grad, use_cache=False), for scale;
  capture   build_operators: the hooked forward + rebuilding and checking every layer's operator;
  maps      the channel-mean maps of all layers from the operators, with the blocked kernels;
  naive     the same maps with the naive per-channel kernels, where they fit (measured on a few layers and scaled
            to all layers: the layers cost the same), and their peak extra memory;
  call      one whole ``implicit_attention(model, ids, reduce="mean")`` (forward, rebuild and maps, layer by layer);
            then, in a second call with the memory instrumentation below, its peak extra memory over the loaded model;
  ratios    maps / forward and call / forward (the performance issue's targets: ≤ 0.4× and ≤ 1.3× at L = 1024).
Memory is the process RSS sampled every 2 ms, after ``malloc_trim`` and with glibc's mmap threshold fixed at
64 KiB, so that freed tensors leave the RSS (otherwise glibc keeps them and the figures mean nothing).

Run:  python benchmarks/bench_implicit_attention.py [--lengths 256 512 1024 2048] [--models mamba mamba2]
Each (model, L) runs in a fresh subprocess so memory figures do not leak into each other.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

NAIVE_MAX_LENGTH = 512  # the naive kernels hold (D, L, L) per-channel stacks: 1536 × 1024² floats do not fit
NAIVE_LAYERS = 2


class PeakRSS:
    """Sample this process's resident memory in a thread; ``extra`` = peak minus the level at entry, in bytes."""

    def __init__(self, interval=0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    @staticmethod
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self):
        self.start = self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())
        self.extra = self.peak - self.start


def make_model(name: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if name == "mamba":  # state-spaces/mamba-130m-hf
        config = tf.MambaConfig(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16, expand=2,
                                conv_kernel=4, time_step_rank=48)
    else:  # state-spaces/mamba2-130m-like
        config = tf.Mamba2Config(vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=128, expand=2,
                                 head_dim=64, num_heads=24, n_groups=1, conv_kernel=4, chunk_size=256)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def run_one(name: str, length: int) -> dict:
    import torch

    import mamba_captum as mc
    from mamba_captum.kernels.selective import selective_maps_naive
    from mamba_captum.kernels.ssd import ssd_maps_naive

    import transformers

    transformers.logging.set_verbosity_error()
    model = make_model(name)
    ids = torch.randint(3, 50000, (1, length), generator=torch.Generator().manual_seed(1))
    result = {"model": name, "L": length}
    with torch.no_grad():
        model(input_ids=ids[:, :16], use_cache=False)  # warm-up
        start = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        result["forward_s"] = time.perf_counter() - start

        start = time.perf_counter()
        operators, _, errors = mc.build_operators(model, ids)
        result["capture_s"] = time.perf_counter() - start
        result["max_reconstruction_error"] = max(errors.values())

        start = time.perf_counter()
        maps = {key: op.maps("mean") for key, op in operators.items()}
        result["maps_s"] = time.perf_counter() - start

        del operators, maps  # (the blocked maps again below, from a fresh build, for the naive comparison)
        start = time.perf_counter()  # before release_freed_memory(): its mmap threshold slows allocation down
        mc.implicit_attention(model, ids, reduce="mean")
        result["call_s"] = time.perf_counter() - start
        operators, _, _ = mc.build_operators(model, ids)
        maps = {key: op.maps("mean") for key, op in operators.items()}

        if length <= NAIVE_MAX_LENGTH:
            release_freed_memory()
            naive = selective_maps_naive if name == "mamba" else ssd_maps_naive
            keys = list(operators)[:NAIVE_LAYERS]
            with PeakRSS() as memory:
                start = time.perf_counter()
                for key in keys:
                    op = operators[key]
                    reference = naive(op.delta, op.A, op.B, op.C, row_weight=op.row_weight,
                                      col_weight=op.col_weight, conv_weight=op.conv_weight, reduce="mean")
                    reference = reference * op.mask[:, :, None] * op.mask[:, None] if op.mask is not None else reference
                    scale = reference.abs().max().item()
                    result["blocked_vs_naive_rel"] = max(result.get("blocked_vs_naive_rel", 0.0),
                                                         (maps[key] - reference).abs().max().item() / scale)
                elapsed = time.perf_counter() - start
            result["naive_s"] = elapsed * len(operators) / len(keys)
            result["naive_peak_extra_mib"] = memory.extra / 2**20

        del operators, maps
        release_freed_memory()
        with PeakRSS() as memory:
            start = time.perf_counter()
            mc.implicit_attention(model, ids, reduce="mean")
            result["call_instrumented_s"] = time.perf_counter() - start
        result["call_peak_extra_mib"] = memory.extra / 2**20
    return result


def release_freed_memory():
    """Return freed heap memory to the OS and make later large allocations mmapped (so RSS tracks live memory)."""
    import ctypes
    import gc

    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--models", nargs="+", default=["mamba", "mamba2"], choices=["mamba", "mamba2"])
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "L"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], int(args.one[1]))))
        return

    import torch

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| model | L | HF forward (s) | capture + rebuild + check (s) | maps, blocked (s) | whole call (s) "
          "| maps / forward | call / forward | maps, naive (s) | speed-up | naive peak extra (MiB) "
          "| blocked vs naive (rel) | whole call peak extra (MiB) | reconstruction (rel) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        for length in args.lengths:
            out = subprocess.run([sys.executable, __file__, "--one", name, str(length)], capture_output=True,
                                 text=True)
            if out.returncode:
                print(f"| {name} | {length} | failed: {out.stderr.strip().splitlines()[-1]} |", flush=True)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            naive = (f"{r['naive_s']:.1f} | ×{r['naive_s'] / r['maps_s']:.0f} | {r['naive_peak_extra_mib']:.0f} | "
                     f"{r['blocked_vs_naive_rel']:.1e}") if "naive_s" in r else "– | – | – | –"
            forward = r["forward_s"]
            print(f"| {name} | {length} | {forward:.2f} | {r['capture_s']:.2f} | {r['maps_s']:.2f} | {r['call_s']:.2f} "
                  f"| {r['maps_s'] / forward:.2f}× | {r['call_s'] / forward:.2f}× | {naive} | "
                  f"{r['call_peak_extra_mib']:.0f} | {r['max_reconstruction_error']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
