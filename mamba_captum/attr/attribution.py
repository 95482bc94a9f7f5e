"""MambaAttribution: class-specific rollout of gradient-weighted implicit attention (Ali et al. Eq. 23), or, by default
on token models with MambaLRP's rules (recipe="auto" -> "relevance"), the magnitude of MambaLRP's relevance.

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

import inspect
from types import SimpleNamespace

import torch
from captum.attr import GradientAttribution
from captum.log import log_usage

from ..session import session
from ._base import RECIPES, ImplicitAttentionMethod
from ._generation import generation_inputs, generation_result, refuse_single_call_keywords
from ._inputs import as_attributions, format_inputs
from ._rollout import (NORMALISATIONS, SIGNS, RunningProduct, add_identity, broadcast_row, drop_query, layer_weights,
                       minmax, refuse_pooled, row_normalise, rollout_step, unique_positions)
from .lrp import MambaLRP

GRADIENT_RULES = ("residual", "grad_x_operator")
# the model classes recipe="auto" explains by MambaLRP's relevance (where their modules have rules): token models
# with their own output head
HEADED_MODELS = ("ForCausalLM", "ForSequenceClassification")


# the product recipe's options and their defaults: setting any of them asks for the rollout (recipe="auto")
PRODUCT_DEFAULTS = dict(formulation="unified", start_layer=None, reduce="mean", components=None,
                        gradient_rule="grad_x_operator", normalise="row_max")


def product_options_set(options: dict) -> list[str]:
    """The names among ``options`` (product-recipe keywords) whose values are not the defaults, in order."""
    return [name for name, value in options.items() if value != PRODUCT_DEFAULTS[name]]


def _has_own_head(model) -> bool:
    """A ``*ForCausalLM`` / ``*ForSequenceClassification`` (compiled or not), or a wrapper of one (PEFT's)."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if type(inner).__name__.endswith(HEADED_MODELS):
        return True
    head = getattr(inner, "get_output_embeddings", None)
    return callable(head) and head() is not None


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
                  formulation="unified", start_layer=None, reduce="mean", components=None, recipe="auto",
                  gradient_rule="grad_x_operator", sign="absolute", normalise="row_max", **forward_kwargs):
        """As :meth:`ImplicitAttentionMethod.attribute`, plus:

        Args:
            recipe: ``"auto"`` (default): ``"relevance"`` for a ``*ForCausalLM`` / ``*ForSequenceClassification``
                token model whose modules all have MambaLRP rules and a call that sets none of the product recipe's
                options (``formulation``, ``start_layer``,
                ``reduce``, ``components``, ``gradient_rule``, ``normalise``), else ``"product"``;
                ``"relevance"``: the magnitude of MambaLRP's conservative relevance, |R| (``sign="positive"``: R₊),
                one forward and one backward, checked for conservation at run time (:class:`MambaLRP`);
                ``"product"``: the rollout of gradient-weighted implicit attention below; ``"official"``: the
                papers' rank-1 recipe. The default is the one measured best across the faithfulness suite, the demo
                and the selection-driven tasks (docs/faithfulness.md, "The default").
            gradient_rule: ``"grad_x_operator"`` (default: per-channel gradient × operator × input) or
                ``"residual"`` (the official rule: gradient at the residual stream entering each block).
            sign: ``"absolute"`` (default: |G|, evidence against the class counts too) or ``"positive"`` (G₊, the
                papers' clamp) for each layer's gradient-weighted map.
            normalise: ``"row_max"`` (default: each row over its largest entry), ``"row_sum"``, or ``"none"`` (the
                papers': the raw gradient scale, where the identity swamps small rows).

        The product recipe's defaults are its best measured on the trained planted-answer models of
        docs/faithfulness.md. ``target=None`` explains the argmax class / token of each example. Returns (B, L) as
        the inputs."""
        given = product_options_set(dict(formulation=formulation, start_layer=start_layer, reduce=reduce,
                                         components=components, gradient_rule=gradient_rule, normalise=normalise))
        recipe = self._resolved_recipe(recipe, bool(given))
        if recipe == "relevance":
            if given:
                raise ValueError(f"mamba_captum: {', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to "
                                 "the product recipe's rollout, not to recipe='relevance' (MambaLRP's relevance); "
                                 "leave them out, or pass recipe='product'.")
            return self._conservative_relevance(inputs, target, additional_forward_args, attention_mask, position,
                                                sign, forward_kwargs)
        inputs_tensor, was_tuple = format_inputs(inputs, self._runner.image_model)
        _, relevance = self._relevance_per_query(inputs_tensor, target, additional_forward_args, attention_mask,
                                                 position, formulation, start_layer, reduce, components, recipe,
                                                 forward_kwargs, gradient_rule=gradient_rule, sign=sign,
                                                 normalise=normalise)
        return as_attributions(relevance[0], inputs_tensor, was_tuple, self._runner.layout,
                               self._runner.packed)

    def attribute_generation(self, inp, target=None, *, tokenizer=None, gen_args=None, formulation="unified",
                             start_layer=None, reduce="mean", components=None, recipe="auto", **kwargs):
        """As :meth:`ImplicitAttentionMethod.attribute_generation`; ``recipe="auto"`` resolves as in
        :meth:`attribute`. With ``"relevance"`` each generated token's row is MambaLRP's relevance of its logit (one
        forward and one backward per generated token), its magnitude (``sign="positive"``: its positive part)."""
        product_given = bool(product_options_set(dict(
            formulation=formulation, start_layer=start_layer, reduce=reduce, components=components,
            **{name: kwargs[name] for name in ("gradient_rule", "normalise") if name in kwargs})))
        resolved = self._resolved_recipe(recipe, product_given)
        if resolved != "relevance":
            return super().attribute_generation(inp, target, tokenizer=tokenizer, gen_args=gen_args,
                                                formulation=formulation, start_layer=start_layer, reduce=reduce,
                                                components=components, recipe=resolved, **kwargs)
        if product_given:
            raise ValueError("mamba_captum: the product recipe's options do not apply to recipe='relevance'; leave "
                             "them out, or pass recipe='product'.")
        refuse_single_call_keywords(kwargs)
        sign = kwargs.pop("sign", "absolute")
        kwargs.pop("gradient_rule", None), kwargs.pop("normalise", None)
        prompt, full, target_ids, tokenizer, keep = generation_inputs(self.model, self._runner, inp, target,
                                                                      tokenizer, gen_args, kwargs)
        start = prompt.shape[1] - 1
        relevance = [self._conservative_relevance(full, int(token), None, None, start + t, sign, dict(kwargs))
                     for t, token in enumerate(target_ids)]
        with torch.no_grad(), session(self.model, self._runner.decoder_layers):
            logits = self.model(full, **kwargs).logits[0]
        scores = SimpleNamespace(scores=[logits[start + t][None] for t in range(len(target_ids))])
        return generation_result(inp, prompt, target_ids, tokenizer, keep, scores, relevance)

    def resolve_recipe(self, recipe: str = "auto", **options) -> str:
        """The recipe :meth:`attribute` runs for ``recipe`` and the keywords ``options`` (its product-recipe keywords,
        e.g. ``formulation="hidden"``): ``"relevance"``, ``"product"`` or ``"official"``."""
        unknown = set(options) - set(PRODUCT_DEFAULTS)
        if unknown:
            raise TypeError(f"mamba_captum: resolve_recipe() got {sorted(unknown)}; it takes "
                            f"{sorted(PRODUCT_DEFAULTS)}.")
        return self._resolved_recipe(recipe, bool(product_options_set(options)))

    def _resolved_recipe(self, recipe, product_options_given):
        if recipe not in ("auto",) + RECIPES + ("relevance",):
            raise ValueError(f"mamba_captum: recipe={recipe!r}; choose one of {('auto', 'relevance') + RECIPES}.")
        if recipe != "auto":
            return recipe
        if product_options_given or self._runner.layout is not None or self._runner.packed:
            return "product"  # image models: the product recipe is the one measured on images (docs/vision.md)
        if not _has_own_head(self.model):
            # a base model explained through a forward_func's own head: MambaLRP's conservation guard checks the
            # relevance up to the model's output head, which a base model has not (it refuses there)
            return "product"
        return "relevance" if self._lrp() is not None else "product"

    def _lrp(self):
        """The MambaLRP of this model, or None where its modules lack rules (made once, on first use)."""
        if not hasattr(self, "_lrp_method"):
            try:
                self._lrp_method = MambaLRP(self.model, self._runner.forward_func)
            except NotImplementedError as error:
                self._lrp_method, self._lrp_refusal = None, error
        return self._lrp_method

    def _conservative_relevance(self, inputs, target, additional_forward_args, attention_mask, position, sign,
                                forward_kwargs):
        """recipe='relevance': |R| (or R₊) of MambaLRP's relevance, per token, in the shape of the inputs."""
        if sign not in SIGNS:
            raise ValueError(f"mamba_captum: sign={sign!r}; choose one of {SIGNS}.")
        method = self._lrp()
        if method is None:
            raise NotImplementedError(f"mamba_captum: recipe='relevance' needs MambaLRP's rules: {self._lrp_refusal} "
                                      "Use recipe='product'.")
        # a keyword neither this method's nor the model's is refused naming this method's own options
        inputs_tensor, _ = format_inputs(inputs, self._runner.image_model)
        names = [name for name in inspect.signature(self.attribute).parameters if name != "forward_kwargs"]
        self._runner._arguments(inputs_tensor, attention_mask, additional_forward_args, forward_kwargs, names,
                                f"{type(self).__name__}.attribute")
        relevance = method.attribute(inputs, target, additional_forward_args, attention_mask=attention_mask,
                                     position=position, **forward_kwargs)
        was_tuple = isinstance(relevance, tuple)
        relevance = relevance[0] if was_tuple else relevance
        if relevance.dim() == 3:  # embeddings in: per-feature relevance, summed to the token's, shown over D
            relevance = relevance.sum(-1, keepdim=True).expand_as(relevance)
        relevance = relevance.abs() if sign == "absolute" else relevance.clamp(min=0)
        return (relevance,) if was_tuple else relevance

    def __exit__(self, *exc):
        if getattr(self, "_lrp_method", None) is not None:
            self._lrp_method.__exit__(*exc)
        return super().__exit__(*exc)

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
