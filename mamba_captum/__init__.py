"""mamba-captum: implicit-attention explanations for Mamba-family and hybrid transformers models."""
from .attention import ReconstructionError, build_operators, implicit_attention
from .families import SUPPORTED_MIXERS

__all__ = ["implicit_attention", "build_operators", "ReconstructionError", "SUPPORTED_MIXERS"]
__version__ = "0.1.0"
