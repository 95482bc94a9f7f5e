"""How the library runs its own forward passes on a user's model: serialised per model, thread-aware, and leaving
nothing changed behind it.

Concurrency guarantees (docs/robustness.md):

- Calls on one model are serialised: a re-entrant lock per model (keyed by its decoder-layer list, so a
  ``torch.compile`` wrapper and the module it wraps share it) is held for the whole call. Calls on different models
  run in parallel.
- The process-wide changes the library makes to ``transformers`` (the attention-interface lookup, HF's Mamba-1
  scan functions) and to ``torch`` (``torch.compile``'s stance, only while a compiled model is explained) are
  :class:`SharedPatch` es: installed by the first user, restored by the last one to leave, under a lock, whatever
  the interleaving of threads. The transformers patches act only for a thread that is inside the library; any
  other thread sees transformers' own behaviour while they are installed.
- While a call runs, the model runs as one plain eager forward pass: gradient checkpointing is switched off
  (its recomputation replays the layers outside the library's hooks, and reentrant checkpointing builds no graph
  to differentiate) and compiled code runs eagerly (tensors inside a compiled graph are not observable by hooks
  or autograd). The forward is the same computation either way; every flag is restored on exit.
- transformers' "`causal_conv1d_fn` / `selective_scan_fn` is falling back to its reference PyTorch implementation"
  warnings are dropped while the library runs its forwards (the library's scans are torch code by design, so they
  are noise there): a filter of the library's own, on the logger that emits them, added by the first thread to
  enter and removed by the last (a :class:`SharedPatch`), and acting only on records of threads inside the library.
  Levels, handlers and the user's own filters are never touched.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import torch
from torch import nn

from . import families
from .fla_cpu import fla_on_cpu
from .shared_state import SharedPatch, thread_state  # noqa: F401  (importable from here, as before)


# -- one model, one call at a time -----------------------------------------------------------------------------------
_model_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_model_locks_guard = threading.Lock()


def model_lock(decoder_layers: nn.Module) -> threading.RLock:
    """The re-entrant lock that serialises the library's calls on the model owning ``decoder_layers``."""
    with _model_locks_guard:
        lock = _model_locks.get(decoder_layers)
        if lock is None:
            lock = _model_locks[decoder_layers] = threading.RLock()
        return lock


# -- a plain eager forward -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def checkpointing_off(model: nn.Module):
    """Switch gradient checkpointing off on every module that has it on; put each flag back exactly on exit."""
    switched = [(module, "gradient_checkpointing" in vars(module)) for module in model.modules()
                if getattr(module, "gradient_checkpointing", False) is True]
    try:
        for module, _ in switched:
            module.gradient_checkpointing = False
        yield
    finally:
        for module, own_attribute in switched:
            if own_attribute:
                module.gradient_checkpointing = True
            else:  # the True came from the class: drop the instance attribute we set
                vars(module).pop("gradient_checkpointing", None)


def _is_compiled(target) -> bool:
    if target is None:
        return False
    if getattr(target, "_torchdynamo_orig_callable", None) is not None:  # a torch.compile'd function
        return True
    owner = getattr(target, "__self__", None)  # a bound method of a compiled module
    if isinstance(owner, nn.Module) and owner is not target and _is_compiled(owner):
        return True
    if isinstance(target, nn.Module):
        from torch._dynamo.eval_frame import OptimizedModule

        return any(isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None
                   for module in target.modules())
    return False


def _install_eager():
    return torch.compiler.set_stance("force_eager")


def _uninstall_eager(stance):
    stance.__exit__(None, None, None)  # back to the stance that was set before the first user entered


EAGER = SharedPatch(_install_eager, _uninstall_eager)


@contextlib.contextmanager
def eager_if_compiled(model: nn.Module, forward_func=None):
    """Run compiled code eagerly (``torch.compile``'s ``"force_eager"`` stance) while the context is open, if the
    model or ``forward_func`` holds compiled code. The stance is process-wide: other threads' compiled code also
    runs eagerly (same results, slower) until the last such call leaves."""
    if not (_is_compiled(model) or _is_compiled(forward_func)):
        yield
        return
    with EAGER:
        yield


@contextlib.contextmanager
def returning_dicts(model: nn.Module):
    """``config.return_dict = True`` on every config of the model while the context is open: several transformers
    models read their inner model's outputs by name (``outputs.last_hidden_state``), which ``return_dict=False``
    in the config breaks even when the outer call passes ``return_dict=True``. Each flag is put back on exit."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "return_dict", True) is False}
    try:
        for config in configs.values():
            config.return_dict = True
        yield
    finally:
        for config in configs.values():
            config.return_dict = False


# -- transformers' kernel-fallback warnings ----------------------------------------------------------------------------
KERNEL_FALLBACK_LOGGER = "transformers.integrations.hub_kernels"  # where HF logs "... falling back to its reference"
_KERNEL_FALLBACK_TEXT = "is falling back to its reference PyTorch implementation"


def _inside_library() -> list:
    return thread_state("inside_library", lambda: [0])  # this thread's depth of nested library calls


class KernelFallbackFilter(logging.Filter):
    """Drops HF's kernel-fallback warnings logged by a thread that is inside one of the library's calls."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_inside_library()[0] > 0 and _KERNEL_FALLBACK_TEXT in record.getMessage())


_KERNEL_FALLBACK_FILTER = KernelFallbackFilter()


def _quiet_once(logger: logging.Logger):
    """HF logs the fallback with ``logger.warning_once``, an lru_cache over the message: a call that the filter
    drops still fills the cache, and the user's own forward after the library's call would never be told. An
    instance attribute in front of the class's method returns before the cache for a thread inside the library
    (the user's calls go to the cached method as before); returns the token that ``_loud_once`` takes back."""
    if "warning_once" in vars(logger):  # someone else's wrapper: leave it, the filter still drops the record
        return None
    original = logger.warning_once

    def warning_once(*args, **kwargs):
        if _inside_library()[0] > 0 and args and _KERNEL_FALLBACK_TEXT in str(args[0]):
            return None
        return original(*args, **kwargs)

    logger.warning_once = warning_once
    return warning_once


def _loud_once(logger: logging.Logger, wrapper) -> None:
    if wrapper is not None and vars(logger).get("warning_once") is wrapper:
        del logger.warning_once


def _install_quiet():
    logger = logging.getLogger(KERNEL_FALLBACK_LOGGER)
    logger.addFilter(_KERNEL_FALLBACK_FILTER)
    return _quiet_once(logger) if hasattr(logger, "warning_once") else None


def _uninstall_quiet(wrapper) -> None:
    logger = logging.getLogger(KERNEL_FALLBACK_LOGGER)
    logger.removeFilter(_KERNEL_FALLBACK_FILTER)
    _loud_once(logger, wrapper)


# only our own filter object and wrapper are added and removed: the user's logging config stays
KERNEL_FALLBACK_QUIET = SharedPatch(_install_quiet, _uninstall_quiet)


@contextlib.contextmanager
def kernel_fallback_quiet():
    """Silence transformers' kernel-fallback warnings in this thread while the context is open."""
    depth = _inside_library()
    with KERNEL_FALLBACK_QUIET:
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1


@contextlib.contextmanager
def session(model: nn.Module, decoder_layers: nn.Module, forward_func=None):
    """Everything around one of the library's calls on ``model``: the model's lock, what HF forwards change on the
    modules (RWKV's rescaling, RecurrentGemma's cached states) undone, gradient checkpointing off, compiled code
    eager, transformers' kernel-fallback warnings silenced, flash-linear-attention's Triton functions in torch on CPU
    tensors (:func:`mamba_captum.fla_on_cpu`, for a model with fla modules), and (unless a ``forward_func`` reads
    the outputs itself) outputs returned as dicts."""
    with model_lock(decoder_layers), kernel_fallback_quiet(), fla_on_cpu(model), families.preserved_state(model), \
            checkpointing_off(model), eager_if_compiled(model, forward_func), \
            (returning_dicts(model) if forward_func is None else contextlib.nullcontext()):
        yield
