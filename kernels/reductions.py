"""The channel reductions every map kernel offers (shared by the kernels and the library's operators)."""
from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "abs_mean", None)


def reduce_channels(per_channel: torch.Tensor, reduce) -> torch.Tensor:
    """Reduce (B, C, R, L) over C as ``reduce`` says ("mean", "sum", "abs_mean" = mean of |.|); None keeps it."""
    if reduce is None:
        return per_channel
    if reduce == "mean":
        return per_channel.mean(1)
    if reduce == "sum":
        return per_channel.sum(1)
    return per_channel.abs().mean(1)
