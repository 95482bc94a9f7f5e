"""What the engine's process-wide patches share: a change held by any number of users, installed by the first and
removed by the last (:class:`SharedPatch`), and per-thread state (:func:`thread_state`). Used by the engine's
session (transformers' attention interface, HF's scans) and by ``fla_on_cpu()`` (fla's Triton functions).
"""
from __future__ import annotations

import threading


class SharedPatch:
    """A process-wide change held by any number of users: ``install()`` when the first one enters, ``uninstall(token)``
    (with what ``install`` returned) when the last one leaves, both under a lock.

    Entering and leaving in any interleaving of threads leaves the process as it was once every user has left.
    """

    def __init__(self, install, uninstall):
        self._install, self._uninstall = install, uninstall
        self._lock = threading.Lock()
        self._users = 0
        self._token = None

    @property
    def users(self) -> int:
        return self._users

    def __enter__(self):
        with self._lock:
            if self._users == 0:
                self._token = self._install()
            self._users += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._users -= 1
            if self._users == 0:
                token, self._token = self._token, None
                self._uninstall(token)
        return False


# -- per-thread state ------------------------------------------------------------------------------------------------
_local = threading.local()


def thread_state(name: str, default_factory):
    """This thread's value of ``name`` (created by ``default_factory`` on first use)."""
    values = _local.__dict__
    if name not in values:
        values[name] = default_factory()
    return values[name]


_LIBRARY_HOOK = "__mamba_captum_hook__"


def library_hook(hook):
    """Mark ``hook`` as one of the engine's own module hooks (its captures, MambaLRP's forward), so that the checks
    that look for the user's hooks on a layer (:func:`is_library_hook`) pass it over. Returns ``hook``."""
    setattr(hook, _LIBRARY_HOOK, True)
    return hook


def is_library_hook(hook) -> bool:
    """Whether ``hook`` was registered by the engine (:func:`library_hook`)."""
    return bool(getattr(hook, _LIBRARY_HOOK, False))


def forget_hook(module, hook) -> None:
    """Remove ``hook`` from ``module``'s forward (pre-)hook dicts (torch iterates over a copy of them): how a library
    hook copied onto a ``copy.deepcopy`` of a hooked module removes itself when the copy first runs."""
    for table in ("_forward_hooks", "_forward_pre_hooks"):
        hooks = module.__dict__.get(table, {})
        for key in [key for key, value in hooks.items() if value is hook]:
            del hooks[key]
            for side in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
                module.__dict__.get(side, {}).pop(key, None)
