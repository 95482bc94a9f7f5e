"""The run-time check of the op swaps: a new fla release may change what an op computes while keeping its signature
(a default scale, the order of a decay and an update), and a swapped op would then give other numbers without a
word. So the first ``fla_on_cpu()`` of the process checks each op swap that has one of fla's own torch references
(``fla/ops/<op>/naive.py``) against it on a small random probe (float32, as fla's references compute), outputs and
final states; a swap that disagrees is not installed (fla's own function then runs: its Triton kernel on a GPU, its
error on a CPU) and warns once with :class:`FlaSwapMismatchWarning`.

:data:`PROBES`: swap key -> (fla's reference as ``module:function``, a probe builder ``(generator) -> (op kwargs,
reference kwargs)``). The probes are seeded; the tolerance (:data:`TOLERANCE`) is float32's rounding over a short
scan.
"""
from __future__ import annotations

import importlib
import warnings

import torch

TOLERANCE = 1e-4  # relative, float32 references on 12-token probes


class FlaSwapMismatchWarning(UserWarning):
    """An fla op's torch version disagrees with fla's own reference in this fla release: it is not swapped."""


def _randn(generator, *shape):
    return torch.randn(*shape, generator=generator)


def _log_decay(generator, *shape):
    return -torch.rand(*shape, generator=generator) * 0.7 - 0.02


def _gla(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    g, state = _log_decay(generator, 2, 12, 2, 4), _randn(generator, 2, 2, 4, 3)
    return (dict(q=q, k=k, v=v, g=g, initial_state=state, output_final_state=True),
            dict(q=q, k=k, v=v, gk=g, initial_state=state, output_final_state=True))


def _gla_recurrent(generator):
    ours, reference = _gla(generator)
    ours["gk"] = ours.pop("g")
    return ours, reference


def _simple_gla(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    g, state = _log_decay(generator, 2, 12, 2), _randn(generator, 2, 2, 4, 3)
    both = dict(q=q, k=k, v=v, g=g, initial_state=state, output_final_state=True)
    return both, dict(both)


def _gated_delta_rule(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    k = k / k.norm(dim=-1, keepdim=True)
    beta, g = torch.rand(2, 12, 2, generator=generator), _log_decay(generator, 2, 12, 2)
    state = _randn(generator, 2, 2, 4, 3)
    both = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, output_final_state=True)
    return both, dict(both)


def _kda(generator):
    ours, reference = _gated_delta_rule(generator)
    g = _log_decay(generator, 2, 12, 2, 4)
    ours["g"], reference["g"] = g, g
    return ours, reference


def _hgrn(generator):
    x, g, state = _randn(generator, 2, 12, 6), _log_decay(generator, 2, 12, 6), _randn(generator, 2, 6)
    both = dict(x=x, g=g, initial_state=state, output_final_state=True)
    return both, dict(both)


class _HeadFirst:
    """A reference taking (B, H, T, ·) tensors, called with fla's (B, T, H, ·) op layout: its output transposed back."""

    def __init__(self, reference, names):
        self.reference, self.names = reference, names

    def __call__(self, **kwargs):
        moved = {n: (v.transpose(1, 2).contiguous() if n in self.names else v) for n, v in kwargs.items()}
        o, state = self.reference(**moved)
        return o.transpose(1, 2), state


def _dplr(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    kk = _randn(generator, 2, 12, 2, 4)
    kk = kk / kk.norm(dim=-1, keepdim=True)
    a, b = -kk, kk * torch.rand(2, 12, 2, 4, generator=generator)
    g, state = _log_decay(generator, 2, 12, 2, 4), _randn(generator, 2, 2, 4, 3)
    ours = dict(q=q, k=k, v=v, a=a, b=b, gk=g, initial_state=state, output_final_state=True)
    # fla's dplr_recurrence: (B, H, T, ·) tensors, alpha / beta for a / b, the scale K^-1/2 fixed
    return ours, dict(q=q, k=k, v=v, alpha=a, beta=b, gk=g, initial_state=state, output_final_state=True)


def _rwkv7(generator):
    ours, reference = _dplr(generator)
    ours = dict(r=ours["q"] * 2.0, w=ours["gk"], k=ours["k"], v=ours["v"], a=ours["a"], b=ours["b"],
                scale=0.25, initial_state=ours["initial_state"], output_final_state=True)  # 2 · 0.25 = 4^-1/2
    return ours, reference


def _rwkv6(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    w, u, state = _log_decay(generator, 2, 12, 2, 4), _randn(generator, 2, 4), _randn(generator, 2, 2, 4, 3)
    return (dict(r=q, k=k, v=v, w=w, u=u, initial_state=state, output_final_state=True),
            dict(q=q, k=k, v=v, w=w, u=u, initial_state=state, output_final_state=True))


_DPLR_REFERENCE = ("fla.ops.generalized_delta_rule.dplr.naive:dplr_recurrence",
                   ("q", "k", "v", "alpha", "beta", "gk"))
_RWKV6_REFERENCE = ("fla.ops.rwkv6.recurrent_naive:naive_recurrent_rwkv6", ("q", "k", "v", "w"))

PROBES = {
    "fla.ops.generalized_delta_rule.dplr.chunk.chunk_dplr_delta_rule": (_DPLR_REFERENCE, _dplr),
    "fla.ops.rwkv7.chunk.chunk_rwkv7": (_DPLR_REFERENCE, _rwkv7),
    "fla.ops.rwkv6.chunk.chunk_rwkv6": (_RWKV6_REFERENCE, _rwkv6),
    "fla.ops.gla.chunk.chunk_gla": ("fla.ops.gla.naive:naive_recurrent_gla", _gla),
    "fla.ops.gla.fused_recurrent.fused_recurrent_gla": ("fla.ops.gla.naive:naive_recurrent_gla", _gla_recurrent),
    "fla.ops.simple_gla.chunk.chunk_simple_gla": ("fla.ops.simple_gla.naive:naive_recurrent_simple_gla",
                                                  _simple_gla),
    "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule": (
        "fla.ops.gated_delta_rule.naive:naive_recurrent_gated_delta_rule", _gated_delta_rule),
    "fla.ops.kda.chunk.chunk_kda": ("fla.ops.kda.naive:naive_recurrent_kda", _kda),
    "fla.ops.hgrn.fused_recurrent.fused_recurrent_hgrn": ("fla.ops.hgrn.naive:naive_recurrent_hgrn", _hgrn),
}


def _relative(got, expected) -> float:
    scale = expected.abs().max().item()
    error = (got.double() - expected.double()).abs().max().item()
    return error / scale if scale > 0 else error


def probe_difference(key: str, replacement) -> float | None:
    """The largest relative difference between ``replacement`` and fla's reference on the probe of ``key`` (outputs
    and final states); None where there is no probe or fla has no such reference (absent: not checkable here)."""
    if key not in PROBES:
        return None
    where, build = PROBES[key]
    head_first = None
    if isinstance(where, tuple):  # a reference with (B, H, T, ·) tensors: these argument names moved
        where, head_first = where
    module, _, name = where.partition(":")
    try:
        reference = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if head_first is not None:
        reference = _HeadFirst(reference, head_first)
    ours_kwargs, reference_kwargs = build(torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = replacement(**ours_kwargs)
        theirs = reference(**reference_kwargs)
    return max(_relative(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None)


_verdicts: dict = {}  # (swap key, replacement) -> passed: each probe runs once per process


def check_swaps(swaps) -> list:
    """The swaps that pass their probe (or have none); each failing one warns with :class:`FlaSwapMismatchWarning`.
    A probe runs on the first installation of the process that needs it (its verdict is kept)."""
    kept = []
    for swap in swaps:
        verdict = _verdicts.get((swap.key, swap.replacement))
        if verdict is not None:
            if verdict:
                kept.append(swap)
            continue
        try:
            difference = probe_difference(swap.key, swap.replacement)
        except Exception as error:  # noqa: BLE001 (a reference that cannot run this probe: the swap cannot be vouched for)
            difference, detail = float("inf"), f"{type(error).__name__}: {error}"
        else:
            detail = None
        passed = _verdicts[(swap.key, swap.replacement)] = difference is None or difference <= TOLERANCE
        if passed:
            kept.append(swap)
            continue
        warnings.warn(
            f"mamba_captum: fla's {swap.key} and its torch version differ on the swap check "
            f"({detail or f'relative {difference:.3g}, tolerance {TOLERANCE:g}'}) in this fla release: it is not "
            "swapped, so it runs fla's own kernel (on a CPU: fails). Please report the fla version.",
            FlaSwapMismatchWarning, stacklevel=5)
    return kept
