"""Texts, tokens and targets: a text -> its token ids (within the model's limits), tokens as people read them, the
candidate answers (label words, class names or the whole vocabulary) and the output index a target names."""
from __future__ import annotations

import re

import torch

from ..tokens import unknown_id, unknown_spelling, warn_unknown_words
from .loading import UsageError, is_classifier


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


def label_words(model, labels=None) -> list[str] | None:
    """The candidate answers: ``labels`` if given, else a causal LM's ``config.label_words`` (the bundled demo model
    sets it), else a classifier's ``id2label``; None means the whole vocabulary."""
    if isinstance(labels, str):  # labels="positive" would be read letter by letter
        labels = [labels]
    if labels:
        labels = list(labels)
        if not all(isinstance(word, str) for word in labels):
            raise UsageError(f"the labels {labels} must all be strings (label words / tokens).")
        repeated = sorted({word for word in labels if labels.count(word) > 1})
        if repeated:  # a repeated label would be both a candidate and its own rival
            raise UsageError(f"the labels {labels} repeat {', '.join(map(repr, repeated))}; give each label once.")
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


def candidate_ids(model, tokenizer, words):
    """Index of each candidate in the model's output row (class index, or vocabulary id)."""
    if words is None:
        return None
    if is_classifier(model):
        return list(range(model.config.num_labels))
    if tokenizer is None:
        raise UsageError(f"the label words {words} need the model's tokenizer; pass tokenizer=.")
    ids = [_token_id(tokenizer, word, _vocab_size(model), what="label word") for word in words]
    if len(set(ids)) != len(ids):
        raise UsageError(f"the label words {words} map to repeated token ids {ids}; give distinct tokens.")
    return ids


def _vocab_size(model) -> int:
    """The model's vocabulary size; a vision-language model keeps it in its text config."""
    config = model.config
    return config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size


def _token_id(tokenizer, word: str, vocab_size: int, what: str = "target") -> int:
    """The id of the single vocabulary token ``word`` (its spelling, or the one token it tokenizes to)."""
    # the vocabulary itself, not convert_tokens_to_ids: for a token it lacks, that returns the wrapper's
    # unk_token_id, which may be another token than the one the tokenizer really produces (tokens.unknown_id)
    token = tokenizer.get_vocab().get(word)
    unknown = unknown_id(tokenizer)
    if token is None or token == unknown and word != unknown_spelling(tokenizer):
        pieces = tokenizer.encode(word, add_special_tokens=False)
        if len(pieces) != 1:
            raise UsageError(f"{what} {word!r} is not one token of the vocabulary (it tokenizes to {len(pieces)} "
                             "tokens); pass a single token or its id.")
        if pieces[0] == unknown:  # a word-level / SentencePiece vocabulary's stand-in for anything
            raise UsageError(f"{what} {word!r} is not in the tokenizer's vocabulary (it reads as the unknown token "
                             f"{unknown_spelling(tokenizer)!r}); pass a token of the vocabulary or its id.")
        token = pieces[0]
    if not 0 <= token < vocab_size:
        raise UsageError(f"{what} id {token} is outside the vocabulary (0..{vocab_size - 1}).")
    return int(token)


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: str.isdigit() also passes "²", which int() refuses


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
        candidates = candidate_ids(model, tokenizer, words)
    if isinstance(target, str) and target in names:
        return candidates[names.index(target)]
    if isinstance(target, str) and not _INTEGER.fullmatch(target):
        if is_classifier(model):
            raise UsageError(f"target {target!r} is not a label of this model; its labels are {names}.")
        if words is not None:
            raise UsageError(f"target {target!r} is not one of the model's label words {words}.")
        return _token_id(tokenizer, target, _vocab_size(model))
    index = int(target)
    if is_classifier(model):
        if not 0 <= index < model.config.num_labels:
            raise UsageError(f"target class {index} is outside the model's {model.config.num_labels} labels "
                             f"({names}).")
        return index
    if not 0 <= index < _vocab_size(model):
        raise UsageError(f"target id {index} is outside the vocabulary (0..{_vocab_size(model) - 1}).")
    if candidates is not None and index not in candidates:
        raise UsageError(f"target id {index} is not one of the model's label words {words} (ids {candidates}).")
    return index


def encode_text(model, tokenizer, text: str) -> torch.Tensor:
    """``text`` -> (1, L) ids, refusing an empty result or more tokens than the model allows (:class:`UsageError`).

    Words of ``text`` that the tokenizer does not know (they became its unknown token) are named in a
    :class:`~mamba_captum.tokens.UnknownTokenWarning`: the explanation can only score the stand-in."""
    if not isinstance(text, str):
        raise UsageError(f"a text must be a string, not a {type(text).__name__}.")
    if not text.strip():  # it would "explain" the special tokens the tokenizer adds, and nothing else
        raise UsageError(f"the text {text!r} is empty or only whitespace; give a text to explain.")
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
    limit = _max_length(model, tokenizer)
    if limit is not None and input_ids.shape[1] > limit:
        raise UsageError(f"the text has {input_ids.shape[1]} tokens; the model allows at most {limit}: "
                         f"{text[:40]!r}...")
    if input_ids.shape[1] == 0:
        raise UsageError(f"the text {text[:40]!r} is empty after tokenization.")
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):  # no embedding table to read: the config's size
        rows = _vocab_size(model)
    if int(input_ids.max()) >= rows:  # the embedding lookup would fail with an index error deep in the model
        top = int(input_ids.max())
        raise UsageError(f"the text has token id {top} ({tokenizer.convert_ids_to_tokens(top)!r}), outside the "
                         f"model's {rows}-token vocabulary: the tokenizer does not belong to this model.")
    warn_unknown_words(tokenizer, text, stacklevel=2)  # after the refusals: a refused text needs no warning
    return input_ids
