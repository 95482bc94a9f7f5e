"""Check: the library's EfficientViM and MambaOut against timm's own models (needs timm, which needs a torchvision
that imports beside your torch). For each registered name: timm's model with random weights everywhere, its
library copy through ``mamba_captum.vision.from_timm`` (which itself refuses a copy whose logits differ), and the
largest logit difference on two random images.

Run:  python benchmarks/timm_parity.py [--models efficientvim_m1 mambaout_femto ...]
"""
from __future__ import annotations

import argparse

import torch

from mamba_captum.vision import from_timm

MODELS = ("efficientvim_m1", "efficientvim_m2", "efficientvim_m3", "efficientvim_m4", "mambaout_femto",
          "mambaout_kobe", "mambaout_tiny", "mambaout_small_rw")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    import timm

    print(f"timm {timm.__version__}, torch {torch.__version__}")
    print("| model | library class | variant | max abs logit difference | max abs logit |")
    print("|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False).eval()
        with torch.no_grad():  # random weights everywhere: timm zero-initialises some, which would hide terms
            for parameter in model.parameters():
                parameter.normal_(0, 0.05) if parameter.dim() > 1 else parameter.uniform_(-0.5, 0.5)
        copy = from_timm(model)
        pixels = torch.randn(2, 3, *copy.token_layout().img_size)
        with torch.no_grad():
            theirs, ours = model(pixels), copy(pixels)
        print(f"| {name} | {type(copy).__name__} | {copy.variant} | {float((theirs - ours).abs().max()):.2g} | "
              f"{float(theirs.abs().max()):.3g} |", flush=True)


if __name__ == "__main__":
    main()
