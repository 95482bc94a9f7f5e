"""RWKVAttribution: MambaAttribution for RWKV-4 models, with RWKV's checks.

The method is the same class-specific rollout of gradient-weighted implicit attention (see
:mod:`.attribution`); the operator of each time-mixing block is the unified RWKV one,
``H_c = diag(σ(r_c)) · α_c`` over the values (Zimerman et al., Eq. 21), or α alone with ``formulation="hidden"``.
RWKV-specific behaviour lives in the engine and applies to every class: left-padded batches are refused (HF's
RWKV ignores ``attention_mask``), right padding gives the unpadded result on the real tokens, and the in-place
weight rescaling of RWKV's first eval forward is undone after each of the library's forward passes.
"""
from __future__ import annotations

from .attribution import MambaAttribution

RWKV_MIXERS = ("RwkvSelfAttention",)


class RWKVAttribution(MambaAttribution):
    """Attribution for RWKV models: ``RWKVAttribution(model).attribute(input_ids, target=c)`` -> (B, L).

    Raises:
        TypeError: the model has no RWKV time-mixing block (use :class:`MambaAttribution` for other families).
    """

    def __init__(self, model, forward_func=None):
        super().__init__(model, forward_func)
        kinds = {type(m.module).__name__ for m in self._runner.mixers}  # located at construction
        if not kinds & set(RWKV_MIXERS):
            raise TypeError(f"mamba_captum: RWKVAttribution explains RWKV models; {type(model).__name__} has "
                            f"{', '.join(sorted(kinds))} mixers. Use MambaAttribution, which explains every "
                            "supported family.")
