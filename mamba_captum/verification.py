"""Verification: the rebuilt output of a layer must reproduce the layer's real output (what is checked is what is
returned). :func:`check_reconstruction` compares them and raises :class:`ReconstructionError` (or
:class:`~mamba_captum.checks.NonFiniteError` for a non-finite real output); the engine (the operator rebuild of
:func:`mamba_captum.implicit_attention`, MambaLRP's module checks) calls it for every layer.
"""
from __future__ import annotations

import torch

from .checks import NonFiniteError, nonfinite_parameters

# Largest accepted relative error (max |rebuilt - real| / max |real|) of a rebuilt layer output, by model dtype:
# what the library guarantees for y = H x (README, docs/robustness.md). Real mismatches (a variant the adapter does
# not know) are O(1e-2) or more; HF runs some scans in float32 even for float64 models, hence the float64 bound.
# Half precision: about ten units of the dtype's rounding (2^-11 float16, 2^-8 bfloat16), since the real output
# itself is rounded to it at every step; measured worst over every family's tiny models: 1.0e-3 (float16),
# 1.2e-2 (bfloat16) (tests/test_robustness.py).
TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class ReconstructionError(RuntimeError):
    """The operator rebuilt for a layer does not reproduce that layer's real output."""


def user_hooked(module) -> list[str]:
    """Submodules of a token mixer that carry forward hooks (the library removes its own before rebuilding)."""
    return [name or type(module).__name__ for name, sub in module.named_modules()
            if sub._forward_hooks or sub._forward_pre_hooks]


def check_reconstruction(name: str, real: torch.Tensor, rebuilt: torch.Tensor, dtype: torch.dtype, rows_mask=None, *,
           module=None, layer_input=None):
    """The relative error of the rebuilt layer output; raise if it is above the dtype's tolerance.

    Raises:
        NonFiniteError: the real output holds NaN or inf (naming the layer's non-finite weights, or its input).
        ReconstructionError: the rebuilt output does not reproduce the real one.
    """
    if not bool(torch.isfinite(real).all()):
        culprits = [] if module is None else nonfinite_parameters(module)
        if culprits:
            cause = f"non-finite weights: {', '.join(culprits)}; reload or repair them"
        elif layer_input is not None and not bool(torch.isfinite(layer_input).all()):
            cause = "its input already holds NaN or inf (an earlier layer, the embeddings or inputs_embeds)"
        else:
            cause = (f"its weights and input are finite, so it overflowed in {dtype}: run the model in float32, or "
                     "for an attention layer try another attn_implementation (HF's eager attention gives NaN on "
                     "fully padded rows in float64)")
        raise NonFiniteError(f"mamba_captum: the output of {name} holds NaN or inf ({cause}). Implicit attention "
                             "of non-finite numbers is meaningless.")
    real, rebuilt = real.double(), rebuilt.double()
    diff = (real - rebuilt).abs()
    if rows_mask is not None:  # compare real tokens only: pad rows of softmax layers depend on the mask convention
        keep = rows_mask.bool().reshape(*rows_mask.shape, *([1] * (diff.dim() - 2)))
        diff, real = diff * keep, real * keep
    error, scale = diff.max().item(), real.abs().max().item()
    relative = error / scale if scale > 0 else error
    if not relative <= TOLERANCE.get(dtype, 1e-3):
        hooked = [] if module is None else user_hooked(module)
        hint = (f" Note: {', '.join(hooked)} of this layer carry forward hooks, which the rebuild (from the weights) "
                "does not run; a hook that changes outputs makes the layer a different function." if hooked else "")
        raise ReconstructionError(
            f"mamba_captum: the operator rebuilt for {name} does not reproduce the layer's output "
            f"(max abs error {error:.3g}, relative {relative:.3g}, tolerance {TOLERANCE.get(dtype, 1e-3):g}). "
            "This layer variant is not supported as loaded; please report the model class and config." + hint)
    return relative
