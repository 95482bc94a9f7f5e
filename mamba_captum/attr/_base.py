"""The Captum base shared by the three methods: constructor, ``attribute``, ``attribute_generation``, the context
manager, and Captum's capability flags. Each method file only says how per-layer maps become relevance."""
from __future__ import annotations

import contextlib
import inspect

import torch
from captum.attr import Attribution
from captum.log import log_usage

from ..checks import check_finite, unwrap_parallel
from ..session import session
from ._inputs import as_attributions, check_reduce, format_inputs, start_layer_index
from ._generation import generation_inputs, generation_result, refuse_single_call_keywords
from ._runner import Runner

RECIPES = ("product", "official")


def official_start_layer(count: int) -> int:
    """The official notebooks start at layer 15 of 24; other depths keep the same fraction."""
    return min(count - 1, round(count * 15 / 24))


class ImplicitAttentionMethod(Attribution, contextlib.AbstractContextManager):
    """Base of :class:`MambaRawAttention`, :class:`MambaRollout` and :class:`MambaAttribution`.

    Args:
        model: a transformers model with supported token mixers (pure or hybrid), unchanged, any kernel path.
        forward_func: optional ``forward_func(inputs, *additional_forward_args, attention_mask=..., **kwargs)``
            returning (B, K) scores, for base models with a custom head. The token mixers it runs are those of
            ``model``. Without it, ``*ForCausalLM`` explains the next-token logits at ``position`` and
            ``*ForSequenceClassification`` its pooled class logits.
    """

    needs_residual_grads = False
    needs_operator_grads = False

    def __init__(self, model, forward_func=None):
        model = unwrap_parallel(model)  # nn.DataParallel runs replicas in threads the hooks cannot follow
        Attribution.__init__(self, forward_func if forward_func is not None else model)
        self.model = model
        self._runner = Runner(model, forward_func)

    # -- Captum's capability flags and protocol ------------------------------------------------------------------
    @property
    def multiplies_by_inputs(self) -> bool:
        return False

    def has_convergence_delta(self) -> bool:
        return False

    def attribute_future(self, *args, **kwargs):
        raise NotImplementedError(f"attribute_future is not implemented for {type(self).__name__}")

    def __exit__(self, *exc):
        self._runner.close()
        return False

    # -- the method's own part -----------------------------------------------------------------------------------
    def _relevance(self, explained, options: dict) -> list[torch.Tensor]:
        """Per query, the (B, L) relevance. Implemented by each method."""
        raise NotImplementedError

    def _options(self, recipe, start_layer, reduce, **extra) -> tuple[dict, int]:
        if recipe not in RECIPES:
            raise ValueError(f"mamba_captum: recipe={recipe!r}; choose one of {RECIPES}.")
        check_reduce(reduce)
        if reduce is None:
            raise ValueError("mamba_captum: reduce=None gives per-channel maps, which make no relevance; choose "
                             "'mean', 'abs_mean' or 'sum' (mc.implicit_attention(..., reduce=None) gives the maps).")
        if recipe == "official" and reduce != "mean":
            raise ValueError(f"mamba_captum: reduce={reduce!r} does not apply to recipe='official', which reduces "
                             "the channels as the papers' code does; leave it out.")
        count = len(self._runner.schedule)  # decoder-layer calls: a looped model's loop layers count once per pass
        start = official_start_layer(count) if (start_layer is None and recipe == "official") else \
            start_layer_index(start_layer, count)
        return dict(recipe=recipe, reduce=reduce, **extra), start

    def _method_options(self) -> list[str]:
        """The method's own keywords beyond the common ones (e.g. MambaAttribution's gradient_rule)."""
        return [name for name, p in inspect.signature(self._options).parameters.items()
                if name not in ("recipe", "start_layer", "reduce") and p.kind is p.POSITIONAL_OR_KEYWORD]

    def _relevance_per_query(self, inputs, target, additional_forward_args, attention_mask, position, formulation,
                             start_layer, reduce, components, recipe, forward_kwargs, queries=None, **extra):
        self._runner.refresh()  # the model's layers as they are now
        options, start = self._options(recipe, start_layer, reduce, **extra)
        # session: one call at a time on this model, a plain eager forward, RWKV's rescaling undone after the
        # rebuild (which needs the weights the forward used)
        with session(self.model, self._runner.decoder_layers, self._runner.forward_func):
            explained, relevance = self._captured_relevance(inputs, target, additional_forward_args, attention_mask,
                                                            position, formulation, components, forward_kwargs,
                                                            queries, options, start)
        for scores in relevance:
            check_finite(scores, f"the {type(self).__name__} relevance (please report this: every layer's output "
                         "was finite and reproduced)")
        return explained, relevance

    def _captured_relevance(self, inputs, target, additional_forward_args, attention_mask, position, formulation,
                            components, forward_kwargs, queries, options, start):
        names = [n for n in inspect.signature(self.attribute).parameters if n != "forward_kwargs"]
        explained = self._runner.run(
            inputs, attention_mask=attention_mask, position=position, queries=queries, targets=target,
            additional_forward_args=additional_forward_args, forward_kwargs=forward_kwargs, formulation=formulation,
            components=components, start_layer=start, residual_grads=self._wants_residual(options),
            operator_grads=self._wants_operator_grads(options), input_effects=self._wants_input_effects(options),
            need_scores=target is not None, options=names,
            where=f"{type(self).__name__}.attribute")
        return explained, self._relevance(explained, options)

    def _wants_residual(self, options) -> bool:
        return self.needs_residual_grads

    def _wants_operator_grads(self, options) -> bool:
        return self.needs_operator_grads

    def _wants_input_effects(self, options) -> bool:
        return False

    @log_usage()  # Captum's wrapper: NoiseTunnel calls attribute.__wrapped__
    def attribute(self, inputs, target=None, additional_forward_args=None, *, attention_mask=None, position=None,
                  formulation="unified", start_layer=None, reduce="mean", components=None, recipe="product",
                  **forward_kwargs):
        """Relevance of every input token for the explained output.

        Args:
            inputs: token ids (B, L), or embeddings (B, L, D) (passed as ``inputs_embeds``), or a 1-tuple of either;
                for a Vision Mamba, pixel values (B, C, H, W); for a packed vision tower (LFM3-VL's), the packed
                patches (N, P), with ``grid_thw=`` among the keywords.
            target: the explained class: int, a 1-tuple, one per example (list or 1-D tensor), or None (argmax).
                Class-agnostic methods check it and otherwise ignore it.
            additional_forward_args: a dict of keywords for the model (e.g. ``{"position_ids": ...}``), or a tuple
                of positional arguments after the inputs (token-id inputs or ``forward_func`` only).
            attention_mask: (B, L), 1 for real tokens; left or right padding.
            position: the query token (causal LM or ``forward_func``): int, one per example, or None for the last
                real token. A sequence-classification head always explains its pooled token, an image classifier
                its CLS token (or, without one, the mean of all rows).
            formulation: ``"unified"`` (gate · S6 · act · conv [· norm]) or ``"hidden"`` (S6 alone).
            start_layer: first decoder layer used (negative allowed); None: 0, or the official start with
                ``recipe="official"`` (15 of 24 layers).
            reduce: channel reduction of the maps, ``"mean"`` | ``"abs_mean"`` | ``"sum"`` (product recipe; the
                official recipe reduces as the papers' code does and refuses another value).
            components: unified ablations, as in :func:`mamba_captum.implicit_attention`.
            recipe: ``"product"`` (full L×L matrices, DESIGN.md §4) or ``"official"`` (the papers' notebooks).
            **forward_kwargs: passed to the model's forward (e.g. ``position_ids``); a keyword neither this method
                nor the model's forward reads is refused (transformers would drop it silently). An
                ``attention_mask`` among them or in ``additional_forward_args`` is the explanation's mask too.

        Returns:
            (B, L) for token ids; (B, L, D) for embeddings (each token's relevance repeated over its features);
            (B, 1, H, W) for pixels (the patch relevance interpolated from the patch centres, CLS dropped); (N, P)
            for packed patches (each patch's relevance repeated over its values); a 1-tuple when ``inputs`` was a
            tuple.
        """
        inputs_tensor, was_tuple = format_inputs(inputs, self._runner.image_model)
        _, relevance = self._relevance_per_query(inputs_tensor, target, additional_forward_args, attention_mask,
                                                 position, formulation, start_layer, reduce, components, recipe,
                                                 forward_kwargs)
        return as_attributions(relevance[0], inputs_tensor, was_tuple, self._runner.layout,
                               self._runner.packed)

    def attribute_generation(self, inp, target=None, *, tokenizer=None, gen_args=None, formulation="unified",
                             start_layer=None, reduce="mean", components=None, recipe="product", **kwargs):
        """Token × token relevance of a generated text, as Captum's ``LLMAttributionResult``.

        One forward pass over prompt + generated tokens; the row of each generated token t is the explanation of
        its next-token logit (query = the token before it, target = t), restricted to the prompt tokens that
        ``inp``'s skip mask keeps.

        Args:
            inp: a :class:`captum.attr.TextTokenInput`, or prompt ids (1, Lp).
            target: the generated text (str, tokenised without special tokens; refused, ValueError, if a word of
                it is not in the tokenizer's vocabulary) or its ids; None generates it greedily with
                ``model.generate(prompt, **gen_args)`` (default ``max_new_tokens=25``).
            tokenizer: needed for str targets and token names when ``inp`` is not a ``TextTokenInput``.
            **kwargs: the method's own options (e.g. MambaAttribution's ``gradient_rule``), and keywords for the
                model's forward over prompt + target (e.g. ``position_ids`` of shape (1, Lp + T); they need an
                explicit ``target``).
        Returns:
            ``LLMAttributionResult`` with ``token_attr`` (T, n_input_tokens), ``seq_attr`` = its sum over the T
            generated tokens, ``output_probs`` (T,) the probabilities of the generated tokens.
        Warns:
            :class:`~mamba_captum.UnknownTokenWarning` when the prompt (with a tokenizer to tell) holds the unknown
            token: words not in the vocabulary, each explained as that one stand-in.
        """
        if self._runner.image_model:
            raise TypeError("mamba_captum: attribute_generation explains generated text; an image model generates "
                            "none: use attribute(pixel_values, target=...).")
        refuse_single_call_keywords(kwargs)
        method_options = {k: kwargs.pop(k) for k in self._method_options() if k in kwargs}
        prompt, full, target_ids, tokenizer, keep = generation_inputs(self.model, self._runner, inp, target,
                                                                      tokenizer, gen_args, kwargs)
        queries = [(torch.tensor([prompt.shape[1] - 1 + t], device=full.device), target_ids[t:t + 1])
                   for t in range(target_ids.shape[0])]
        explained, relevance = self._relevance_per_query(full, None, None, None, None, formulation, start_layer,
                                                         reduce, components, recipe, kwargs, queries=queries,
                                                         **method_options)
        return generation_result(inp, prompt, target_ids, tokenizer, keep, explained, relevance)
