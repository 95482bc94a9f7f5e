"""An inseq attribution method, ``"mamba_attention"``: the per-layer implicit attention of a Mamba-family model in
the place where inseq's ``"attention"`` method reads softmax attention weights (which these models do not have).

    import mamba_captum.inseq_method  # registers the method with inseq
    attribution_model = inseq.load_model(model, "mamba_attention", tokenizer=tokenizer)
    out = attribution_model.attribute("the plot was", generation_args={"max_new_tokens": 3})
    out.show(aggregator=...)   # scores (prefix L, generated T, layers, 1 "head"): aggregate layers as usual

Like inseq's ``"attention"`` method it is class-agnostic (the decoding strategy does not matter) and runs once, on
the final generated sequence; the maps are channel ``abs_mean`` (non-negative, like attention probabilities).
"""
from __future__ import annotations

import torch
from inseq.attr.feat.internals_attribution import AttentionWeightsAttribution

from .viz import as_hf_attentions


class MambaAttentionAttribution(AttentionWeightsAttribution):
    """inseq's attention method fed with :func:`mamba_captum.as_hf_attentions` (one head per layer)."""

    method_name = "mamba_attention"

    def __init__(self, attribution_model, formulation: str = "unified", reduce: str = "abs_mean", **kwargs):
        super().__init__(attribution_model, **kwargs)
        self.use_attention_weights = False  # HF returns none for Mamba layers; filtered_attribute_step adds ours
        self.formulation, self.reduce = formulation, reduce

    def filtered_attribute_step(self, batch, target_ids, attributed_fn, target_attention_mask=None,
                                attribute_target=False, step_scores=(), attribution_args=None,
                                attributed_fn_args=None, step_scores_args=None):
        model = self.attribution_model.model
        device = next(model.parameters()).device
        input_ids, attention_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        if target_attention_mask is not None and int(target_attention_mask.sum()) < target_ids.shape[0]:
            keep = target_attention_mask.bool().flatten().to(device)  # inseq drops finished rows the same way
            input_ids, attention_mask = input_ids[keep], attention_mask[keep]
        attentions = as_hf_attentions(model, input_ids, attention_mask, formulation=self.formulation,
                                      reduce=self.reduce)
        attribution_args = {**(attribution_args or {}), "decoder_self_attentions": torch.stack(attentions, 1).cpu()}
        return super().filtered_attribute_step(batch, target_ids, attributed_fn, target_attention_mask,
                                               attribute_target, list(step_scores), attribution_args,
                                               attributed_fn_args or {}, step_scores_args or {})
