"""mamba-captum: implicit-attention explanations for Mamba-family and hybrid transformers models."""
import importlib
from ._version import __version__
from .attention import LayerPartKey, ReconstructionError, SharedAttentionKey, build_operators, implicit_attention
from .checks import NonFiniteError
from .attr import (ConservationError, MambaAttribution, MambaLRP, MambaRawAttention, MambaRollout,
                   MambaSelectionAttribution, RWKVAttribution)
from .fast_scans import fast_scans
from .families import SUPPORTED_MIXERS
from .viz import as_hf_attentions, to_visualization_record

__all__ = ["implicit_attention", "build_operators", "ReconstructionError", "ConservationError", "NonFiniteError",
           "SharedAttentionKey", "LayerPartKey", "SUPPORTED_MIXERS", "MambaAttribution", "MambaLRP",
           "MambaSelectionAttribution", "MambaRawAttention", "MambaRollout", "RWKVAttribution", "fast_scans",
           "to_visualization_record", "as_hf_attentions"]


def __getattr__(name):
    # `mamba_captum.vision` (the vision model zoo) stays an attribute of the package, as it always was, but is
    # imported on first use: `import mamba_captum` loads no model zoo, adapter or application
    if name == "vision":
        return importlib.import_module(".vision", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
