"""Benchmark: Vision Mamba at 224² on CPU: one forward, one forward + backward, all 24 layers' implicit-attention
maps (mean-reduced, unified and hidden), and the three Captum methods, on randomly initialised official
architectures (Vim-S and Vim-Ti, stride 16: L = 197 tokens), batch 1, float32.

Each measurement is the median of ``--repeats`` runs after one warm-up run, in this process, with torch's default
thread count (2 on the project's machine). Target (issue 17): maps and MambaAttribution each under 5 s for Vim-S.

Run:  python benchmarks/bench_vision.py [--models small tiny] [--repeats 3] [--stride 16]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import mamba_captum as mc
from mamba_captum.vision import vim_small, vim_tiny

FACTORIES = {"small": vim_small, "tiny": vim_tiny}


def timed(function, repeats: int) -> float:
    function()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def no_grad(model, pixels):
    with torch.no_grad():
        return model(pixels)


def forward_backward(model, pixels):
    model.zero_grad(set_to_none=True)
    model(pixels)[:, 7].sum().backward()
    model.zero_grad(set_to_none=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["small", "tiny"], choices=sorted(FACTORIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stride", type=int, default=16)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print("| model | L | forward | forward + backward | maps (unified, 24 layers) | maps (hidden) | MambaRawAttention "
          "| MambaRollout | MambaAttribution | MambaAttribution (residual) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model = FACTORIES[name](stride=args.stride).eval()
        pixels = torch.randn(1, 3, 224, 224)
        runs = {
            "forward": lambda: no_grad(model, pixels),
            "forward + backward": lambda: forward_backward(model, pixels),
            "maps unified": lambda: mc.implicit_attention(model, pixels),
            "maps hidden": lambda: mc.implicit_attention(model, pixels, formulation="hidden"),
            "raw": lambda: mc.MambaRawAttention(model).attribute(pixels),
            "rollout": lambda: mc.MambaRollout(model).attribute(pixels),
            "attribution": lambda: mc.MambaAttribution(model).attribute(pixels, target=7),
            "attribution residual": lambda: mc.MambaAttribution(model).attribute(pixels, target=7,
                                                                                gradient_rule="residual"),
        }
        times = {key: timed(run, args.repeats) for key, run in runs.items()}
        length = model.token_layout().length
        print(f"| Vim-{name[0].upper()}{name[1:]} | {length} | " + " | ".join(f"{t:.2f} s" for t in times.values())
              + " |", flush=True)


if __name__ == "__main__":
    main()
