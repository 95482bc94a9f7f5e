"""The pipeline of :mod:`mamba_captum.explain`: the methods run on each text, their results as records.

``explain(model, tokenizer, texts)`` runs the methods (by default every one the model supports) on each text and
returns :class:`Explanation` records (tokens, prediction, per-method relevance, per-layer implicit-attention maps)
that serialise to JSON.
"""
from __future__ import annotations

import dataclasses

import torch

from ..attention import implicit_attention
from ..checks import input_device as _input_device
from ..attr import MambaAttribution, MambaLRP, MambaRawAttention, MambaRollout, MambaSelectionAttribution
from ..families import decoder_layers
from ..session import session
from ..tokens import unknown_spelling, unknown_words
from .loading import UsageError, check_supported, is_classifier
from .text import candidate_ids, encode_text, label_words, readable_tokens, resolve_target

# the default method first (MambaAttribution's recipe="auto": docs/faithfulness.md, "The default")
METHODS = {"attribution": MambaAttribution, "raw": MambaRawAttention, "rollout": MambaRollout,
           "selection": MambaSelectionAttribution, "lrp": MambaLRP}
# the methods that explain one output (``target``); raw and rollout read the operator alone
CLASS_SPECIFIC = ("attribution", "selection", "lrp")


@dataclasses.dataclass
class Explanation:
    """One explained text.

    Attributes:
        text: the input text.
        tokens: its L tokens (special tokens included; padding never).
        prediction, probability: the predicted label / token and its probability (over ``labels`` when the model
            has label words, over the whole vocabulary or the classes otherwise).
        target, target_probability: what was explained (the prediction unless a target was given).
        relevance: method name -> L scores (raw and rollout are class-agnostic; attribution explains ``target``).
        layer_maps: layer index -> (L, L) channel-mean implicit attention (query row, key column), or None.
        settings: formulation and the model's name, for the report.
        display_tokens: the L tokens as readable text (see :func:`readable_tokens`), or None.
        unknown_words: the words of ``text`` that became the tokenizer's unknown token, in order, one entry per
            word (None for one a tokenizer without offsets cannot name; :func:`mamba_captum.tokens.unknown_words`);
            empty when none did, or when the text or the tokenizer was not at hand (:func:`explain_ids`).
        unknown_token: how the tokenizer spells that token (``[UNK]``), or None.
    """
    text: str
    tokens: list[str]
    prediction: str
    probability: float
    target: str
    target_probability: float
    relevance: dict[str, list[float]]
    layer_maps: dict[int, torch.Tensor] | None = None
    settings: dict = dataclasses.field(default_factory=dict)
    display_tokens: list[str] | None = None  # the tokens as text (byte-level BPE's "Ġthe" -> "the"), for people
    unknown_words: list[str | None] = dataclasses.field(default_factory=list)
    unknown_token: str | None = None

    def shown(self) -> list[str]:
        """The tokens to show people: ``display_tokens`` when known, else ``tokens``."""
        return self.display_tokens or self.tokens

    def top_tokens(self, method: str, k: int = 3) -> list[tuple[str, float]]:
        """The ``k`` tokens (as shown to people, :meth:`shown`) with the largest |relevance| under ``method``,
        largest first, with their scores."""
        scores = self.relevance[method]
        return [(self.shown()[i], float(scores[i])) for i in self.top_indices(method, k)]

    def top_indices(self, method: str, k: int = 3) -> list[int]:
        """The positions of :meth:`top_tokens`: the ``k`` largest |relevance| under ``method``, largest first."""
        return torch.tensor(self.relevance[method]).abs().argsort(descending=True, stable=True)[:k].tolist()

    def to_dict(self) -> dict:
        """JSON-safe: everything but the layer maps."""
        return {"text": self.text, "tokens": self.tokens, "display_tokens": self.shown(), "prediction": self.prediction,
                "probability": self.probability, "target": self.target,
                "target_probability": self.target_probability, "relevance": self.relevance,
                "top_tokens": {name: self.top_tokens(name) for name in self.relevance}, "settings": self.settings,
                "unknown_words": self.unknown_words, "unknown_token": self.unknown_token}

    @classmethod
    def from_dict(cls, row: dict) -> "Explanation":
        """The explanation :meth:`to_dict` wrote (without its layer maps); a dict of an older version, without
        ``unknown_words`` / ``unknown_token``, loads with none."""
        return cls(text=row["text"], tokens=row["tokens"], prediction=row["prediction"],
                   probability=row["probability"], target=row["target"], target_probability=row["target_probability"],
                   relevance=row["relevance"], settings=row.get("settings", {}),
                   display_tokens=row.get("display_tokens"),
                   unknown_words=list(row.get("unknown_words") or []), unknown_token=row.get("unknown_token"))


def _inputs_device(model) -> torch.device:
    """Where the token ids go: the input embeddings' device (accelerate moves them for a dispatched model)."""
    try:
        return _input_device(model)
    except ValueError:
        raise UsageError("the model is on the meta device, which holds no weights; move it to cpu or cuda first.") \
            from None


def _name(model, tokenizer, index, words, candidates) -> str:
    if candidates is not None and index in candidates:
        return words[candidates.index(index)]
    if is_classifier(model):
        return str(model.config.id2label.get(index, index))
    return tokenizer.convert_ids_to_tokens(int(index)) if tokenizer is not None else str(int(index))


def lrp_refusal(model) -> str | None:
    """None if MambaLRP has rules for every layer of ``model`` (docs/methods/lrp.md lists them), else why not."""
    try:
        with MambaLRP(model):  # its construction plans the rules; leaving closes what it opened
            pass
    except NotImplementedError as error:
        return str(error).removeprefix("mamba_captum: ")
    return None


def explain(model, tokenizer, texts, *, target=None, methods=None, formulation: str = "unified",
            labels=None, layer_maps: bool = True) -> list[Explanation]:
    """Explain each text (one at a time, so no padding) with ``methods``.

    Args:
        model: a supported HF ``*ForCausalLM`` (explains the next token after the text) or
            ``*ForSequenceClassification`` model, in eval mode.
        tokenizer: its tokenizer.
        texts: a string or a list of strings.
        target: None (explain each prediction), a label word / token string, or an id / class index.
        methods: names among ``"raw"``, ``"rollout"``, ``"attribution"``, ``"selection"``
            (MambaSelectionAttribution), ``"lrp"`` (MambaLRP); default every one, less ``"lrp"`` for a model
            without MambaLRP rules (asked for by name, that raises).
        formulation: ``"unified"`` or ``"hidden"`` (MambaLRP has none: it differentiates the model itself).
        labels: candidate answers of a causal LM (e.g. ``["negative", "positive"]``); see :func:`label_words`.
        layer_maps: also return each layer's (L, L) channel-mean map.
    Returns:
        one :class:`Explanation` per text, with the words of it that became the tokenizer's unknown token
        (``unknown_words``; encode_text also warns about them).
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    device = _inputs_device(model)
    inputs = [encode_text(model, tokenizer, text).to(device) for text in texts]
    results = explain_ids(model, tokenizer, inputs, texts=texts, target=target, methods=methods,
                          formulation=formulation, labels=labels, layer_maps=layer_maps)
    spelling = unknown_spelling(tokenizer)
    for item, text in zip(results, texts):  # as encode_text tokenized it (special tokens added)
        item.unknown_words = unknown_words(tokenizer, text)
        item.unknown_token = spelling if item.unknown_words else None
    return results


def explain_ids(model, tokenizer, inputs, *, texts=None, target=None, methods=None,
                formulation: str = "unified", labels=None, layer_maps: bool = True) -> list[Explanation]:
    """As :func:`explain`, for token ids: ``inputs`` is a list of (1, L) or (L,) id tensors (no padding), or a
    (B, L) batch with its (B, L) ``attention_mask`` given as ``inputs=(ids, mask)`` (each row is cut to its real
    tokens). ``tokenizer`` may be None (tokens are then shown as ids)."""
    if isinstance(inputs, tuple):
        ids, mask = inputs
        inputs = [row[mask_row.bool()][None] for row, mask_row in zip(ids, mask)]
    inputs = [ids if ids.dim() == 2 else ids[None] for ids in inputs]
    if any(ids.shape[1] == 0 for ids in inputs):
        raise UsageError("an input has no tokens (an empty id tensor or an all-zero attention_mask row).")
    chosen = methods is not None
    methods = list(METHODS) if methods is None else [methods] if isinstance(methods, str) else list(
        dict.fromkeys(methods))  # each method once
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r}; choose among {', '.join(METHODS)}.")
    if formulation not in ("unified", "hidden"):
        raise UsageError(f"unknown formulation {formulation!r}; choose unified or hidden.")
    check_supported(model)
    refusal = lrp_refusal(model) if "lrp" in methods else None
    if refusal is not None and not chosen:
        methods.remove("lrp")  # the default: every method the model supports
    elif refusal is not None:
        raise UsageError(f"{refusal} Leave out the method lrp.")
    device = _inputs_device(model)
    words = label_words(model, labels)
    candidates = candidate_ids(model, tokenizer, words)
    wanted = resolve_target(model, tokenizer, target, words, candidates)
    # the recipe MambaAttribution's default resolves to here (the magnitude of MambaLRP's relevance, or the
    # rollout), for the report's note on its scale
    attribution_recipe = MambaAttribution(model).resolve_recipe(formulation=formulation) \
        if "attribution" in methods else None
    results = []
    for number, input_ids in enumerate(inputs):
        input_ids = input_ids.to(device)
        attention_mask = torch.ones_like(input_ids)
        with torch.no_grad(), session(model, decoder_layers(model)):  # as the library's own forwards: RWKV's
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # rescaling undone after it
        scores = (logits[0] if is_classifier(model) else logits[0, -1]).float()
        if candidates is not None:
            probabilities = torch.zeros_like(scores)
            probabilities[candidates] = scores[candidates].softmax(-1)
        else:
            probabilities = scores.softmax(-1)
        predicted = int(probabilities.argmax())
        explained = predicted if wanted is None else wanted
        relevance = {}
        for name in methods:
            options = {"target": explained} if name in CLASS_SPECIFIC else {}
            if name != "lrp":
                options["formulation"] = formulation
            row = METHODS[name](model).attribute(input_ids, attention_mask=attention_mask, **options)
            relevance[name] = [float(v) for v in row[0].float().cpu()]
        maps = None
        if layer_maps:
            maps = {layer: value[0].float().cpu() for layer, value in implicit_attention(
                model, input_ids, attention_mask, formulation=formulation, reduce="mean").items()}
        ids = input_ids[0].tolist()
        tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]
        text = texts[number] if texts is not None else (
            tokenizer.decode(ids) if tokenizer is not None else " ".join(tokens))
        results.append(Explanation(
            text=text, tokens=tokens, prediction=_name(model, tokenizer, predicted, words, candidates),
            probability=float(probabilities[predicted]),
            target=_name(model, tokenizer, explained, words, candidates),
            target_probability=float(probabilities[explained]), relevance=relevance, layer_maps=maps,
            display_tokens=readable_tokens(tokenizer, tokens) if tokenizer is not None else None,
            settings={"model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
                      "model_class": type(model).__name__, "formulation": formulation,
                      "attribution_recipe": attribution_recipe,
                      "labels": words}))
    return results
