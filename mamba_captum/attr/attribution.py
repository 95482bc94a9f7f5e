"""MambaAttribution: class-specific rollout of gradient-weighted implicit attention (Ali et al. Eq. 23).

product, gradient_rule="residual" (the official rule on full matrices):
    s^ℓ[j] = minmax_j(max_d relu(∂ target / ∂ r^ℓ[j, d])),  r^ℓ the residual stream entering decoder layer ℓ,
    Ã^ℓ = rownorm(I + W(A^ℓ ⊙ 1 s^ℓᵀ)),  R = (Ã^Λ ⋯ Ã^s)[q, :].
product, gradient_rule="grad_x_operator":
    G^ℓ[i, j] = mean_c g_c[i] · H_c[i, j] · x_c[j],  g = ∂ target / ∂ (the operator's output),  x its input
    (rows of G sum to the layer's first-order contribution over C channels), Ã^ℓ = rownorm(I + W(G^ℓ)).
W (sign=, normalise=): |G| or G₊, each row over its max, its sum, or as is (_rollout.layer_weights); the papers'
    rollout is sign="positive", normalise="none", the defaults |G| / row max (docs/faithfulness.md).
official (rank-1 rollout of the query rows, query entry 0, clamp ≥ 0):
    formulation="hidden" (Ali et al., HMA): v^ℓ = mean_c minmax(relu(row_c)), X^ℓ = 1 · (v^ℓ ⊙ s^ℓ)ᵀ;
    formulation="unified" (Zimerman et al., UIA): w^ℓ = minmax(mean_c relu(row_c) ⊙ s^ℓ), X^ℓ = 1 · w^ℓᵀ;
    M^ℓ = rownorm(X^ℓ + I).
"""
from __future__ import annotations

import torch
from captum.attr import GradientAttribution
from captum.log import log_usage

from ._base import ImplicitAttentionMethod
from ._inputs import as_attributions, format_inputs
from ._rollout import (NORMALISATIONS, SIGNS, RunningProduct, add_identity, broadcast_row, drop_query, layer_weights,
                       minmax, refuse_pooled, row_normalise, rollout_step, unique_positions)

GRADIENT_RULES = ("residual", "grad_x_operator")


def residual_scores(grad: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s[j] = minmax_j(max_d relu(grad[j, d])) over the real tokens: (B, L, D) -> (B, L)."""
    return minmax(grad.clamp(min=0).amax(-1), mask.to(grad.dtype))


class MambaAttribution(ImplicitAttentionMethod, GradientAttribution):
    """Mamba-Attribution: implicit attention weighted by the target's gradients, rolled out over the layers.

    ``MambaAttribution(model).attribute(input_ids, target=c)`` -> (B, L). See :meth:`attribute` for the keywords
    and ``docs/methods/attribution.md`` for the formulas.
    """

    def __init__(self, model, forward_func=None):
        ImplicitAttentionMethod.__init__(self, model, forward_func)
        GradientAttribution.__init__(self, self.forward_func)

    def _wants_residual(self, options):
        return options["recipe"] == "official" or options["gradient_rule"] == "residual"

    def _wants_operator_grads(self, options):
        return options["recipe"] == "product" and options["gradient_rule"] == "grad_x_operator"

    def _options(self, recipe, start_layer, reduce, gradient_rule="grad_x_operator", sign="absolute",
                 normalise="row_max", **extra):
        for name, value, choices in (("gradient_rule", gradient_rule, GRADIENT_RULES), ("sign", sign, SIGNS),
                                     ("normalise", normalise, NORMALISATIONS)):
            if value not in choices:
                raise ValueError(f"mamba_captum: {name}={value!r}; choose one of {choices}.")
        if recipe == "product" and gradient_rule == "grad_x_operator" and reduce not in ("mean", None):
            raise ValueError(f"mamba_captum: reduce={reduce!r} does not apply to gradient_rule='grad_x_operator', "
                             "whose channels are summed in gradient × operator × input; use "
                             "gradient_rule='residual' to weight reduced maps, or leave reduce= out.")
        return super()._options(recipe, start_layer, reduce, gradient_rule=gradient_rule, sign=sign,
                                normalise=normalise, **extra)

    @log_usage()  # Captum's wrapper: NoiseTunnel calls attribute.__wrapped__
    def attribute(self, inputs, target=None, additional_forward_args=None, *, attention_mask=None, position=None,
                  formulation="unified", start_layer=None, reduce="mean", components=None, recipe="product",
                  gradient_rule="grad_x_operator", sign="absolute", normalise="row_max", **forward_kwargs):
        """As :meth:`ImplicitAttentionMethod.attribute`, plus (product recipe):

        Args:
            gradient_rule: ``"grad_x_operator"`` (default: per-channel gradient × operator × input) or
                ``"residual"`` (the official rule: gradient at the residual stream entering each block).
            sign: ``"absolute"`` (default: |G|, evidence against the class counts too) or ``"positive"`` (G₊, the
                papers' clamp) for each layer's gradient-weighted map.
            normalise: ``"row_max"`` (default: each row over its largest entry), ``"row_sum"``, or ``"none"`` (the
                papers': the raw gradient scale, where the identity swamps small rows).

        The defaults are the best measured on the trained planted-answer models of docs/faithfulness.md.
        ``target=None`` explains the argmax class / token of each example. Returns (B, L) as the inputs."""
        inputs_tensor, was_tuple = format_inputs(inputs, self._runner.image_model)
        _, relevance = self._relevance_per_query(inputs_tensor, target, additional_forward_args, attention_mask,
                                                 position, formulation, start_layer, reduce, components, recipe,
                                                 forward_kwargs, gradient_rule=gradient_rule, sign=sign,
                                                 normalise=normalise)
        return as_attributions(relevance[0], inputs_tensor, was_tuple, self._runner.layout,
                               self._runner.packed)

    def _relevance(self, explained, options):
        if options["recipe"] == "official":
            return self._official(explained)
        products = [RunningProduct(explained.layout) for _ in explained.queries]
        for record in explained.layers():
            if options["gradient_rule"] == "residual":
                maps = record.operator.maps(options["reduce"])
                factors = [maps * residual_scores(grads, query.context(explained.mask_for(grads.shape[1])))[:, None, :]
                           for query, grads in zip(explained.queries, record.residual_grads)]
            else:
                factors = [record.operator.contributions(grads) / record.operator.value_channels
                           for grads in record.operator_grads]
            for product, factor in zip(products, factors):
                product.push(rollout_step(layer_weights(factor, options["sign"], options["normalise"])))
        return [q.row_of(product, explained.length) for q, product in zip(explained.queries, products)]

    @staticmethod
    def _official(explained):
        refuse_pooled(explained.queries)
        rows = unique_positions(explained.queries)
        hidden = explained.formulation == "hidden"
        products = [RunningProduct(explained.layout) for _ in explained.queries]
        for record in explained.layers():
            per_channel = record.operator.maps(None, rows).clamp(min=0)  # (B, C, R, L), relu per channel
            by_position = {p: per_channel[:, :, i] for i, p in enumerate(rows)}
            for query, product, grads in zip(explained.queries, products, record.residual_grads):
                context = query.context(explained.mask).to(per_channel.dtype)
                row = query.gather(by_position)  # (B, C, L)
                if hidden:  # HMA: min-max of each channel's row, then the channel mean
                    weighted = minmax(row, context[:, None, :]).mean(1) * residual_scores(grads, context)
                else:  # UIA: channel mean first; the min-max comes after the gradient weighting
                    weighted = minmax(row.mean(1) * residual_scores(grads, context), context)
                product.push(row_normalise(add_identity(broadcast_row(weighted))))
        return [drop_query(product.rows(q.positions, explained.length), q.positions)
                for q, product in zip(explained.queries, products)]
