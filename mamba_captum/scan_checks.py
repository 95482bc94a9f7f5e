"""The swap check of :mod:`mamba_captum.fast_scans`: each fast scan against HF's own function, once per process
and swap.

A new transformers release may change what one of the functions ``fast_scans()`` swaps computes, and a swapped one
would then give other numbers without a word. So the first ``fast_scans()`` of the process that needs a swap checks
it (:func:`check_swap`; once per swap key, under a lock, the result cached for the process):

- HF's function missing (an older or newer transformers, a model file gone): nothing to swap, HF's code runs, no
  warning;
- its ``inspect.signature`` must be the parameters the dispatcher forwards (names, order, kinds, defaults), plus
  only known keywords that leave the result unchanged or that the dispatcher sends to HF;
- a probe (a few tokens, float64, on the CPU, with every argument the mixers pass: initial states, D skip, Δ bias
  and softplus, Δ limits, resets) runs through HF's function and through the dispatcher's fast path: the outputs,
  returned final states and, by one vector-Jacobian product, the gradients of every input must agree to a relative
  1e-10 where HF computes in float64, 1e-6 for the gradients HF rounds to float32 (Mamba-1, RWKV-4) and 1e-5 for
  the SSD, which HF computes in float32 (the measured floors are 10-40 times smaller; docs/kernels.md).

A swap that fails stays unswapped for the process, with one :class:`ScanMismatchWarning` naming the function, the
transformers version and the difference (or the signature, or the error). The check adds 5-11 ms (one CPU thread)
to the first ``fast_scans()`` of a model, once per swap and process (docs/kernels.md); :func:`swap_checks` lists the
outcomes, :func:`reset_swap_checks` forgets them.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import threading
import time
import warnings

import torch

from .scan_swaps import SWAPS, leave, thread_depth


ABSENT = "absent from this transformers: nothing to swap"


class ScanMismatchWarning(UserWarning):
    """A swapped scan failed its check against HF's function (see :func:`check_swap`): HF's own function runs."""


@dataclasses.dataclass(frozen=True)
class SwapCheck:
    """The outcome of checking one swap against HF's function.

    Attributes:
        key: the swap (a key of ``SWAPS``: the model file's module path; for Griffin the module path + class).
        function: HF's function, by its dotted path.
        swapped: whether ``fast_scans()`` swaps it.
        reason: why not ("" when swapped): :data:`ABSENT` (no warning), or the signature, an error of the probe call,
            or the difference that failed.
        difference: the relative difference ``max |fast - HF| / max |HF|`` of the probe's ``part`` (output, a final
            state, ``∂input``) that came closest to (or furthest past) its ``tolerance``; nan where not measured.
        milliseconds: how long the check took.
    """

    key: str
    function: str
    swapped: bool
    reason: str
    difference: float
    part: str
    tolerance: float
    milliseconds: float


def _hf_function(key: str):
    """HF's function of the swap ``key`` (behind our dispatcher while one is installed), or None where this
    transformers has no such module or function (older releases: HF's own code path runs, nothing to swap)."""
    swap = SWAPS[key]
    try:
        owner = importlib.import_module(swap.module)
    except ImportError:
        return None
    if swap.owner is not None:
        owner = getattr(owner, swap.owner, None)
    function = getattr(owner, swap.attribute, None)
    if getattr(function, "swap_key", None) == key:
        function = function.original
    return function


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _same_default(a, b) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except (TypeError, RuntimeError, ValueError):  # a default whose == is not a truth value
        return False


def _signature_mismatch(original, dispatcher, passthrough: frozenset) -> str:
    """"" when HF's ``original`` takes the dispatcher's named parameters (same names, order, kinds and defaults),
    then only parameters in ``passthrough`` with defaults, and ``**kwargs`` only where the dispatcher takes them;
    else what differs (the dispatcher would forward the calls to a function it does not know)."""
    try:
        hf = inspect.signature(original)
    except (TypeError, ValueError) as error:
        return f"has no signature to compare ({error})"
    ours = inspect.signature(dispatcher)
    expected = [(p.name, p.kind, p.default) for p in ours.parameters.values() if p.kind not in _VARIADIC]
    named = [p for p in hf.parameters.values() if p.kind not in _VARIADIC]
    leading = [(p.name, p.kind, p.default) for p in named[:len(expected)]]
    extra = named[len(expected):]
    same = len(leading) == len(expected) and all(
        a[:2] == b[:2] and _same_default(a[2], b[2]) for a, b in zip(leading, expected))
    unknown = [p.name for p in extra if p.name not in passthrough or p.default is inspect.Parameter.empty]
    kinds = {p.kind for p in hf.parameters.values()}
    ours_kinds = {p.kind for p in ours.parameters.values()}
    variadic = [kind for kind in _VARIADIC if kind in kinds and kind not in ours_kinds]
    if same and not unknown and not variadic:
        return ""
    return f"has the signature {hf}, which the fast scan's dispatcher {ours} does not cover"


def _differences(got: dict, expected: dict) -> dict:
    """part -> ``max |got - expected| / max |expected|``; inf for a part one side lacks or of another shape, nan
    for non-finite values."""
    differences = {}
    for name in list(expected) + [name for name in got if name not in expected]:
        a, b = got.get(name), expected.get(name)
        if a is None or b is None or a.shape != b.shape:
            differences[name] = math.inf
            continue
        a, b = a.detach().double(), b.detach().double()
        scale, error = b.abs().max().item(), (a - b).abs().max().item()
        differences[name] = error / scale if scale > 0 else error
    return differences


def check_swap(key: str) -> SwapCheck:
    """Check the swap ``key`` against HF's function now (no cache; :func:`mamba_captum.fast_scans.fast_scans` checks
    each swap once per process through a cache).

    1. HF's function is looked up (absent: nothing to swap, HF's code runs);
    2. its ``inspect.signature`` must match what the dispatcher forwards (``Swap.passthrough``);
    3. the swap's probe (a small float64 call with every argument the mixers pass: initial states, D skip, Δ bias
       and softplus, Δ limits) runs on HF's function and on the dispatcher's fast path, on the CPU; the outputs,
       final states and gradients of every input (one vector-Jacobian product) must agree to ``Swap.tolerances``.
    """
    swap = SWAPS[key]
    function = ".".join(part for part in (swap.module, swap.owner, swap.attribute) if part)
    start = time.perf_counter()

    def outcome(swapped: bool, reason: str, difference: float = math.nan, part: str = "",
                tolerance: float = math.nan) -> SwapCheck:
        return SwapCheck(key, function, swapped, reason, difference, part, tolerance,
                         (time.perf_counter() - start) * 1e3)

    original = _hf_function(key)
    if original is None:
        return outcome(False, ABSENT)
    dispatcher = swap.dispatcher(key, original)
    mismatch = _signature_mismatch(original, dispatcher, swap.passthrough)
    if mismatch:
        return outcome(False, mismatch)
    depth = thread_depth()
    try:
        # whatever the caller's modes: the probes differentiate, and build their tensors on the CPU
        with torch.inference_mode(False), torch.enable_grad(), torch.device("cpu"):
            expected = swap.probe(original)
            depth[key] = depth.get(key, 0) + 1  # this thread inside fast_scans() for the dispatcher: its fast path
            try:
                got = swap.probe(dispatcher)
            finally:
                leave(depth, key)
    except Exception as error:  # a changed function may refuse the arguments the dispatcher forwards
        return outcome(False, f"raised {type(error).__name__}: {error} on the check input")
    differences = _differences(got, expected)
    tolerance = {name: swap.tolerances[name.startswith("∂")] for name in differences}  # outputs, gradients
    # the part nearest to (or furthest past) its tolerance; nan counts as past any
    part = max(differences, key=lambda name: math.inf if math.isnan(differences[name])
               else differences[name] / tolerance[name])
    difference = differences[part]
    if not difference <= tolerance[part]:
        return outcome(False, f"differs from the fast scan by {difference:.3g} (relative, in its {part}; tolerance "
                              f"{tolerance[part]:g})", difference, part, tolerance[part])
    return outcome(True, "", difference, part, tolerance[part])


_checks: dict = {}  # key -> SwapCheck, this process's
_checks_lock = threading.Lock()


def swap_passes(key: str) -> bool:
    """Whether ``fast_scans()`` swaps ``key``: checked on the first call in the process (under a lock, so that
    every thread waits for the one check), warning once where it fails."""
    with _checks_lock:
        result = _checks.get(key)
        if result is None:
            result = _checks[key] = check_swap(key)
            if not result.swapped and result.reason != ABSENT:
                version = importlib.import_module("transformers").__version__
                # stacklevel 4: the ``with fast_scans()`` line (through fast_scans and contextlib's __enter__)
                warnings.warn(f"{result.function} of transformers {version} {result.reason}: HF's own function runs "
                              "instead of mamba-captum's fast scan in this process (mamba_captum.fast_scans)",
                              ScanMismatchWarning, stacklevel=4)
    return result.swapped


def swap_checks() -> dict:
    """The swap checks this process has run: swap key -> :class:`SwapCheck` (outcome, measured difference, time)."""
    with _checks_lock:
        return dict(_checks)


def reset_swap_checks() -> None:
    """Forget this process's swap checks: the next ``fast_scans()`` checks each swap it needs again (and warns
    again). For tests that change a scan, and after transformers' model modules were reloaded or patched.
    Dispatchers already installed for threads inside ``fast_scans()`` stay until those threads leave."""
    with _checks_lock:
        _checks.clear()
