"""What every operator shares: the pad mask on the rebuilt tensors and on the maps, the cast to a work dtype, and
the gradient of a target with respect to an operator's output (:mod:`mamba_captum.operators`)."""
from __future__ import annotations

from dataclasses import fields, replace

import torch


def masked_tokens(tensor: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` (B, L, ...) with the padded tokens zeroed (``mask`` (B, L), 1 for real tokens; None: no padding),
    in ``tensor``'s dtype: the adapters' rebuilds re-apply the pad mask where the mixer's forward applies it."""
    return tensor if mask is None else (tensor * mask[:, :, None]).to(tensor.dtype)


def mask_rows_cols(maps: torch.Tensor, mask: torch.Tensor | None, rows) -> torch.Tensor:
    """``maps`` (B, [C,] R, L) with the rows and columns of padding tokens zeroed (``mask`` (B, L), 1 for real
    tokens; None: no padding); ``rows``: the R query rows, None for all L."""
    if mask is None:
        return maps
    row_mask = mask if rows is None else mask[:, rows]
    row_mask = row_mask[:, :, None] * mask[:, None, :]
    return maps * (row_mask if maps.dim() == 3 else row_mask[:, None])


def operator_output_grad(operator, grad_output: torch.Tensor) -> torch.Tensor:
    """The gradient of a target with respect to ``operator.output`` (the operator's own output, e.g. out_proj's
    input), given its gradient with respect to the mixer output: the vector-Jacobian product of ``readout``.

    Args:
        grad_output: (B, L, D_model) for SSM mixers; (B, L, H, d) for softmax layers (readout is the identity).
    Returns:
        a tensor shaped like ``operator.output``, float64.
    """
    with torch.enable_grad():
        output = operator.output.detach().to(torch.float64).requires_grad_(True)
        mixed = operator.readout(output)
        (grad,) = torch.autograd.grad(mixed, output, grad_output.to(mixed.dtype))
    return grad


class CastMixin:
    """``to(dtype)`` for an operator dataclass whose tensors are all cast alike."""

    def to(self, dtype: torch.dtype):
        """The same operator with every floating tensor cast to ``dtype`` and detached (the conv taps may be a view of
        the model's weight)."""
        changes = {f.name: getattr(self, f.name).detach().to(dtype) for f in fields(self)
                   if torch.is_tensor(getattr(self, f.name)) and getattr(self, f.name).is_floating_point()}
        return replace(self, **changes)


def select_channels(operator, index: torch.Tensor):
    """``operator`` restricted to the channels ``index`` (a dataclass operator with ``CHANNEL_FIELDS``: field name ->
    its channel axis): a copy whose per-channel tensors hold those channels only."""
    changes = {}
    for name, axis in operator.CHANNEL_FIELDS.items():
        value = getattr(operator, name)
        if torch.is_tensor(value):
            changes[name] = value.index_select(axis % value.dim(), index.to(value.device))
    return replace(operator, **changes)

