"""One captured forward pass of the explained model (the :class:`Runner`): the method's arguments bound to the
model's forward, the explained scores and query rows picked, the gradients a method asks for taken; and what the
methods read from it (:class:`Explained`: the per-layer operators in execution order, as :class:`LayerRecord` s).

Shapes: B batch, L tokens, D model width, K classes / vocabulary, Q queries (one per explained output; Q = 1 for
``attribute``, one per generated token for ``attribute_generation``).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import torch

from .. import families
from ..capture import LayerCapture
from ..checks import check_finite, check_forward_devices, check_inputs, check_keywords, underlying_forward
from ..keys import SharedAttentionKey
from ..layout import (PackedPatches, StagedLayout, check_packed, check_pixels, packed_tower, refuse_attention_mask,
                      vision_layout)
from ..rebuild import captured_forward, kept_components, rebuilt_operators
from ._gradient import score_gradients
from ._inputs import check_forward_func_inputs, format_mask, format_positions, format_targets
from ._rollout import Query


@dataclass
class LayerRecord:
    """One token-mixing layer, handed to a method in execution order."""

    key: int | str  # decoder-layer index; "{i}.shared_attention" for Zamba2's shared block, "{i}.mlp_sconv" ...
    layer: int  # decoder-layer index the map belongs to
    operator: object  # see mamba_captum.operators
    operator_grads: list | None  # per query: gradient w.r.t. the operator's output (gradient × operator rule)
    residual_grads: list | None  # per query: (B, L, D) gradient w.r.t. the residual stream entering the layer
    input_effects: list | None = None  # per query: (B, L) Σ_features gradient × input at the layer's inputs
    row_effects: list | None = None  # per query: (B, L, L) the same per output row (input_effects="rows")
    effects_include_values: bool = True  # a mixer's input feeds its value path too; an attention's queries / keys not


@dataclass
class Explained:
    """A captured forward pass, ready to be turned into explanations."""

    model: object
    trace: object
    decoder_layers: object
    formulation: str
    components: frozenset
    mask: torch.Tensor  # (B, L) float, 1 = real token
    queries: list[Query]
    scores: list[torch.Tensor | None] = field(default_factory=list)  # per query: (B, K) explained scores, detached
    residual_grads: dict = field(default_factory=dict)  # layer -> [per query (B, L, D)]
    layout: object = None  # an image model's TokenLayout / StagedLayout; None for token models

    @property
    def staged(self) -> bool:
        """A multi-stage image model: each stage's blocks mix their own number of tokens."""
        return isinstance(self.layout, StagedLayout)

    def mask_for(self, length: int) -> torch.Tensor:
        """(B, length): the real tokens of a layer of ``length`` tokens (a stage of a multi-stage model has no
        padding: all ones)."""
        if length == self.mask.shape[1]:
            return self.mask
        if not self.staged:
            raise ValueError(f"mamba_captum: a layer of {length} tokens in a sequence of {self.mask.shape[1]}.")
        return torch.ones(self.batch, length, dtype=self.mask.dtype, device=self.mask.device)

    @property
    def batch(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def layers(self):
        """Yield a :class:`LayerRecord` per token-mixing layer, one operator alive at a time."""
        attention_mask = None if bool(self.mask.all()) else self.mask
        with torch.no_grad():
            for key, operator, _, grads in rebuilt_operators(self.model, self.trace, self.decoder_layers,
                                                             self.formulation, self.components, attention_mask):
                layer = key if isinstance(key, int) else int(str(key).split(".")[0])
                effects, rows, include_values = self._input_effects(key, layer)
                yield LayerRecord(key, layer, operator, grads, self.residual_grads.get(layer), effects, rows,
                                  include_values)

    def _input_effects(self, key, layer):
        """Per query, the (B, L) gradient × input of the record's layer at its inputs, or None (not asked for); the
        same per output row, (B, L, L), or None; and whether the inputs feed the value path (a mixer's) or not (an
        attention layer's queries and keys).

        A mixer's record: its input (the first mixer's, for mixers composed without a residual between them; the
        input feeds everything the mixer does, including an attention call the mixer consumes and FalconH1's
        parallel attention, which reads the same tensor); an attention layer of its own (or Zamba2's shared block):
        its queries and keys (the values' part is the operator's own)."""
        mixers = [c for c in self.trace.mixer_calls if c.located.layer == layer and c.located.follows is None]
        if isinstance(key, str) and not isinstance(key, SharedAttentionKey):  # LayerPartKey: "{layer}.{part}"
            calls = [c for c in mixers if c.located.name == str(key)]
        elif isinstance(key, int) and mixers:
            calls = mixers[:1]
        else:
            calls = [c for c in self.trace.attention_calls if c.layer == layer]
        include_values = bool(calls) and any(c is calls[0] for c in mixers)
        effects = [c.input_effects for c in calls]
        if not calls or any(e is None for e in effects):
            return None, None, include_values
        rows = [c.row_effects for c in calls]
        summed = [sum(per_call[q] for per_call in effects) for q in range(len(effects[0]))]
        if any(r is None for r in rows):
            return summed, None, include_values
        return summed, [sum(per_call[q] for per_call in rows) for q in range(len(rows[0]))], include_values


LOGITS_TRIMMING = ("logits_to_keep", "num_logits_to_keep")


class Runner:
    """Runs the explained model (or the user's ``forward_func``) once under the capture hooks."""

    def __init__(self, model, forward_func=None):
        self.model = model
        self.forward_func = forward_func
        self.refresh()  # TypeError now for unsupported models
        self._active: set = set()  # captures whose hooks are on the model right now

    def refresh(self):
        """Find the decoder layers and mixers again: a layer replaced since the last call is the one explained."""
        self.decoder_layers, self.mixers = families.locate(self.model)
        # the decoder-layer index of each decoder-layer call (a looped model runs some layers more than once)
        self.schedule = families.layer_schedule(self.decoder_layers, self.mixers)
        self.layout = vision_layout(self.model)  # an image model's tokens (None for token models)
        self.packed = packed_tower(self.model)  # a vision tower over packed patches (N, P) and grid_thw
        self.causal = not any(m.adapter.NONCAUSAL for m in self.mixers)

    def close(self):
        """Remove the hooks of any capture still registered (the context-manager guarantee)."""
        for capture in list(self._active):
            capture.remove()
        self._active.clear()

    @property
    def image_model(self) -> bool:
        """Pixels in (an image classifier, or a tower over packed patches), not tokens."""
        return self.layout is not None or self.packed

    @property
    def is_classifier(self) -> bool:
        return self.forward_func is None and type(self.model).__name__.endswith("ForSequenceClassification")

    def _arguments(self, inputs, attention_mask, additional_forward_args, forward_kwargs, options, where):
        """(positional args, keyword args, attention mask) of the call. Captum's ``additional_forward_args`` (a dict,
        or positional arguments after the inputs) and the method's ``**forward_kwargs`` are merged into keywords
        (positional ones bound to the model's ``forward``), so that an ``attention_mask`` among them is the mask the
        explanation uses, and a keyword nobody reads is refused instead of dropped."""
        kwargs, args = dict(forward_kwargs or {}), ()
        if isinstance(additional_forward_args, dict):
            extra = dict(additional_forward_args)
        elif additional_forward_args is None:
            extra = {}
        else:
            args = tuple(additional_forward_args) if isinstance(additional_forward_args, (tuple, list)) \
                else (additional_forward_args,)
            extra = {}
            if self.forward_func is None and args:
                if inputs.is_floating_point() and not self.image_model:
                    raise TypeError("mamba_captum: with inputs_embeds, pass additional_forward_args as a dict of "
                                    "keywords.")
                signature = inspect.signature(underlying_forward(self.model))
                try:
                    bound = signature.bind_partial(inputs, *args).arguments
                except TypeError as error:
                    raise TypeError(f"mamba_captum: additional_forward_args {len(args)} positional value(s) do not "
                                    f"fit {type(self.model).__name__}.forward after the inputs ({error}); pass a "
                                    "dict of keywords.") from None
                if any(signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL for name in bound):
                    raise TypeError(f"mamba_captum: {type(self.model).__name__}.forward takes *args, so the positional "
                                    "additional_forward_args cannot be matched to its arguments; pass a dict of "
                                    "keywords (e.g. {'attention_mask': mask}).")
                extra, args = dict(list(bound.items())[1:]), ()
        twice = sorted(set(extra) & set(kwargs))
        if twice:
            raise ValueError(f"mamba_captum: {twice[0]} is given both in additional_forward_args and as a keyword.")
        kwargs.update(extra)
        if "attention_mask" in kwargs:  # the mask the model sees is the mask the explanation uses
            if attention_mask is not None:
                raise ValueError("mamba_captum: attention_mask is given twice (as attention_mask= and among the "
                                 "forward arguments); give it once.")
            attention_mask = kwargs.pop("attention_mask")
        if self.forward_func is not None:
            check_keywords(kwargs, self.forward_func, options, where)
            return args, kwargs, attention_mask
        if self.image_model:  # an image model: model(pixel_values, **kwargs)
            if self.packed and "pixel_values" in kwargs:
                raise ValueError("mamba_captum: pass the explained patches as the inputs, not as pixel_values=.")
            check_keywords(kwargs, underlying_forward(self.model), options, where)
            return args, kwargs, attention_mask
        for name in ("input_ids", "inputs_embeds"):
            if name in kwargs:
                raise ValueError(f"mamba_captum: pass the explained tokens as the inputs, not as {name}=.")
        for name in LOGITS_TRIMMING:
            if kwargs.get(name) not in (None, 0):
                raise ValueError(f"mamba_captum: {name}= keeps the logits of the last positions only; the "
                                 "explanation reads the query position's logits: leave it out.")
        check_keywords(kwargs, underlying_forward(self.model), options, where)
        # No cache (it changes nothing in the outputs, and RWKV's in-place state breaks gradients); a ModelOutput
        # whatever config.return_dict says, so that the logits are found by name.
        kwargs.update(use_cache=False, return_dict=True)
        return args, kwargs, attention_mask

    def _call(self, inputs, args, kwargs, attention_mask):
        if attention_mask is not None:
            kwargs = {**kwargs, "attention_mask": attention_mask}
        if self.forward_func is not None:
            return self.forward_func(inputs, *args, **kwargs)
        if inputs.is_floating_point() and not self.image_model:
            return self.model(inputs_embeds=inputs, **kwargs)
        return self.model(inputs, **kwargs)

    def _scores(self, output, inputs, positions, mask, attention_mask):
        """The (B, K) explained scores and the query positions (B,) they come from."""
        batch, length = mask.shape
        if self.packed and self.forward_func is None:  # a vision tower returns hidden states, no scores
            return None, positions
        if self.layout is not None and self.forward_func is None:  # an image classifier returns its logits
            output = getattr(output, "logits", output)
        if self.forward_func is not None or self.layout is not None:
            scores = output
            if not torch.is_tensor(scores) or scores.dim() != 2 or scores.shape[0] != batch:
                shape = tuple(scores.shape) if torch.is_tensor(scores) else type(scores).__name__
                who = "forward_func" if self.forward_func is not None else type(self.model).__name__
                raise ValueError(f"mamba_captum: {who} must return (B, K) scores, one row per example "
                                 f"(B = {batch}); got {shape}.")
            return scores, positions
        logits = getattr(output, "logits", None)
        if logits is None:
            return None, positions
        if logits.dim() == 3:  # causal LM: next-token logits at the query position
            if logits.shape[:2] != (batch, length):
                raise ValueError(f"mamba_captum: the model returned logits of shape {tuple(logits.shape)} for inputs "
                                 f"({batch}, {length}); the explanation needs the logits of every position.")
            return logits[torch.arange(batch, device=logits.device), positions.to(logits.device)], positions
        if logits.dim() == 2:  # sequence classification: HF pooled the last non-pad token itself
            pooled = self._pooled_positions(inputs)
            if attention_mask is not None and not bool(mask[torch.arange(batch, device=mask.device),
                                                            pooled.to(mask.device)].all()):
                raise ValueError("mamba_captum: the classifier pools a padding token of some examples (with "
                                 "inputs_embeds, HF pools the last position, blind to padding; with ids, the last "
                                 "token that is not pad_token_id): pad on the left, or pass token ids with "
                                 "pad_token_id set.")
            return logits, pooled
        raise ValueError(f"mamba_captum: unexpected logits shape {tuple(logits.shape)}.")

    def _pooled_positions(self, inputs):
        """The token HF's ``*ForSequenceClassification`` pools: the last one that is not ``pad_token_id``."""
        batch, length = inputs.shape[:2]
        pad = getattr(self.model.config, "pad_token_id", None)
        if pad is None or inputs.is_floating_point():
            return torch.full((batch,), length - 1, dtype=torch.long, device=inputs.device)
        index = torch.arange(length, device=inputs.device)
        return (index * (inputs != pad)).argmax(-1)

    def run(self, inputs, *, attention_mask=None, position=None, queries=None, targets=None,
            additional_forward_args=None, forward_kwargs=None, formulation="unified", components=None,
            start_layer=0, residual_grads=False, operator_grads=False, input_effects=False, need_scores=False,
            options=(), where="the method") -> Explained:
        """One forward pass under the hooks; gradients of each query's target score if asked for.

        ``queries``: explicit list of (positions (B,), targets (B,) or None) for generation; otherwise one query from
        ``position`` and ``target``. ``options`` / ``where``: the calling method's own keyword names and name, for
        the message when a keyword is neither the method's nor the model's.
        """
        kept = kept_components(formulation, components)
        need_grad = residual_grads or operator_grads or input_effects
        if need_grad and torch.is_inference_mode_enabled():
            raise RuntimeError("mamba_captum: this method takes gradients, which torch.inference_mode() forbids; "
                               "call it outside inference_mode (the library switches gradients on for its own "
                               "forward pass).")
        args, kwargs, attention_mask = self._arguments(inputs, attention_mask, additional_forward_args,
                                                       forward_kwargs, options, where)
        packed = None
        if self.packed:
            mask, positions, packed = self._packed_query(inputs, kwargs, attention_mask, position)
        elif self.layout is not None:
            mask, positions = self._image_query(inputs, attention_mask, position)
        else:
            if self.forward_func is None:
                check_inputs(self.model, None if inputs.is_floating_point() else inputs,
                             inputs if inputs.is_floating_point() else None)
            else:  # the same checks, but for the device and the width, which a forward_func may change
                check_forward_func_inputs(self.model, inputs)
            mask = format_mask(attention_mask, inputs)
            if position is not None and self.is_classifier:
                raise ValueError("mamba_captum: position= does not apply to a sequence-classification head, which "
                                 "explains its pooled (last non-pad) token.")
            positions = format_positions(position, mask)
        if self.forward_func is None:
            check_forward_devices(kwargs, inputs.device, self.model)
        layers = list(range(start_layer, len(self.schedule)))
        embeddings = getattr(self.model, "get_input_embeddings", lambda: None)()
        capture = LayerCapture(self.decoder_layers, self.mixers, layers, detach=not need_grad,
                               record_residual=residual_grads, schedule=self.schedule,
                               embeddings=embeddings if isinstance(embeddings, torch.nn.Module) else None)
        # float inputs (embeddings, pixels) start the graph themselves: whatever the model derives from them
        # (Zamba2's copy of the embeddings for its shared blocks) is then differentiable even when frozen
        call_inputs = inputs.detach().requires_grad_(True) if need_grad and inputs.is_floating_point() and \
            not inputs.requires_grad else inputs
        self._active.add(capture)
        try:
            with torch.set_grad_enabled(need_grad):
                trace, output = captured_forward(self.model, capture, self.mixers, layers, attention_mask, kwargs,
                                                 lambda: self._call(call_inputs, args, kwargs, attention_mask))
        finally:
            self._active.discard(capture)
        self._check_tokens_seen(trace, inputs, mask)
        explained = Explained(self.model, trace, self.decoder_layers, formulation, kept, mask, [], layout=self.layout)
        grad_mode = torch.set_grad_enabled(need_grad)  # scores are picked from the logits inside the graph
        try:
            if queries is None:
                scores, positions = self._scores(output, inputs, positions, mask, attention_mask)
                if scores is None and (need_grad or need_scores) and self.packed:
                    raise TypeError(
                        f"mamba_captum: {type(self.model).__name__} returns hidden states, no scores to explain; pass "
                        "forward_func=(pixel_values, grid_thw=...) -> (1, K) scores of the packed items (one example: "
                        "e.g. a head on the mean of last_hidden_state), or use MambaRawAttention / MambaRollout.")
                if scores is None and (need_grad or need_scores):
                    raise TypeError(
                        f"mamba_captum: {type(self.model).__name__} returns no logits; pass forward_func= returning "
                        "(B, K) scores (e.g. a head on the last hidden state).")
                query_targets = None if scores is None else format_targets(targets, scores.detach())
                queries = [(positions, scores, query_targets)]
            else:
                logits = output.logits if self.forward_func is None else output
                queries = [(pos, logits[torch.arange(len(pos)), pos], tgt) for pos, tgt in queries]
            for _, scores, _ in queries:
                check_finite(None if scores is None else scores.detach(), "the explained scores (the model's "
                             "output logits)", self.model)
            weights = None if self.layout is None or not self.layout.pooled else \
                self.layout.query_weights(explained.batch, device=mask.device)
            if packed is not None:  # each item's mean output: per item, what the item alone would get
                weights = packed.query_weights(device=mask.device)
            explained.queries = [Query(pos, tgt, weights, self.causal) for pos, _, tgt in queries]
            explained.scores = [None if s is None else s.detach() for _, s, _ in queries]
            if need_grad:
                score_gradients(explained, trace, queries, layers, residual_grads, operator_grads, input_effects)
        finally:
            grad_mode.__exit__(None, None, None)
            trace.detach()
        return explained

    def _check_tokens_seen(self, trace, inputs, mask):
        """The layers must have mixed the explained tokens, as given: the relevance is laid over the inputs' positions.
        A ``forward_func`` that adds (a prompt template), drops or reorders tokens or examples would shift it. Shapes
        are checked always; token ids also by value (pixels cannot be: a forward_func may rightly normalise them, so
        it must keep the examples' order).

        Raises:
            ValueError: naming what the layers saw and what the inputs are.
        """
        batch, length = mask.shape
        staged = isinstance(self.layout, StagedLayout)
        for call in trace.mixer_calls:
            hidden = call.hidden_states
            seen = (1, hidden.shape[0]) if hidden.dim() == 2 else tuple(hidden.shape[:2])  # packed: one sequence
            if staged:  # each stage's blocks mix that stage's grid; a mixer may take it in another channel order
                stage = self.layout.stage_of_block(call.located.layer)
                try:
                    tokens = self.layout.as_tokens(hidden, stage)
                except ValueError:
                    tokens = dataclasses.replace(self.layout, stream=None).as_tokens(hidden, stage)
                seen, length = tuple(tokens.shape[:2]), self.layout.stages[stage].length
            if seen != (batch, length):
                raise ValueError(
                    f"mamba_captum: the token mixers saw {seen[0]} sequences of {seen[1]} tokens, but the explained "
                    f"inputs are {batch} of {length}: the relevance would not line up with the inputs. A forward_func "
                    "must hand the model the inputs' tokens as they are (no added prompt or template tokens, none "
                    "dropped, same order): put such tokens into the inputs themselves.")
        if self.forward_func is not None and not inputs.is_floating_point() and trace.embedding_inputs:
            seen = trace.embedding_inputs[0]
            if seen.shape != inputs.shape or not torch.equal(seen.to(inputs.device), inputs):
                raise ValueError(
                    "mamba_captum: the forward_func handed the model other token ids than the explained inputs "
                    "(reordered or changed examples or tokens): the relevance would not line up with the inputs. "
                    "Pass the inputs to the model as they are.")

    def _packed_query(self, inputs, kwargs, attention_mask, position):
        """A packed vision tower's (mask, positions, PackedPatches): one sequence of the N patches, all real; the
        query is pooled (each item's mean row)."""
        grid = kwargs.get("grid_thw")
        if self.forward_func is None:
            layout = check_packed(self.model, inputs, grid, attention_mask)
        else:
            if grid is None or inputs.dim() != 2:
                raise ValueError("mamba_captum: a packed vision tower's forward_func takes the packed patches (N, P) "
                                 "as inputs and grid_thw= among the keywords (or additional_forward_args).")
            layout = PackedPatches.from_grid(grid, self.model.spatial_merge_size)
            if layout.length != inputs.shape[0]:
                raise ValueError(f"mamba_captum: grid_thw holds {layout.length} patches, the inputs {inputs.shape[0]}.")
            refuse_attention_mask(attention_mask)
        if position is not None:
            raise ValueError("mamba_captum: position= does not apply to a vision tower; the query is the mean of each "
                             "item's output tokens.")
        mask = torch.ones(1, layout.length, device=inputs.device)
        return mask, torch.zeros(1, dtype=torch.long, device=inputs.device), layout

    def _image_query(self, inputs, attention_mask, position):
        """An image model's (mask, positions): all tokens real; the query is its CLS token (a pooled head's
        positions are unused: its query weights are the layout's)."""
        if self.forward_func is None:
            check_pixels(self.model, inputs, self.layout)
        elif inputs.dim() != 4 or tuple(inputs.shape[-2:]) != tuple(self.layout.img_size):
            raise ValueError(
                f"mamba_captum: the inputs are {tuple(inputs.shape)}, the model's images "
                f"{tuple(self.layout.img_size)}: the relevance is laid over the model's image, so a forward_func "
                "that resizes or reshapes the pixels would misplace it. Pass images of the model's size.")
        elif inputs.shape[0] == 0:
            raise ValueError("mamba_captum: the pixel values hold no images (batch size 0).")
        refuse_attention_mask(attention_mask)
        if position is not None:
            raise ValueError("mamba_captum: position= does not apply to an image classifier, whose head reads its "
                             f"{'CLS token' if not self.layout.pooled else 'mean over the tokens'}.")
        batch = inputs.shape[0]
        mask = torch.ones(batch, self.layout.length, device=inputs.device)
        index = 0 if self.layout.pooled else self.layout.cls_index
        return mask, torch.full((batch,), index, dtype=torch.long, device=inputs.device)
