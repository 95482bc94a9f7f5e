"""GPU benchmark: implicit-attention maps of all 24 layers of a mamba-130m-shaped model, Triton vs blocked torch vs
naive, at L = 1024, 4096, 8192 — time, peak memory, and the map kernel's achieved TFLOP/s against the fp32 peak.

One layer's operator inputs are drawn at the 130m shapes (D = 1536, N = 16, K = 4, batch 1; delta, B, C, row and
column weights as the unified formulation's ``H_c = diag(row) α_c diag(col) M_c``); every layer has the same
shapes, so the 24-layer figure is 24 × one layer (measured on ``--layers-measured`` layers). The useful work of a
reduced map is L²/2 pairs below the diagonal × D·N multiply-adds (2 flops each); "TFLOP/s" = L²·D·N·layers / time
(25.8 GFLOP a layer at L = 1024, the GEMM floor of ../shared/reference/performance-notes.md).
The naive kernel builds per-channel (L × L) stacks and runs only where it fits (--naive-max). The first column
checks the Triton maps against the blocked torch ones (max |Δ| / max |ref|).

Run on a CUDA machine:  python benchmarks/bench_gpu_maps.py [--lengths 1024 4096 8192]
Also there:             TRITON_INTERPRET=0 pytest tests/test_kernels_triton.py  (compiled kernels vs references)
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from mamba_captum.kernels.selective import selective_maps_blocked, selective_maps_naive, selective_maps_triton

FP32_PEAK_TFLOPS = {"H100": 67.0, "H200": 67.0, "A100": 19.5, "L40S": 91.6}  # vendor fp32 (non-tensor) peaks


def layer_inputs(length, channels=1536, state=16, taps=4, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.rand(*s, generator=g, device="cuda")  # noqa: E731
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    return dict(delta=torch.nn.functional.softplus(randn(1, length, channels) - 4), A=-rand(channels, state) * 8,
                B=randn(1, length, state), C=randn(1, length, state), row_weight=randn(1, length, channels),
                col_weight=randn(1, length, channels), conv_weight=randn(channels, taps) / 2)


def timed(fn, repeats):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    return out, seconds, (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 8192])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--layers-measured", type=int, default=3)
    parser.add_argument("--naive-max", type=int, default=1024)
    parser.add_argument("--blocked-max", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (the CPU figures come from bench_implicit_attention.py)")
        sys.exit(2)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in FP32_PEAK_TFLOPS.items() if k in name), None)
    print(f"# {name}, torch {torch.__version__}, mamba-130m shapes (D=1536, N=16, K=4), batch 1, reduce='mean', "
          f"unified weights, {args.layers} layers = {args.layers} × one layer")
    print("| L | kernel | Triton vs blocked (rel) | time, all layers (s) | peak memory (GiB) | TFLOP/s | % of fp32 peak |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        inputs = layer_inputs(length)
        flops = float(length) * length * 1536 * 16 * args.layers
        kernels = {"triton (ieee)": lambda: selective_maps_triton(**inputs, reduce="mean"),
                   "triton (tf32)": lambda: selective_maps_triton(**inputs, reduce="mean", precision="tf32")}
        if length <= args.blocked_max:
            kernels["blocked torch"] = lambda: selective_maps_blocked(**inputs, reduce="mean")
        if length <= args.naive_max:
            kernels["naive"] = lambda: selective_maps_naive(**inputs, reduce="mean")
        for precision in ("ieee", "tf32"):  # compile both variants outside the timings
            selective_maps_triton(**inputs, reduce="mean", precision=precision)
        reference = None
        for kernel, fn in kernels.items():
            out, seconds, memory = timed(fn, args.layers_measured)
            if kernel == "blocked torch":
                reference = out
            total = seconds * args.layers
            tflops = flops / total / 1e12
            share = f"{100 * tflops / peak:.0f} %" if peak else "?"
            check = "—"
            if kernel.startswith("triton") and length <= args.blocked_max:
                reference = selective_maps_blocked(**inputs, reduce="mean") if reference is None else reference
                check = f"{((out - reference).abs().max() / reference.abs().max()).item():.1e}"
            print(f"| {length} | {kernel} | {check} | {total:.3f} | {memory:.2f} | {tflops:.1f} | {share} |",
                  flush=True)
            del out


if __name__ == "__main__":
    main()
