"""Warnings during a command: ``warnings.catch_warnings`` puts the whole filter list back on the way out, which
also drops the filters that modules imported during the command registered (torch.jit's TracerWarning, sympy's
"once" ...): a program that calls ``main()`` and then uses those modules would see warnings they silence.
:func:`scoped_warnings` keeps those."""
from __future__ import annotations

import warnings
from contextlib import contextmanager


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
