"""Benchmark: HF's torch Mamba-2 SSD (``mamba2_chunk_scan``) against the one ``mc.fast_scans`` runs on CPU
(``kernels/scans.py: ssd_scan_reference``), one layer at the mamba2-130m shape (24 heads × 64, one group, N = 128,
HF's chunk 256), batch 1, float32: forward (no grad), and forward + backward of a sum of squares. Best of
``--repeats`` after a warm-up.

Run:  python benchmarks/bench_ssd_scan.py [--lengths 512 1024 2048] [--repeats 3]
"""
from __future__ import annotations

import argparse
import platform

import torch
import transformers as tf
import transformers.models.mamba2.modeling_mamba2 as hf_mamba2

import mamba_captum as mc

from bench_linear_families import best_of  # noqa: E402 (this folder is on sys.path when a script of it runs)


def best(fn, repeats: int) -> float:
    """The best of ``repeats`` timed calls after an untimed warm-up one."""
    fn()
    return best_of(repeats, fn)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tf.logging.set_verbosity_error()
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; one layer, "
          "mamba2-130m shape, batch 1, float32")
    print("| L | HF forward (s) | fast forward (s) | speed-up | HF fwd + bwd (s) | fast fwd + bwd (s) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        g = torch.Generator().manual_seed(0)
        heads, head_dim, state = 24, 64, 128
        x = torch.randn(1, length, heads, head_dim, generator=g).requires_grad_()
        dt = (torch.rand(1, length, heads, generator=g) * 0.1).requires_grad_()
        A = -torch.rand(heads, generator=g)
        B = torch.randn(1, length, 1, state, generator=g).requires_grad_()
        C = torch.randn(1, length, 1, state, generator=g).requires_grad_()

        def forward():
            with torch.no_grad():
                hf_mamba2.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=256)

        def forward_backward():
            hf_mamba2.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=256).square().sum().backward()

        hf = best(forward, args.repeats), best(forward_backward, args.repeats)
        with mc.fast_scans():
            fast = best(forward, args.repeats), best(forward_backward, args.repeats)
        print(f"| {length} | {hf[0]:.3f} | {fast[0]:.3f} | {hf[0] / fast[0]:.1f}× | {hf[1]:.3f} | {fast[1]:.3f} | "
              f"{hf[1] / fast[1]:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
