"""Texts in, explanations out: the layer the CLI, the HTML report and the Trainer callback share.

``explain(model, tokenizer, texts)`` runs the three methods on each text and returns :class:`Explanation` records
(tokens, prediction, per-method relevance, per-layer implicit-attention maps) that serialise to JSON.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .attention import implicit_attention
from .attr import MambaAttribution, MambaRawAttention, MambaRollout
from .families import SUPPORTED_MIXERS

METHODS = {"raw": MambaRawAttention, "rollout": MambaRollout, "attribution": MambaAttribution}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(ValueError):
    """A problem with what the user asked for (a path, a target, a text): the CLI prints it as one line."""


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

    def shown(self) -> list[str]:
        """The tokens to show people: ``display_tokens`` when known, else ``tokens``."""
        return self.display_tokens or self.tokens

    def top_tokens(self, method: str, k: int = 3) -> list[tuple[str, float]]:
        """The ``k`` tokens (as shown to people, :meth:`shown`) with the largest |relevance| under ``method``,
        largest first, with their scores."""
        scores = torch.tensor(self.relevance[method])
        order = scores.abs().argsort(descending=True, stable=True)[:k]
        return [(self.shown()[i], float(scores[i])) for i in order.tolist()]

    def to_dict(self) -> dict:
        """JSON-safe: everything but the layer maps."""
        return {"text": self.text, "tokens": self.tokens, "display_tokens": self.shown(), "prediction": self.prediction,
                "probability": self.probability, "target": self.target,
                "target_probability": self.target_probability, "relevance": self.relevance,
                "top_tokens": {name: self.top_tokens(name) for name in self.relevance}, "settings": self.settings}


def readable_tokens(tokenizer, tokens) -> list[str]:
    """Each token as the text it stands for (byte-level BPE's ``Ġthe`` -> ``the``, SentencePiece's ``▁the`` ->
    ``the``); a token that reads as blank (a space, a newline) keeps its vocabulary spelling."""
    shown = []
    for token in tokens:
        try:
            text = tokenizer.convert_tokens_to_string([token]).strip()
        except (TypeError, ValueError, KeyError):
            text = ""
        shown.append(text or token)
    return shown


def is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def check_supported(model) -> None:
    """Raise :class:`UsageError` unless ``model`` is a causal LM or sequence classifier with a supported mixer."""
    name = type(model).__name__
    if not (is_classifier(model) or getattr(model, "get_output_embeddings", lambda: None)() is not None):
        raise UsageError(f"{name} is neither a *ForCausalLM nor a *ForSequenceClassification model; explain it with "
                         "the Python API and a forward_func instead.")
    if not any(type(module).__name__ in SUPPORTED_MIXERS for module in model.modules()):
        raise UsageError(f"model type {model.config.model_type!r} has no token mixer mamba-captum explains "
                         f"(supported: Mamba, Mamba-2, RWKV, RecurrentGemma and the hybrids; see the README).")


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load(model_dir, *, device: str = "cpu", dtype: str = "float32"):
    """A local HF checkpoint directory -> (model in eval mode, tokenizer), offline. Errors are :class:`UsageError`."""
    import transformers as tf

    path = Path(model_dir)
    if not path.is_dir():
        raise UsageError(f"model directory {str(path)!r} does not exist; pass a folder written by save_pretrained.")
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} holds no config.json: it is not a HF checkpoint directory.")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:  # malformed JSON, an unknown model_type
        raise UsageError(f"the config.json in {str(path)!r} cannot be read: {_first_line(error)}") from None
    try:
        auto = tf.AutoModelForSequenceClassification if any(
            a.endswith("ForSequenceClassification") for a in (config.architectures or [])) else tf.AutoModelForCausalLM
        model = auto.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    except ValueError as error:  # transformers' "Unrecognized configuration class ..."
        raise UsageError(f"model type {config.model_type!r} cannot be loaded as a causal LM or sequence "
                         f"classifier: {_first_line(error)}") from None
    except OSError as error:  # no weights file
        raise UsageError(f"the weights in {str(path)!r} cannot be loaded: {_first_line(error)}") from None
    check_supported(model)
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"no tokenizer could be loaded from {str(path)!r}: {_first_line(error)}") from None
    try:
        model = model.to(device)
    except (RuntimeError, AssertionError) as error:
        raise UsageError(f"device {device!r} is not available: {_first_line(error)}") from None
    return model.eval(), tokenizer


def label_words(model, labels=None) -> list[str] | None:
    """The candidate answers: ``labels`` if given, else a causal LM's ``config.label_words`` (the bundled demo model
    sets it), else a classifier's ``id2label``; None means the whole vocabulary."""
    if labels:
        if is_classifier(model) and len(labels) != model.config.num_labels:
            raise UsageError(f"{len(labels)} labels given for a classifier with {model.config.num_labels} classes; "
                             "give one name per class, in class order (or none: its id2label is used).")
        return list(labels)
    if is_classifier(model):
        return [model.config.id2label[i] for i in range(model.config.num_labels)]
    return list(getattr(model.config, "label_words", None) or []) or None


def _max_length(model, tokenizer) -> int | None:
    limits = [getattr(tokenizer, "model_max_length", None), getattr(model.config, "max_position_embeddings", None)]
    limits = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    return min(limits) if limits else None


def _candidates(model, tokenizer, words):
    """Index of each candidate in the model's output row (class index, or vocabulary id)."""
    if words is None:
        return None
    if is_classifier(model):
        return list(range(model.config.num_labels))
    if tokenizer is None:
        raise UsageError(f"the label words {words} need the model's tokenizer; pass tokenizer=.")
    ids = [_token_id(tokenizer, word, model.config.vocab_size) for word in words]
    if len(set(ids)) != len(ids):
        raise UsageError(f"the label words {words} map to repeated token ids {ids}; give distinct tokens.")
    return ids


def _token_id(tokenizer, word: str, vocab_size: int) -> int:
    token = tokenizer.convert_tokens_to_ids(word)
    if token is None or token == tokenizer.unk_token_id and word != tokenizer.unk_token:
        pieces = tokenizer.encode(word, add_special_tokens=False)
        if len(pieces) != 1:
            raise UsageError(f"target {word!r} is not one token of the vocabulary (it tokenizes to {len(pieces)} "
                             "tokens); pass a single token or its id.")
        token = pieces[0]
    if not 0 <= token < vocab_size:
        raise UsageError(f"target id {token} is outside the vocabulary (0..{vocab_size - 1}).")
    return int(token)


def resolve_target(model, tokenizer, target, words, candidates=None) -> int | None:
    """The output index to explain: None (the prediction), a label word / token string, or an integer id / class
    index (also as a digit string). A string that is exactly a label word is that label, even if it looks like a
    number. With label words, the target must be one of them."""
    if target is None:
        return None
    if isinstance(target, bool) or not isinstance(target, (str, int)):
        raise UsageError(f"target {target!r} must be a label word / token or an integer id, not a "
                         f"{type(target).__name__}.")
    names = words or []
    if candidates is None and words is not None:
        candidates = _candidates(model, tokenizer, words)
    if isinstance(target, str) and target in names:
        return candidates[names.index(target)]
    if isinstance(target, str) and not target.lstrip("-").isdigit():
        if is_classifier(model):
            raise UsageError(f"target {target!r} is not a label of this model; its labels are {names}.")
        if words is not None:
            raise UsageError(f"target {target!r} is not one of the model's label words {words}.")
        return _token_id(tokenizer, target, model.config.vocab_size)
    index = int(target)
    if is_classifier(model):
        if not 0 <= index < model.config.num_labels:
            raise UsageError(f"target class {index} is outside the model's {model.config.num_labels} labels "
                             f"({names}).")
        return index
    if not 0 <= index < model.config.vocab_size:
        raise UsageError(f"target id {index} is outside the vocabulary (0..{model.config.vocab_size - 1}).")
    if candidates is not None and index not in candidates:
        raise UsageError(f"target id {index} is not one of the model's label words {words} (ids {candidates}).")
    return index


def encode_text(model, tokenizer, text: str) -> torch.Tensor:
    """``text`` -> (1, L) ids, refusing an empty result or more tokens than the model allows (:class:`UsageError`)."""
    if not isinstance(text, str):
        raise UsageError(f"a text must be a string, not a {type(text).__name__}.")
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
    limit = _max_length(model, tokenizer)
    if limit is not None and input_ids.shape[1] > limit:
        raise UsageError(f"the text has {input_ids.shape[1]} tokens; the model allows at most {limit}: "
                         f"{text[:40]!r}...")
    if input_ids.shape[1] == 0:
        raise UsageError(f"the text {text[:40]!r} is empty after tokenization.")
    return input_ids


def _name(model, tokenizer, index, words, candidates) -> str:
    if candidates is not None and index in candidates:
        return words[candidates.index(index)]
    if is_classifier(model):
        return str(model.config.id2label.get(index, index))
    return tokenizer.convert_ids_to_tokens(int(index)) if tokenizer is not None else str(int(index))


def explain(model, tokenizer, texts, *, target=None, methods=tuple(METHODS), formulation: str = "unified",
            labels=None, layer_maps: bool = True) -> list[Explanation]:
    """Explain each text (one at a time, so no padding) with ``methods``.

    Args:
        model: a supported HF ``*ForCausalLM`` (explains the next token after the text) or
            ``*ForSequenceClassification`` model, in eval mode.
        tokenizer: its tokenizer.
        texts: a string or a list of strings.
        target: None (explain each prediction), a label word / token string, or an id / class index.
        methods: names among ``"raw"``, ``"rollout"``, ``"attribution"``.
        formulation: ``"unified"`` or ``"hidden"``.
        labels: candidate answers of a causal LM (e.g. ``["negative", "positive"]``); see :func:`label_words`.
        layer_maps: also return each layer's (L, L) channel-mean map.
    Returns:
        one :class:`Explanation` per text.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    device = next(model.parameters()).device
    inputs = [encode_text(model, tokenizer, text).to(device) for text in texts]
    return explain_ids(model, tokenizer, inputs, texts=texts, target=target, methods=methods,
                       formulation=formulation, labels=labels, layer_maps=layer_maps)


def explain_ids(model, tokenizer, inputs, *, texts=None, target=None, methods=tuple(METHODS),
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
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r}; choose among {', '.join(METHODS)}.")
    if formulation not in ("unified", "hidden"):
        raise UsageError(f"unknown formulation {formulation!r}; choose unified or hidden.")
    check_supported(model)
    words = label_words(model, labels)
    candidates = _candidates(model, tokenizer, words)
    wanted = resolve_target(model, tokenizer, target, words, candidates)
    device = next(model.parameters()).device
    results = []
    for number, input_ids in enumerate(inputs):
        input_ids = input_ids.to(device)
        attention_mask = torch.ones_like(input_ids)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
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
            options = {"target": explained} if name == "attribution" else {}
            row = METHODS[name](model).attribute(input_ids, attention_mask=attention_mask, formulation=formulation,
                                                 **options)
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
                      "labels": words}))
    return results
