"""MambaLRP's run-time conservation guard: its tolerances, and the ledger that records and compares the relevance.

- :data:`CONSERVATION_TOLERANCE`: the largest relative gap accepted, per dtype, for one replaced computation and for
  the whole model (:func:`conservation_tolerance`).
- The ledger (:class:`ConservationLedger`): gradient hooks on each replaced computation's inputs and output, and on
  the bias of every ``nn.Linear`` outside them, record during the one backward pass what relevance enters and leaves
  each of them, per example; :meth:`ConservationLedger.gaps` compares, one :class:`ConservationGap` per comparison.
- The biases: :func:`rule_biases` (those the rules read) must require grad during the call (:func:`requiring_grad`),
  their gradients giving the biases' shares.

:class:`mamba_captum.lrp_forward.LRPForward` sets the hooks; :class:`mamba_captum.attr.MambaLRP` raises
:class:`mamba_captum.attr.ConservationError` for a failed comparison.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from .families.lrp_plan import PlannedRule


# The largest relative conservation gap accepted, per dtype of the model. "module": one replaced computation,
# |relevance out − relevance in − its biases' share| over the larger of Σ|∂f̃/∂y ⊙ y| and Σ|∂f̃/∂x ⊙ x| (the terms its
# sums round); the rules compute in the work dtype, so this is that dtype's rounding even where the model keeps a
# step in a lower precision. "model": the whole explanation, |Σ relevance + the biases' share − the explained score|
# over the largest of those terms and of the relevance through any one module; it also carries the model's own
# rounding between the modules (its half-precision residual stream, a float64 model's residual_in_fp32).
# Measured worst over every family's tiny models (benchmarks/lrp_conservation.py --guard; docs/methods/lrp.md, "The
# conservation guard"): module 3.9e-16 / 1.7e-7 / 3.8e-4 / 1.8e-3 and model 2.6e-8 / 1.4e-7 / 4.3e-4 / 4.5e-3 in
# float64 / float32 / float16 / bfloat16: the bounds sit 20-700× above (2·10⁴× for float64's modules, whose bound
# still catches one float32 step in a rule: 1.5e-8).
CONSERVATION_TOLERANCE = {
    torch.float64: {"module": 1e-11, "model": 1e-5},
    torch.float32: {"module": 1e-4, "model": 1e-4},
    torch.float16: {"module": 1e-2, "model": 2e-2},
    torch.bfloat16: {"module": 5e-2, "model": 1e-1},
}


def conservation_tolerance(dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """The guard's tolerances for a model of ``dtype`` on ``device``: :data:`CONSERVATION_TOLERANCE`, bfloat16's for
    any other (8-bit) dtype; a float32 model on CUDA with TF32 matmuls allowed (``torch.set_float32_matmul_precision``
    "high" or "medium") gets float16's, TF32 keeping float16's 10-bit mantissa in its products."""
    if dtype == torch.float32 and device is not None and device.type == "cuda" and \
            torch.backends.cuda.matmul.allow_tf32:
        return CONSERVATION_TOLERANCE[torch.float16]
    return CONSERVATION_TOLERANCE.get(dtype, CONSERVATION_TOLERANCE[torch.bfloat16])


@dataclass(eq=False)
class ConservedUnit:
    """One replaced computation (a module with a rule, a softmax layer's value path, a soft-capped head).

    ``readings``: per watched tensor, its gradient hook's latest reading (a float16 explanation runs the backward
    twice, :func:`mamba_captum.attr._gradient.scaled_grad`: the last one is the one explained). From them
    :meth:`ConservationLedger.gaps` fills the per-example sums, (B,) float64, and ``unsplit``: the sums of tensors
    whose leading dimension was neither B nor B·L, known for the whole batch only."""

    name: str
    module: nn.Module | None  # the module replaced (None: a softmax layer's value path, a soft-capped head)
    biases: list = field(default_factory=list)  # the bias tensors its rule read (an offloaded module's: as loaded)
    readings: dict = field(default_factory=dict)  # (side, slot) -> (Σ per example or None, Σ|·| likewise, Σ, Σ|·|)
    relevance_out: torch.Tensor | None = None  # Σ ∂f̃/∂y ⊙ y over its output y
    relevance_in: torch.Tensor | None = None  # Σ ∂f̃/∂x ⊙ x over its differentiable inputs x, through it only
    magnitude_out: torch.Tensor | None = None  # Σ |∂f̃/∂y ⊙ y|
    magnitude_in: torch.Tensor | None = None  # Σ |∂f̃/∂x ⊙ x|
    unsplit: dict = field(default_factory=lambda: {"out": 0.0, "in": 0.0, "magnitude": 0.0})
    per_example: bool = True  # every tensor could be split per example (else ``unsplit`` holds some sums)
    overwritten: bool = False  # an input or the output was modified in place before the backward read it
    after_head: bool = False  # downstream of the model's output head (the soft cap of its logits)
    # the dtypes of its watched inputs: one the model itself keeps in a lower precision than its own (Inkling2's
    # float32 residual stream in a float64 model) rounds the gradients it reads to that precision
    input_dtypes: set = field(default_factory=set)

    @property
    def defect(self) -> torch.Tensor:
        """(B,) relevance out − relevance in: its biases' (and constants') share where the rule conserves."""
        return self.relevance_out - self.relevance_in


@dataclass
class ConservationGap:
    """One failed (or, when measuring, any) conservation comparison: ``gap`` absolute, ``relative`` = gap / scale."""

    where: str  # the module's path and class, or "the whole model"
    example: int | None  # None: compared over the whole batch
    gap: float
    scale: float
    tolerance: float

    @property
    def relative(self) -> float:
        return self.gap / self.scale if self.scale > 0 else (0.0 if self.gap == 0 else float("inf"))


def bias_parameters(module: nn.Module | None) -> list:
    """The floating parameters named ``*bias`` of ``module``'s subtree (the additive constants its rule can read)."""
    if module is None:
        return []
    return [p for name, p in module.named_parameters() if name.endswith("bias") and p.is_floating_point()]


def rule_biases(plan: list[PlannedRule]) -> list:
    """The biases the rules of ``plan`` can read (deduplicated): the guard needs their gradients, whose products with
    them are the modules' bias shares (summed over the examples), so they must require grad during the call."""
    seen, out = set(), []
    for planned in plan:
        replaced = planned.soft_cap is None and planned.feeds is None  # not a soft cap, nor upstream of the leaf
        for p in bias_parameters(planned.module if replaced else None):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


@contextlib.contextmanager
def requiring_grad(parameters: list):
    """``parameters`` require grad while the context is open (a frozen bias still has a share, which the guard reads
    from its gradient); their flags are restored on exit."""
    frozen = [p for p in parameters if not p.requires_grad and p.is_leaf]
    try:
        for p in frozen:
            p.requires_grad_(True)
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


class ConservationLedger:
    """What MambaLRP's run-time conservation guard reads, recorded by gradient hooks during the explanation's own
    backward pass (no pass of its own): per replaced computation, the relevance that enters its output and leaves
    through its inputs; per ``nn.Linear`` with a bias outside them, its bias's share ``Σ ∂f̃/∂y ⊙ b``.

    By Euler's identity for f̃ (linear in the embeddings and the biases), summed per example:
    ``Σ_t R[t] + Σ_units (out − in) + Σ_linear bias shares = Σ ∂f̃/∂z ⊙ z`` (z the output head's output: the explained
    logit itself for the model's own scores) wherever every step outside the units is linear, and per unit
    ``out − in`` = the share of the biases it reads (0 without biases) wherever its rule conserves.

    Args:
        batch, length: B and L of the explained inputs (tensors are split per example along a leading B or B·L).
        device: where the per-example sums live.
    """

    def __init__(self, batch: int, length: int, device):
        self.batch, self.length, self.device = batch, length, device
        self.units: list[ConservedUnit] = []
        self.linear_readings: dict = {}  # slot -> the latest reading of a linear layer's bias share (as for units)
        self.head_readings: list = []  # per call of the model's output head: the latest reading of Σ ∂f̃/∂z ⊙ z
        self.linear_share = self._zeros()  # (B,) Σ over the linear layers outside the units of ∂f̃/∂y ⊙ b
        self.linear_magnitude = self._zeros()
        self.linear_unsplit = 0.0
        self.outside_biases: list = []  # biases outside the units not held by an nn.Linear (none in covered models)
        self.skipped: list[str] = []  # what :meth:`gaps` could not compare, and why

    def _zeros(self):
        return torch.zeros(self.batch, dtype=torch.float64, device=self.device)

    def _split(self, product: torch.Tensor):
        """(B,) sums of an element-wise product over all but the examples, or None (leading dim not B or B·L)."""
        if product.dim() >= 1 and product.shape[0] in (self.batch, self.batch * self.length):
            return product.reshape(self.batch, -1).sum(-1)
        return None

    def unit(self, name: str, module: nn.Module | None) -> ConservedUnit:
        """A new replaced computation, ``name`` for the messages; its hooks are set by :meth:`watch_inputs` and
        :meth:`watch_output`."""
        unit = ConservedUnit(name, module)
        self.units.append(unit)
        return unit

    def _reading(self, product: torch.Tensor) -> tuple:
        """(per-example Σ or None, per-example Σ|·| or None, Σ, Σ|·|) of an element-wise product."""
        split = self._split(product)
        if split is not None:
            return split, self._split(product.abs()), 0.0, 0.0
        return None, None, float(product.sum()), float(product.abs().sum())

    def watch_inputs(self, unit: ConservedUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with every tensor that carries the graph replaced by a view whose gradient (this
        computation's share of the tensor's gradient) the ledger reads."""
        slots = iter(range(len(args) + len(kwargs)))

        def watch(value):
            if not (torch.is_tensor(value) and value.is_floating_point() and value.requires_grad):
                return value
            unit.input_dtypes.add(value.dtype)
            view = value.view_as(value)
            view.register_hook(functools.partial(self._on_grad, unit, ("in", next(slots)), view.detach(),
                                                 view._version))
            return view

        return tuple(watch(a) for a in args), {k: watch(v) for k, v in kwargs.items()}

    def watch_output(self, unit: ConservedUnit, output: torch.Tensor, slot: int = 0) -> None:
        """The replaced computation's output ``slot`` (0: its main output; a rule may replace several)."""
        if output.requires_grad:
            output.register_hook(functools.partial(self._on_grad, unit, ("out", slot), output.detach(),
                                                   output._version))

    def watch_linear(self, bias: torch.Tensor, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(functools.partial(self._on_linear_grad, len(self.linear_readings), bias.detach()))
            self.linear_readings[len(self.linear_readings)] = None

    def watch_head(self, output: torch.Tensor) -> None:
        """The model's output head (its output embeddings, or a classifier's score layer): the relevance entering the
        model at its output, what the whole-model comparison explains (a forward_func's own operations after the
        head are differentiated as they are, linear or not)."""
        if output.requires_grad:
            slot = len(self.head_readings)
            self.head_readings.append(None)
            output.register_hook(functools.partial(self._on_head_grad, slot, output.detach(), output._version))

    def _on_grad(self, unit, slot, value, version, grad):
        if value._version != version:
            unit.overwritten = True
            return
        unit.readings[slot] = self._reading(grad.detach().double() * value.double())

    def _on_head_grad(self, slot, value, version, grad):
        if value._version == version:
            self.head_readings[slot] = self._reading(grad.detach().double() * value.double())

    def _on_linear_grad(self, slot, bias, grad):
        self.linear_readings[slot] = self._reading(grad.detach().double() * bias.double())

    def _settle(self, grad_scale: float) -> None:
        """The per-example sums from the hooks' latest readings, divided by the backward's loss scale."""
        def total(readings):
            per_example, magnitude, unsplit, unsplit_magnitude = self._zeros(), self._zeros(), 0.0, 0.0
            split = True
            for reading in readings:
                if reading is None:
                    continue
                if reading[0] is None:
                    split, unsplit, unsplit_magnitude = False, unsplit + reading[2], unsplit_magnitude + reading[3]
                else:
                    per_example, magnitude = per_example + reading[0], magnitude + reading[1]
            return (per_example / grad_scale, magnitude / grad_scale, unsplit / grad_scale,
                    unsplit_magnitude / grad_scale, split)

        for unit in self.units:
            unit.unsplit["magnitude"], unit.per_example = 0.0, True
            for side in ("out", "in"):
                found = total(r for (s, _), r in unit.readings.items() if s == side)
                setattr(unit, f"relevance_{side}", found[0])
                setattr(unit, f"magnitude_{side}", found[1])
                unit.unsplit[side] = found[2]
                unit.unsplit["magnitude"] += found[3]
                unit.per_example = unit.per_example and found[4]
        self.linear_share, self.linear_magnitude, self.linear_unsplit, _, _ = total(self.linear_readings.values())

    def gaps(self, relevance: torch.Tensor, magnitude: torch.Tensor, score: torch.Tensor, bias_grads: dict,
             dtype: torch.dtype, grad_scale: float = 1.0) -> list[ConservationGap]:
        """Every comparison of the guard, module by module in execution order, then the whole model. What cannot be
        compared is named in :attr:`skipped`.

        Args:
            relevance: (B,) Σ_t R[b, t], float64; magnitude: (B,) Σ_t |R[b, t]|.
            score: (B,) the explained score of the modified forward (what the relevance explains).
            bias_grads: id(parameter) -> ∂(Σ_b score_b)/∂parameter (None: no path), for :func:`rule_biases` and
                :attr:`outside_biases`.
            dtype: the model's dtype (the tolerances).
            grad_scale: the loss scale of the backward the hooks read last (float16), which they are divided by.
        Returns:
            per module, the worst example's gap; over the batch where its rule reads non-zero biases (their
            gradients are sums over the examples) or a tensor could not be split per example. Then the whole
            model's gap per example (over the batch where a bias outside the modules is not an ``nn.Linear``'s).
        """
        tolerance = conservation_tolerance(dtype, score.device)
        self._settle(grad_scale)
        self.skipped = []
        out: list[ConservationGap] = []
        calls_of: dict[int, list[ConservedUnit]] = {}  # a module run several times (Zamba2's shared block)
        for unit in self.units:
            calls_of.setdefault(id(unit.module) if unit.module is not None else id(unit), []).append(unit)
        for calls in calls_of.values():
            biases = list({id(p): p for c in calls for p in c.biases}.values())
            share = self._share(biases, bias_grads)
            if any(c.overwritten for c in calls) or share is None:
                why = "modified in place before the backward" if share is not None else "a bias without gradient"
                self.skipped.append(f"{calls[0].name} ({why})")
                continue
            biased = share[1] > 0
            # compared to the precision of its least precise input, where that is below the model's
            bound = max([tolerance["module"]] + [conservation_tolerance(d, score.device)["module"]
                                                 for c in calls for d in c.input_dtypes
                                                 if d.is_floating_point and torch.finfo(d).eps > torch.finfo(dtype).eps])
            if not biased and all(c.per_example for c in calls):
                for index, call in enumerate(calls):  # each call on its own
                    gap = call.defect.abs()
                    scale = torch.maximum(call.magnitude_out, call.magnitude_in)
                    worst = int(_relative(gap, scale).argmax())
                    name = call.name if len(calls) == 1 else f"{call.name}, call {index + 1} of {len(calls)}"
                    out.append(ConservationGap(name, worst, float(gap[worst]), float(scale[worst]), bound))
            else:
                defect = sum(float(c.defect.sum()) + c.unsplit["out"] - c.unsplit["in"] for c in calls)
                scale = sum(float(torch.maximum(c.magnitude_out, c.magnitude_in).sum()) + c.unsplit["magnitude"]
                            for c in calls) + share[1]
                name = calls[0].name if len(calls) == 1 else f"{calls[0].name}, its {len(calls)} calls"
                out.append(ConservationGap(name, None, abs(defect - share[0]), scale, bound))
        out.extend(self._model_gaps(relevance, magnitude, score, bias_grads, tolerance["model"], grad_scale))
        return out

    @staticmethod
    def _share(biases: list, bias_grads: dict):
        """(Σ ⟨∂score/∂p, p⟩, Σ |∂score/∂p ⊙ p|) over ``biases`` (summed over the examples), or None where a non-zero
        bias has no gradient recorded."""
        share, magnitude = 0.0, 0.0
        for p in biases:
            if p.is_meta:  # offloaded, and read by no rule: nothing is known about it
                return None
            if not bool((p.detach() != 0).any()):
                continue  # a zero bias takes no share
            if id(p) not in bias_grads:
                return None
            grad = bias_grads[id(p)]
            if grad is not None:
                product = grad.detach().double() * p.detach().double()
                share, magnitude = share + float(product.sum()), magnitude + float(product.abs().sum())
        return share, magnitude

    def _model_gaps(self, relevance, magnitude, score, bias_grads, tolerance, grad_scale) -> list[ConservationGap]:
        outside = self._share(self.outside_biases, bias_grads)
        if any(u.overwritten for u in self.units) or outside is None:
            self.skipped.append("the whole model")
            return []
        # what the relevance explains: the relevance entering the model's output head, where it ran once (the
        # explained logit itself for the model's own scores; a forward_func's head is differentiated as it is), else
        # the explained score
        head = self.head_readings[0] if len(self.head_readings) == 1 else None
        units = [u for u in self.units if head is None or not u.after_head]
        if head is not None and head[0] is not None:
            score, score_magnitude = head[0] / grad_scale, head[1] / grad_scale
        else:
            score = score.detach().double()
            score_magnitude = score.abs()
        explained = relevance + sum((u.defect for u in units), self._zeros()) + self.linear_share
        defect_magnitude = sum((u.defect.abs() for u in units), self._zeros())
        # the terms the sums round: the score, the token relevances, the shares, and the largest relevance through
        # any one module (the values a half-precision model rounds between its modules are of that size)
        through = [torch.maximum(u.magnitude_out, u.magnitude_in) for u in units]
        scale = torch.stack([score_magnitude, magnitude, defect_magnitude, self.linear_magnitude, *through]).amax(0)
        if outside[1] > 0 or not all(u.per_example for u in units) or self.linear_unsplit:
            unsplit = sum(u.unsplit["out"] - u.unsplit["in"] for u in units) + self.linear_unsplit
            gap = abs(float((explained - score).sum()) + unsplit + outside[0])
            return [ConservationGap("the whole model", None, gap, float(scale.sum()) + outside[1], tolerance)]
        gap = (explained - score).abs()
        return [ConservationGap("the whole model", b, float(gap[b]), float(scale[b]), tolerance)
                for b in range(self.batch)]


def _relative(gap: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """gap / scale element-wise; 0 where both are 0, inf where only the scale is."""
    return torch.where(scale > 0, gap / scale.clamp(min=1e-300),
                       torch.where(gap > 0, torch.full_like(gap, float("inf")), torch.zeros_like(gap)))
