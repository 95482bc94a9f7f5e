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
