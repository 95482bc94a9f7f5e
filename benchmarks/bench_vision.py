"""Benchmark: vision SSMs at 224² on CPU: one forward, one forward + backward, all layers' implicit-attention maps
(mean-reduced, unified and hidden), and the three Captum methods, on randomly initialised official architectures,
batch 1, float32: Vision Mamba (Vim-S and Vim-Ti, stride 16: L = 197 tokens) and the multi-stage models VMamba-T,
EfficientViM-M2, MambaOut-femto (and MambaVision-T: ``mambavision_tiny``), whose L column lists the stages' token
counts (e.g. 3136/784/196/49).

Each measurement is the median of ``--repeats`` runs after one warm-up run, in this process, with ``--threads``
threads (default: torch's, 2 on the project's machine). Targets: maps and MambaAttribution each under 5 s for Vim-S
(issue 17) and for VMamba-T and EfficientViM-M2 (issue 35).

Run:  python benchmarks/bench_vision.py [--models small tiny vmamba_tiny efficientvim_m2 mambaout_femto]
          [--repeats 3] [--stride 16] [--threads 2]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import mamba_captum as mc
from mamba_captum import vision
from mamba_captum.vision import vim_small, vim_tiny

VIM = {"small": vim_small, "tiny": vim_tiny}
# multi-stage models at their 224² defaults: (factory name in mamba_captum.vision, row name)
STAGED = {"vmamba_tiny": "VMamba-T", "efficientvim_m2": "EfficientViM-M2", "mambaout_femto": "MambaOut-femto",
          "mambavision_tiny": "MambaVision-T"}


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
    parser.add_argument("--models", nargs="+", default=["small", "tiny"], choices=sorted(VIM) + sorted(STAGED))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stride", type=int, default=16, help="Vim's patch stride")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print("| model | L | forward | forward + backward | maps (unified, all layers) | maps (hidden) | MambaRawAttention "
          "| MambaRollout | MambaAttribution | MambaAttribution (residual) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model = VIM[name](stride=args.stride).eval() if name in VIM else getattr(vision, name)().eval()
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
        layout = model.token_layout()
        stages = getattr(layout, "stages", None)
        length = "/".join(str(s.grid[0] * s.grid[1]) for s in stages) if stages else layout.length
        label = STAGED.get(name) or f"Vim-{name[0].upper()}{name[1:]}"
        print(f"| {label} | {length} | " + " | ".join(f"{t:.2f} s" for t in times.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
