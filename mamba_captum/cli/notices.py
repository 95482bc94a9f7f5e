"""Warnings and log lines during a command.

``warnings.catch_warnings`` puts the whole filter list back on the way out, which also drops the filters that
modules imported during the command registered (torch.jit's TracerWarning, sympy's "once" ...): a program that calls
``main()`` and then uses those modules would see warnings they silence. :func:`scoped_warnings` keeps those.

transformers' logging is quieted by :func:`quiet_library` when a command, its checks passed, starts on the library,
and put back by :func:`library_logging` when the command ends: a usage error imports no transformers.
"""
from __future__ import annotations

import contextvars
import warnings
from contextlib import contextmanager

# the command's list for quiet_library: transformers' settings before it changed them (empty until then)
_SAVED_LOGGING = contextvars.ContextVar("mamba_captum_cli_logging", default=None)


@contextmanager
def library_logging():
    """The block of one command (``main`` may be called from a user's program): transformers' logging settings as
    they were before :func:`quiet_library` changed them inside the block, put back on the way out (nothing is
    imported or changed when the block never called it)."""
    saved = []
    token = _SAVED_LOGGING.set(saved)
    try:
        yield
    finally:
        _SAVED_LOGGING.reset(token)
        if saved:
            import transformers  # imported by quiet_library already

            verbosity, bars = saved[0]
            transformers.logging.set_verbosity(verbosity)
            if bars:
                transformers.logging.enable_progress_bar()


def quiet_library() -> None:
    """Import transformers with its logging quiet until the end of the :func:`library_logging` block: no per-kernel
    "falling back to torch" lines on CPU, no "Loading weights" bars (errors stay one line). A command calls it once
    the checks that need no model passed, before it imports the library; outside a block it changes nothing."""
    saved = _SAVED_LOGGING.get()
    if saved is None or saved:  # not in a command, or quiet already
        return
    import transformers

    saved.append((transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()))
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


@contextmanager
def scoped_warnings(record: bool = False):
    """``warnings.catch_warnings(record=record)``, except that the filters added inside the block by anything but
    the block's own ``filterwarnings`` / ``simplefilter`` calls (``own``: the entries the block registers, see
    below) stay registered after it. Yields ``(caught, own)``: the recorded warnings (None unless ``record``) and a
    list to which the block appends each filter entry it added itself (``own.append(warnings.filters[0])`` right
    after its ``simplefilter``), so that those, and only those, are removed."""
    before = list(warnings.filters)
    own = []
    with warnings.catch_warnings(record=record) as caught:
        try:
            yield caught, own
        finally:
            during = list(warnings.filters)
    added = [entry for entry in during if entry not in before and entry not in own]
    for action, message, category, module, lineno in reversed(added):  # the front of the list last: same order
        warnings.filterwarnings(action, message.pattern if message is not None else "", category,
                                module.pattern if module is not None else "", lineno)
