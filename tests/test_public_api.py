"""The public API does not move by accident: every public name of the modules users import, and the signature of
each public function, class and method, against the list in ``tests/public_api.json``.

A refactor (issue 31: modules split and moved) must leave this list as it is. A deliberate change of the API rewrites
it, in the same commit, with ``python tests/test_public_api.py --write``, so that the diff shows what users see.
Submodules are not names of the API (whether ``mamba_captum.layout`` shows in ``dir(mamba_captum)`` depends on what
was imported before); the modules themselves are listed in ``PUBLIC_MODULES``.
"""
import importlib
import inspect
import json
import re
import sys
import types
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("public_api.json")
PUBLIC_MODULES = ["mamba_captum", "mamba_captum.attr", "mamba_captum.vision", "mamba_captum.fast_scans",
                  "mamba_captum.families", "mamba_captum.explain", "mamba_captum.callback", "mamba_captum.evaluation",
                  "mamba_captum.kernels"]


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # builtins and some C types have none
        return "(no signature)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # default values' reprs with addresses


def describe(module_name: str) -> dict:
    """name -> a description: the signature of a function, ``class(signature)`` with each public method's signature
    for a class, the type name for anything else."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    described = {}
    for name in sorted(names):
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):
            continue
        if inspect.isclass(value):
            methods = {m: _signature(getattr(value, m)) for m, member in vars(value).items()
                       if not m.startswith("_") and callable(member)}
            described[name] = {"class": _signature(value), "methods": methods}
        elif callable(value):
            described[name] = _signature(value)
        else:
            described[name] = type(value).__name__
    return described


def current() -> dict:
    return {name: describe(name) for name in PUBLIC_MODULES}


def test_the_public_api_is_the_listed_one():
    expected = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    now = current()
    changes = []
    for module in sorted(set(expected) | set(now)):
        before, after = expected.get(module, {}), now.get(module, {})
        for name in sorted(set(before) | set(after)):
            if before.get(name) != after.get(name):
                changes.append(f"{module}.{name}: {before.get(name, '(absent)')} -> {after.get(name, '(absent)')}")
    assert not changes, ("the public API changed; if deliberately, rewrite the list with "
                         "`python tests/test_public_api.py --write`:\n" + "\n".join(changes))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {SNAPSHOT}")
