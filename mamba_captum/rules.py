"""The LRP rules of MambaLRP (Rezaei Jafari et al., NeurIPS 2024) as differentiable expressions.

Relevance is gradient × input of a forward pass in which every non-linear step is replaced by a *rule*: an
expression with the same value whose gradient, times the step's input, splits the step's output exactly over
its inputs (conservation). Each rule here is linear in its non-detached arguments, so a network built from them
and from linear layers is linear in its input (and its biases) with coefficients frozen at the explained point:
Euler's identity then gives Σ input · gradient + Σ bias · gradient = output.

- :func:`identity_rule` (SiLU, sigmoid, GELU, ... used as an activation ``y = act(x)``): ``x · (act(x) / x)``, the
  ratio detached; all of the output's relevance goes to x.
- :func:`half_product` (a multiplicative gate ``y = a ⊙ b`` whose two factors both depend on the input): ``½ a ⊙
  b̄ + ½ ā ⊙ b`` (bars: detached); each factor receives half of the product's relevance.
- :func:`sigmoid_gate` (``σ(r) ⊙ v``, a sigmoid gate on a value): by default the gate is detached ("signal takes
  all", Arras et al. for LSTM gates): the identity rule's ratio σ(r)/r is unbounded near r = 0 (σ(0) = ½), which
  makes the relevances of the gate's inputs large and cancelling; ``sigmoid_gates="half"`` uses the half rule with
  σ's identity rule instead.
- :func:`scaled` (a data-dependent factor that is not explained, such as a normaliser ``1/rms(x)``, a softmax
  ``P``, the selection parameters Δ, B, C of a scan): ``x · s̄``; the relevance of ``y = s x`` goes to x.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch


def ratio(numerator: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``numerator / x``, detached, and 0 where x is 0 (there ``x · ratio`` is 0: a value ``numerator`` ≠ 0 there is
    a constant of the step, which no input can take; :func:`identity_rule` keeps it as such)."""
    numerator, x = numerator.detach(), x.detach()
    zero = x == 0
    return torch.where(zero, torch.zeros_like(x), numerator / torch.where(zero, torch.ones_like(x), x))


def identity_rule(x: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
    """The identity rule for ``activated = act(x)`` (element-wise): ``x · (act(x) / x)̄``, plus ``act(x)̄`` where x is
    exactly 0 (a constant). Same value; the gradient is the detached ratio."""
    r = ratio(activated, x).to(x.dtype)
    constant = torch.where(x.detach() == 0, activated.detach().to(x.dtype), torch.zeros_like(r))
    return x * r + constant


def silu_rule(x: torch.Tensor) -> torch.Tensor:
    """The identity rule for SiLU: ``x · σ(x)̄`` (SiLU's ratio is σ itself: no division)."""
    return x * torch.sigmoid(x.detach())


def half_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The half rule for a gate ``a ⊙ b`` whose two factors both carry relevance: ``½ a b̄ + ½ ā b``. Same value;
    the product's relevance ``R`` splits into ``½ R`` for a and ``½ R`` for b."""
    return 0.5 * a * b.detach() + 0.5 * a.detach() * b


def scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x · scalē``: a data-dependent factor (a normaliser, a probability, a decay) that takes no relevance."""
    return x * scale.detach()


def rms_norm_rule(x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """An RMS norm ``y = w ⊙ x / rms(x)`` with the normaliser detached: ``x · (y / x)̄``, whose ratio is exactly
    ``w / rms(x)`` (any weight form: ``w``, ``1 + w``). The relevance of y_i goes to x_i."""
    return identity_rule(x, output)


def layer_norm_rule(x: torch.Tensor, weight, bias, eps: float, dims: int = 1) -> torch.Tensor:
    """A layer norm ``y = w ⊙ (x − μ(x)) / σ(x) + b`` with σ detached (the centring is linear and kept): linear in x
    and b, so x takes ``w ⊙ (x − μ) / σ`` and the bias its own value.

    Args:
        dims: how many trailing dimensions are normalised together."""
    axes = tuple(range(-dims, 0))
    centred = x - x.mean(axes, keepdim=True)
    std = torch.sqrt(x.detach().var(axes, unbiased=False, keepdim=True) + eps)
    out = centred / std
    if weight is not None:
        out = out * weight.to(out.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


SIGMOID_GATE_RULES = ("signal", "half")
_SIGMOID_GATES = contextvars.ContextVar("mamba_captum_sigmoid_gates", default="signal")


@contextlib.contextmanager
def sigmoid_gates(rule: str):
    """Choose the rule of :func:`sigmoid_gate` while the context is open (this thread / context only)."""
    if rule not in SIGMOID_GATE_RULES:
        raise ValueError(f"mamba_captum: sigmoid_gates={rule!r}; choose one of {SIGMOID_GATE_RULES}.")
    token = _SIGMOID_GATES.set(rule)
    try:
        yield
    finally:
        _SIGMOID_GATES.reset(token)


def sigmoid_gate_rule() -> str:
    """The rule :func:`sigmoid_gate` applies now: ``"signal"`` or ``"half"``."""
    return _SIGMOID_GATES.get()


def sigmoid_gate(pre: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A sigmoid gate ``σ(pre) ⊙ value``, both depending on the input: ``σ(pre)̄ ⊙ value`` (signal takes all, the
    default) or ``½ σ(pre) v̄ + ½ σ(pre)̄ v`` with σ by the identity rule (``sigmoid_gates("half")``)."""
    gate = torch.sigmoid(pre.detach())
    if _SIGMOID_GATES.get() == "half":
        return half_product(identity_rule(pre, gate), value)
    return value * gate
