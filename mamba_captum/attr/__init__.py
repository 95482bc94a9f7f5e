"""The Captum attribution classes built on the implicit-attention engine (DESIGN.md §1, §4)."""
from ._base import RECIPES, ImplicitAttentionMethod
from .attribution import GRADIENT_RULES, MambaAttribution
from .latim import MambaLaTIM
from .lrp import ConservationError, MambaLRP
from .raw_attention import MambaRawAttention
from .rollout import MambaRollout
from .rwkv_attribution import RWKVAttribution
from .selection_attribution import SPREADS, MambaSelectionAttribution

__all__ = ["GRADIENT_RULES", "RECIPES", "SPREADS", "ConservationError", "ImplicitAttentionMethod",
           "MambaAttribution", "MambaLaTIM", "MambaLRP", "MambaRawAttention", "MambaRollout", "MambaSelectionAttribution", "RWKVAttribution"]
