"""mamba-captum: implicit-attention explanations for Mamba-family and hybrid transformers models."""
import importlib
import sys
import types
from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:  # the same names, for type checkers and the API docs (mkdocstrings reads the source)
    from .attention import LayerPartKey, ReconstructionError, SharedAttentionKey, build_operators, implicit_attention
    from .attr import (ConservationError, MambaAttribution, MambaLaTIM, MambaLRP, MambaRawAttention, MambaRollout,
                       MambaSelectionAttribution, RWKVAttribution)
    from .checks import NonFiniteError
    from .families import SUPPORTED_MIXERS
    from .fast_scans import fast_scans
    from .fla_cpu import fla_on_cpu
    from .tokens import UnknownTokenWarning
    from .viz import as_hf_attentions, to_visualization_record

__all__ = ["implicit_attention", "build_operators", "ReconstructionError", "ConservationError", "NonFiniteError",
           "SharedAttentionKey", "LayerPartKey", "SUPPORTED_MIXERS", "MambaAttribution", "MambaLaTIM", "MambaLRP",
           "MambaSelectionAttribution", "MambaRawAttention", "MambaRollout", "RWKVAttribution", "fast_scans",
           "fla_on_cpu", "to_visualization_record", "as_hf_attentions", "UnknownTokenWarning"]

# Each public name -> the module that defines it. They are imported on first use (PEP 562), not by
# ``import mamba_captum``: the engine imports torch and transformers (seconds), and the ``mamba-captum`` command's
# --help, --version and usage errors, which import this package first, need none of it.
_HOMES = {"implicit_attention": ".attention", "build_operators": ".attention", "ReconstructionError": ".attention",
          "SharedAttentionKey": ".attention", "LayerPartKey": ".attention", "NonFiniteError": ".checks",
          "ConservationError": ".attr", "MambaAttribution": ".attr", "MambaLaTIM": ".attr", "MambaLRP": ".attr",
          "MambaSelectionAttribution": ".attr", "MambaRawAttention": ".attr", "MambaRollout": ".attr",
          "RWKVAttribution": ".attr", "fast_scans": ".fast_scans", "fla_on_cpu": ".fla_cpu",
          "SUPPORTED_MIXERS": ".families",
          "to_visualization_record": ".viz", "as_hf_attentions": ".viz", "UnknownTokenWarning": ".tokens"}


def __getattr__(name):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    # `mamba_captum.vision` (the vision model zoo) stays an attribute of the package, as it always was, but is
    # imported on first use: `import mamba_captum` loads no model zoo, adapter or application
    if name == "vision":
        return importlib.import_module(".vision", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _Facade(types.ModuleType):
    def __setattr__(self, name, value):
        # importing the submodule mamba_captum.fast_scans binds it on the package under the public name of its
        # function: the package's `fast_scans` stays the function, as it was when the facade imported it eagerly
        if name == "fast_scans" and isinstance(value, types.ModuleType):
            value = value.fast_scans
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade
