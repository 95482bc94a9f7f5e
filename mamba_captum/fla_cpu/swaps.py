"""The swap of flash-linear-attention's Triton functions for plain-torch ones, per thread, while ``fla_on_cpu()`` is
open.

Each :class:`FlaSwap` names a function where fla defines it and the torch function that stands for it. Installing a
swap replaces the function wherever fla's modules hold it (``from fla.ops.gla import chunk_gla`` copies the name into
``fla.layers.gla``; fla's ``ACT2FN`` maps activation names to functions) by a dispatcher, and uninstalling puts the
originals back. A dispatcher sends a call to the torch function only when the calling thread is inside
``fla_on_cpu()`` and the call's first tensor is on the CPU (or on any device, with ``fla_on_cpu(devices="all")``);
every other call goes to fla's own function.

A moved fla release must not give a number silently: a swap whose fla function has a parameter the torch function
does not take is not installed (:class:`FlaSwapError` when a call needs it), and a call that passes a value the
torch function cannot honour is refused by the torch function with a ``NotImplementedError`` naming it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import sys
import threading
from collections.abc import Callable

import torch

from ..shared_state import SharedPatch, thread_state
from .checks import check_swaps

class FlaSwapError(RuntimeError):
    """An fla function cannot be swapped for its torch version (its signature moved), or has none."""


@dataclasses.dataclass(frozen=True)
class FlaSwap:
    """One fla function (``module.name``, where fla defines it) and its torch version."""

    module: str
    name: str
    replacement: Callable

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"


def _parameters(function) -> dict | None:
    try:
        return dict(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin or an autograd Function's apply: no signature to compare
        return None


def signature_gap(original, replacement) -> list[str]:
    """The parameters of fla's ``original`` that ``replacement`` does not take (empty: the torch version can take
    every call of fla's function). An autograd ``Function.apply`` has no signature: its forward's is compared."""
    theirs = _parameters(original)
    if theirs is None:
        forward = getattr(getattr(original, "__self__", None), "forward", None)
        theirs = None if forward is None else {n: p for n, p in list(_parameters(forward).items())[1:]}
    ours = _parameters(replacement)
    if theirs is None or ours is None:
        return []
    if any(p.kind is p.VAR_KEYWORD for p in ours.values()):
        return [n for n, p in theirs.items() if p.kind is p.VAR_POSITIONAL]
    return [n for n, p in theirs.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in ours]


def _depth() -> list:
    return thread_state("fla_on_cpu", lambda: [0, False])  # [contexts of this thread, torch on every device]


def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def wants_torch(args, kwargs) -> bool:
    """Whether this call goes to the torch version: the thread is inside ``fla_on_cpu()`` and the first tensor is on
    the CPU (any device with ``devices="all"``)."""
    depth, everywhere = _depth()
    if depth == 0:
        return False
    tensor = _first_tensor(args, kwargs)
    return everywhere or tensor is None or tensor.device.type == "cpu"


def _dispatcher(original, replacement):
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if wants_torch(args, kwargs):
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__mamba_captum_original__ = original
    return dispatch


def _identity(value):
    """A key equal for the same function: an autograd Function's ``apply`` is a new bound method at each attribute
    access (equal, not identical), so methods are keyed by their function and owner."""
    if inspect.ismethod(value):
        return ("method", id(value.__func__), id(value.__self__))
    return ("object", id(value))


def _fla_modules():
    """fla's loaded modules, and transformers' model files (which may hold fla's functions behind their hub-kernel
    wrappers)."""
    return [(name, module) for name, module in list(sys.modules.items())
            if module is not None and (name == "fla" or name.startswith(("fla.", "transformers.models.")))]


def fla_backed(value) -> bool:
    """Whether ``value`` is a transformers function wrapped to call flash-linear-attention's kernel instead of its
    own torch body (``use_kernel_func_from_hub_with_fallback``: fla's function in its closure, the torch body in
    ``__wrapped__``). transformers picks fla whenever it is installed, whatever the device, so on a CPU its
    KDA / gated-delta-rule layers would run fla's Triton kernel."""
    cells = getattr(value, "__closure__", None) or ()
    if not callable(getattr(value, "__wrapped__", None)):
        return False
    for cell in cells:
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(inner) and getattr(inner, "__module__", "").startswith("fla."):
            return True
    return False


def _positions(name: str, namespace: dict, dispatchers: dict) -> list:
    """Where a loaded module holds one of fla's swapped functions: (container, key) pairs in its globals and its
    upper-case dicts (``ACT2FN``), or, in transformers' model files, its wrappers of fla's kernels."""
    if name.startswith("transformers."):
        return [(namespace, key) for key, value in list(namespace.items()) if fla_backed(value)]
    found = []
    for key, value in list(namespace.items()):
        if callable(value) and _identity(value) in dispatchers:
            found.append((namespace, key))
        elif isinstance(value, dict) and key.isupper():
            found.extend((value, k) for k, v in list(value.items()) if callable(v) and _identity(v) in dispatchers)
    return found


def _patch_holders(dispatchers: dict, changed: list, seen: set, position_cache: dict) -> None:
    """Replace every original of ``dispatchers`` (identity -> dispatcher) held by the loaded modules not yet in
    ``seen`` (fla's, and transformers' wrappers of fla's kernels, which get their own torch body), recording each
    change in ``changed``. ``position_cache``: module name -> its holders' positions, kept by the :class:`SwapSet`
    so that a module's namespace is read once, not at every installation (the library installs the swaps around
    each of its calls once fla is imported)."""
    for name, module in _fla_modules():
        if name in seen:
            continue
        seen.add(name)
        positions = position_cache.get(name)
        if positions is None:
            positions = position_cache[name] = _positions(name, vars(module), dispatchers)
        for container, key in positions:
            value = container.get(key)
            if name.startswith("transformers.") and fla_backed(value):
                changed.append((container, key, value))
                container[key] = _dispatcher(value, value.__wrapped__)
            elif callable(value) and _identity(value) in dispatchers:
                changed.append((container, key, value))
                container[key] = dispatchers[_identity(value)]


def _resolve(swap: FlaSwap):
    """(the object holding fla's function, its attribute name, the function): a module-level function, or a method
    ``Class.method`` (fla's modules whose forward itself refuses CPU tensors)."""
    owner = importlib.import_module(swap.module)
    *path, name = swap.name.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


class _Installed:
    """What one installation changed, and how to reach the fla modules loaded after it."""

    def __init__(self, swaps, position_cache: dict):
        self.dispatchers, self.changed, self.seen, self.position_cache = {}, [], set(), position_cache
        for swap in swaps:
            owner, name, original = _resolve(swap)
            original = getattr(original, "__mamba_captum_original__", original)
            dispatcher = _dispatcher(original, swap.replacement)
            if isinstance(owner, type):  # a method: patched on its class alone
                self.changed.append((owner, name, vars(owner)[name]))
                setattr(owner, name, dispatcher)
            else:
                self.dispatchers[_identity(original)] = dispatcher
        self.refresh()

    def refresh(self):
        if len(self.seen) != len(_fla_modules()):
            _patch_holders(self.dispatchers, self.changed, self.seen, self.position_cache)


def _uninstall(installed: _Installed):
    for holder, key, value in reversed(installed.changed):
        if isinstance(holder, type):
            setattr(holder, key, value)
        else:
            holder[key] = value


def usable(swaps) -> tuple[list[FlaSwap], dict[str, list[str]]]:
    """(the swaps whose fla function exists and whose torch version takes all its parameters, key -> the parameters
    missing for the others (``["<absent>"]``: fla no longer has the function))."""
    good, bad = [], {}
    for swap in swaps:
        try:
            original = _resolve(swap)[2]
        except (ImportError, AttributeError):
            bad[swap.key] = ["<absent>"]
            continue
        gap = signature_gap(getattr(original, "__mamba_captum_original__", original), swap.replacement)
        (bad.__setitem__(swap.key, gap) if gap else good.append(swap))
    return good, bad


class SwapSet:
    """The installed swaps, shared by every thread inside ``fla_on_cpu()`` (a :class:`SharedPatch`)."""

    def __init__(self, swaps_factory: Callable[[], list[FlaSwap]]):
        self._factory = swaps_factory
        self.refused: dict[str, list[str]] = {}
        self._good: list | None = None
        self._positions: dict = {}  # module name -> where it holds a swapped function (_patch_holders)
        self._patch = SharedPatch(self._install, _uninstall)

    def _install(self):
        if self._good is None:  # signatures and probes: once per process (fla's functions do not change under it)
            good, self.refused = usable(self._factory())
            self._good = check_swaps(good)
        good = self._good
        self._installed = _Installed(good, self._positions)
        return self._installed

    @contextlib.contextmanager
    def entered(self, everywhere: bool):
        state = _depth()
        with self._patch:
            with self._patch._lock:  # fla modules imported since (a model type loaded later) get the swaps too
                self._installed.refresh()
            previous = state[1]
            state[0] += 1
            state[1] = previous or everywhere
            try:
                yield self
            finally:
                state[0] -= 1
                state[1] = previous


@dataclasses.dataclass(frozen=True)
class FunctionSwap:
    """One of fla's ``torch.autograd.Function`` classes (``module.name``) and a torch function of its forward's
    inputs. Models keep such a Function's ``apply`` in their own attributes (``Mamba.act``, a layer's ``gate_fn``),
    out of reach of a swap of names, so the class itself is changed: its forward computes the torch function (a
    graph of its own, under the calling thread's ``fla_on_cpu()``) and its backward differentiates that graph. The
    change is made once per process and kept (a backward may run after the context closed); every call not made
    inside ``fla_on_cpu()`` runs fla's own forward and backward."""

    module: str
    name: str
    function: Callable

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"


_function_swaps_done: set = set()
_function_swaps_lock = threading.Lock()


def install_function_swap(swap: FunctionSwap) -> None:
    """Wrap the Function class's forward and backward (once per process; see :class:`FunctionSwap`)."""
    with _function_swaps_lock:
        if swap.key in _function_swaps_done:
            return
        cls = getattr(importlib.import_module(swap.module), swap.name)
        forward, backward = cls.forward, cls.backward

        def dispatched_forward(ctx, *args):
            if not wants_torch(args, {}):
                ctx.mamba_captum_graph = None
                return forward(ctx, *args)
            inputs = [a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                      for a in args]
            with torch.enable_grad():
                output = swap.function(*inputs)
            ctx.mamba_captum_graph = (inputs, output)
            return output.detach()

        def dispatched_backward(ctx, *grads):
            graph = getattr(ctx, "mamba_captum_graph", None)
            if graph is None:
                return backward(ctx, *grads)
            inputs, output = graph
            wanted = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
            found = iter(torch.autograd.grad(output, wanted, grads[0], allow_unused=True))
            return tuple(next(found) if isinstance(a, torch.Tensor) and a.requires_grad else None for a in inputs)

        cls.forward = staticmethod(dispatched_forward)
        cls.backward = staticmethod(dispatched_backward)
        _function_swaps_done.add(swap.key)
