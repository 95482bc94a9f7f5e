"""Benchmark: gated linear attention forward + backward, chunked vs the token loops (ours and fla's).

One layer's worth of GLA at B = 1, L = 1024, H = 4, K = 128, V = 256, float32: ``gated_linear_chunked`` (at each
--chunk-sizes value; the default chunk size is marked), ``gated_linear_recurrent`` (our token loop) and fla's
``naive_recurrent_gla`` (per-channel decays; for one decay per head its expanded copy) — forward, then backward of a
random projection of the output to q, k, v and the log decays. Prints seconds (the fastest of --repeats runs,
--naive-repeats for the token loops: the machine may be shared) and the speed-ups of the chunked form, for
per-channel and scalar decays, and the largest relative difference of the chunked output from the float64 loop.

Run:  python benchmarks/bench_gated_linear.py [--length 1024] [--threads 2] [--repeats 3] [--naive-repeats 2]
      [--chunk-sizes 32 64 128] [--clock wall|cpu] [--skip-naive]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F
from fla.ops.gla.naive import naive_recurrent_gla

from mamba_captum.kernels.gated_linear import gated_linear_chunked, gated_linear_recurrent
from mamba_captum.kernels.gated_linear.chunked import CHUNK_SIZE


def forward_backward(function, inputs, projection, clock):
    """Seconds for one forward and one backward (gradients of q, k, v, log decay)."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    start = clock()
    out = function(*inputs)
    torch.autograd.grad((out * projection).sum(), inputs)
    return clock() - start


def best_of(repeats, function, inputs, projection, clock):
    return min(forward_backward(function, inputs, projection, clock) for _ in range(repeats))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--key-dim", type=int, default=128)
    parser.add_argument("--value-dim", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-repeats", type=int, default=2, help="runs of the (slow) token loops")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (with --threads 1, robust to other load on the machine)")
    parser.add_argument("--skip-naive", action="store_true", help="time only the chunked form (chunk-size tuning)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.manual_seed(0)
    shape = (args.batch, args.length, args.heads)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads; "
          f"B={args.batch} L={args.length} H={args.heads} K={args.key_dim} V={args.value_dim} float32, "
          f"forward + backward, {args.clock} seconds, best of {args.repeats} ({args.naive_repeats} for the loops)")
    q = torch.randn(*shape, args.key_dim)
    k = torch.randn(*shape, args.key_dim)
    v = torch.randn(*shape, args.value_dim)
    projection = torch.randn(*shape, args.value_dim)
    decays = {"per-channel": F.logsigmoid(torch.randn(*shape, args.key_dim) + 2.0),
              "scalar": F.logsigmoid(torch.randn(*shape) + 2.0)}
    for kind, log_decay in decays.items():
        default = CHUNK_SIZE
        inputs = (q, k, v, log_decay)
        print(f"\n{kind} decay")
        chunked_times = {}
        for size in sorted(set(args.chunk_sizes) | {default}):
            seconds = best_of(args.repeats, lambda *x, size=size: gated_linear_chunked(*x, chunk_size=size)[0],
                              inputs, projection, clock)
            chunked_times[size] = seconds
            print(f"  chunked C={size:<4d}{' (default)' if size == default else '          '} {seconds:9.4f} s")
        chunked = chunked_times[default]
        reference = gated_linear_recurrent(*(x.double() for x in inputs))[0]
        error = ((gated_linear_chunked(*inputs)[0].double() - reference).abs().max() / reference.abs().max()).item()
        print(f"  chunked float32 vs float64 token loop: max relative difference {error:.1e}")
        if args.skip_naive:
            continue
        ours = best_of(args.naive_repeats, lambda *x: gated_linear_recurrent(*x)[0], inputs, projection, clock)
        print(f"  naive (ours, token loop)   {ours:9.4f} s   chunked is {ours / chunked:6.1f}x faster")

        def fla_naive(q, k, v, g):
            if g.dim() == 3:  # naive_recurrent_gla takes per-channel decays only
                g = g[..., None].expand_as(q)
            return naive_recurrent_gla(q, k, v, g)[0]
        fla = best_of(args.naive_repeats, fla_naive, inputs, projection, clock)
        print(f"  fla naive_recurrent_gla    {fla:9.4f} s   chunked is {fla / chunked:6.1f}x faster")


if __name__ == "__main__":
    main()
