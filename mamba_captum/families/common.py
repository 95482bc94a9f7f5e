"""What every adapter uses: running a layer's submodules during a rebuild without their hooks, and the output
projection as a float64 function.

The rebuild recomputes parts of a token mixer after the real forward pass. Calling the submodules as modules would
fire the user's forward hooks (and pre-hooks) a second time per call; calling ``module.forward`` runs the same
computation without the module's own hooks (accelerate's device hooks, which wrap ``forward`` itself, still run).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def run(module, *args):
    """``module(*args)`` without ``module``'s forward hooks (a plain function is just called)."""
    return module.forward(*args) if isinstance(module, nn.Module) else module(*args)


def _plain_linear(module) -> bool:
    return type(module).forward is nn.Linear.forward


def linear_readout(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The output projection as a float64 function (for the vector-Jacobian products of gradient methods).

    A plain ``nn.Linear`` is applied in float64 from its weights; any other module (an unmerged LoRA layer, a
    quantized linear) through its own forward in its own dtype, so that its real function is what is
    differentiated, not just its base weight.
    """
    if _plain_linear(module):
        weight = module.weight.to(torch.float64)
        bias = None if module.bias is None else module.bias.to(torch.float64)
        return lambda y: F.linear(y, weight, bias)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return lambda y: module.forward(y.to(dtype)).to(torch.float64)


def same_conv_kernel(conv: nn.Conv2d, what: str, depthwise: bool = True, square: bool = False) -> tuple[int, int]:
    """The (kh, kw) of a stride-1, dilation-1, 'same' zero-padded Conv2d with odd kernels that keeps its channels:
    depthwise (``groups`` = channels: a 2-D band per channel) or, with ``depthwise=False``, full (``groups`` = 1);
    ``square``: kh = kw too.

    Raises:
        TypeError: naming ``what`` and what differs (the band would not describe the conv)."""
    kh, kw = conv.kernel_size
    expected = dict(stride=(1, 1), dilation=(1, 1), padding=(kh // 2, kw // 2), padding_mode="zeros",
                    groups=conv.in_channels if depthwise else 1)
    actual = dict(stride=tuple(conv.stride), dilation=tuple(conv.dilation), padding=tuple(conv.padding),
                  padding_mode=conv.padding_mode, groups=conv.groups)
    if actual != expected or kh % 2 == 0 or kw % 2 == 0 or (square and kh != kw) \
            or conv.out_channels != conv.in_channels:
        raise TypeError(f"mamba_captum: {what} is not a {'depthwise' if depthwise else 'full'}, stride-1, 'same' "
                        f"zero-padded conv with {'a square' if square else 'an'} odd kernel (kernel "
                        f"{tuple(conv.kernel_size)}, {actual}); this variant is not supported.")
    return kh, kw


def batch_norm_affine(norm: nn.Module, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval-mode BatchNorm2d as a per-channel affine ``scale ⊙ y + shift``: (scale, shift) float64 (C,).

    Raises:
        TypeError: not a BatchNorm2d. ValueError: it uses batch statistics (train mode, or no running statistics),
            so that each image's output depends on the others of the batch, which no per-image operator describes."""
    if not isinstance(norm, nn.BatchNorm2d):
        raise TypeError(f"mamba_captum: {what} is normalised by {type(norm).__name__}; only BatchNorm2d (an affine "
                        "per channel in eval mode) is supported.")
    if norm.training or norm.running_mean is None:
        raise ValueError(f"mamba_captum: {what}'s BatchNorm2d uses batch statistics (train mode): its output then "
                         "depends on the other images of the batch, which no per-image operator describes. Explain "
                         "the model in eval mode (model.eval()).")
    scale = norm.running_var.double().add(norm.eps).rsqrt()
    if norm.weight is not None:
        scale = scale * norm.weight.double()
    shift = -norm.running_mean.double() * scale
    if norm.bias is not None:
        shift = shift + norm.bias.double()
    return scale, shift


def rerun_under_hooks(module, hidden_states, options, handles, work_dtype):
    """The attention module's own forward on ``hidden_states`` (without the layer's own hooks), while the forward
    hooks ``handles`` replace its submodules' outputs by their LRP rules; the hooks removed after it. Returns the
    output in ``work_dtype``."""
    try:
        output, _ = type(module).forward(module, hidden_states, **options)
    finally:
        for handle in handles:
            handle.remove()
    return output.to(work_dtype)
