"""Benchmark: the map kernels' channel reductions on CPU, "mean" against "abs_mean" (and reduce=None where it fits).

One layer's operator inputs drawn at real shapes, batch 1, float32 inputs, L tokens:
  selective  Mamba-1 130m: D = 1536 channels, N = 16, conv K = 4, row and column weights;
  ssd        Mamba-2 130m: 24 heads × 64, one group, N = 128, conv K = 4, row and column weights;
  decay      RWKV-4-430m: width 1024, log_q / log_k and a row weight, no conv;
  decay+conv Griffin: width 1024, row and column weights and a conv K = 4.
Each figure is the best of ``--repeats`` calls after a warm-up one.

Run:  python benchmarks/bench_reductions.py [--length 1024] [--repeats 2] [--none-length 256]
"""
from __future__ import annotations

import argparse
import platform

import torch

from mamba_captum.kernels.decay import decay_maps
from mamba_captum.kernels.selective import selective_maps
from mamba_captum.kernels.ssd import ssd_maps

from bench_linear_families import best_of  # noqa: E402 (this folder is on sys.path when a script of it runs)


def kernels(length: int):
    g = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    D, N = 1536, 16
    s6 = dict(delta=rand(1, length, D) * 0.1, A=-rand(D, N), B=randn(1, length, N), C=randn(1, length, N),
              row_weight=randn(1, length, D), col_weight=rand(1, length, D), conv_weight=randn(D, 4))
    H, P, N2 = 24, 64, 128
    ssd = dict(delta=rand(1, length, H) * 0.1, A=-rand(H), B=randn(1, length, 1, N2), C=randn(1, length, 1, N2),
               row_weight=randn(1, length, H, P), col_weight=rand(1, length, H, P), conv_weight=randn(H, P, 4))
    W = 1024
    rwkv = dict(log_decay=rand(1, length, W) * 0.1, log_q=-rand(1, length, W), log_k=randn(1, length, W),
                row_weight=randn(1, length, W))
    griffin = dict(log_decay=rand(1, length, W) * 0.1, row_weight=randn(1, length, W),
                   col_weight=rand(1, length, W), conv_weight=randn(W, 4))
    return {"selective (Mamba-1 130m)": lambda reduce: selective_maps(**s6, reduce=reduce),
            "ssd (Mamba-2 130m)": lambda reduce: ssd_maps(**ssd, reduce=reduce),
            "decay (RWKV-430m)": lambda reduce: decay_maps(**rwkv, reduce=reduce),
            "decay + conv (Griffin)": lambda reduce: decay_maps(**griffin, reduce=reduce)}


def best(fn, repeats: int) -> float:
    """The best of ``repeats`` timed calls after an untimed warm-up one."""
    fn()
    return best_of(repeats, fn)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--none-length", type=int, default=256, help="L for reduce=None (its output is C·L²)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, batch 1, "
          f"one layer; mean / abs_mean at L = {args.length}, reduce=None at L = {args.none_length}")
    print("| kernel | mean (s) | abs_mean (s) | abs_mean / mean | reduce=None (s) |")
    print("|---|---|---|---|---|")
    small = kernels(args.none_length)
    for name, fn in kernels(args.length).items():
        mean = best(lambda: fn("mean"), args.repeats)
        absolute = best(lambda: fn("abs_mean"), args.repeats)
        none = best(lambda: small[name](None), args.repeats)
        print(f"| {name} | {mean:.2f} | {absolute:.2f} | {absolute / mean:.1f}× | {none:.2f} |", flush=True)


if __name__ == "__main__":
    main()
