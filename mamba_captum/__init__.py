"""mamba-captum: implicit-attention explanations for Mamba-family and hybrid transformers models."""
from ._version import __version__
from .attention import LayerPartKey, ReconstructionError, SharedAttentionKey, build_operators, implicit_attention
from .checks import NonFiniteError
from .attr import (ConservationError, MambaAttribution, MambaLRP, MambaRawAttention, MambaRollout,
                   MambaSelectionAttribution, RWKVAttribution)
from .fast_scans import fast_scans
from .families import SUPPORTED_MIXERS
from .viz import as_hf_attentions, to_visualization_record
from . import vision  # noqa: F401 (`import mamba_captum` gives mamba_captum.vision, as it always did)

__all__ = ["implicit_attention", "build_operators", "ReconstructionError", "ConservationError", "NonFiniteError",
           "SharedAttentionKey", "LayerPartKey", "SUPPORTED_MIXERS", "MambaAttribution", "MambaLRP",
           "MambaSelectionAttribution", "MambaRawAttention", "MambaRollout", "RWKVAttribution", "fast_scans",
           "to_visualization_record", "as_hf_attentions"]
