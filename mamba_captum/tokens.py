"""Words a tokenizer does not know: the ones of a text (or the positions of ids) that became its unknown token.

A word-level, WordPiece or SentencePiece vocabulary turns any word it lacks into one unknown token (``[UNK]``,
``<unk>``); the model then sees, and an explanation scores, that stand-in rather than the word. A byte-level BPE
tokenizer (GPT-2's) spells every text with its bytes and has no unknown token: it gives nothing here.

- :func:`unknown_id`: the id of the unknown token a tokenizer can produce, or None.
- :func:`unknown_words`: the words of a text that became it (their original spelling, from a fast tokenizer's
  offsets; None for each one a tokenizer without offsets cannot place).
- :func:`unknown_positions`: the positions of the unknown token in a row of ids.
- :func:`warn_unknown_words` / :func:`warn_unknown_ids`: an :class:`UnknownTokenWarning` naming them.

Tokenizers are duck-typed (Hugging Face's); nothing here imports torch or transformers.
"""
from __future__ import annotations

import json
import warnings

_SHOWN = 10  # the words a message names; the rest are counted


class UnknownTokenWarning(UserWarning):
    """Words of a text are not in the tokenizer's vocabulary and became its unknown token."""


def unknown_id(tokenizer) -> int | None:
    """The id of the unknown token ``tokenizer`` gives words it lacks, or None when it gives none: no unknown
    token, a fast tokenizer whose model has none (byte-level BPE), or an unknown token that is also the
    beginning / end of text (GPT-2's ``<|endoftext|>``), which ids cannot tell apart.

    A fast tokenizer's own model says which token it produces (its ``unk_token``, a Unigram model's ``unk_id``);
    that wins over the wrapper's ``unk_token_id``, which may name another token or none."""
    token_id = getattr(tokenizer, "unk_token_id", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is not None and hasattr(model, "unk_token"):  # WordLevel, WordPiece, BPE
        if not model.unk_token:
            return None  # BPE without unk_token: every text is spelled with the vocabulary (byte-level)
        token_id = backend.token_to_id(model.unk_token)
    elif model is not None and type(model).__name__ == "Unigram":  # it keeps its unknown id in its serialisation
        try:
            token_id = json.loads(backend.to_str())["model"].get("unk_id")
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    if token_id is None:
        return None
    if token_id in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        return None
    return int(token_id)


def unknown_spelling(tokenizer) -> str | None:
    """How the vocabulary spells the unknown token :func:`unknown_id` gives (``[UNK]``, ``<unk>``), or None."""
    token_id = unknown_id(tokenizer)
    if token_id is None:
        return None
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    return convert(token_id) if convert is not None else getattr(tokenizer, "unk_token", None)


def _id_list(ids) -> list[int]:
    """A row of ids (a list, or a (L,) / (1, L) tensor) as ints."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise ValueError(f"mamba_captum: one row of ids expected, got {len(ids)}.")
        ids = ids[0]
    return [int(i) for i in ids]


def unknown_positions(tokenizer, ids) -> list[int]:
    """Positions of ``ids`` (L,) or (1, L) that are the tokenizer's unknown token (none if it has none)."""
    token_id = unknown_id(tokenizer)
    return [] if token_id is None else [i for i, t in enumerate(_id_list(ids)) if t == token_id]


def unknown_words(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[str | None]:
    """The words of ``text`` that ``tokenizer`` turned into its unknown token (in whole or in part), in order, one
    entry per word.

    A fast tokenizer's word ids and offsets give each word's spelling in ``text``: a word whose pieces include the
    unknown token is named whole, once ("pizzaq" for a Unigram vocabulary that only lacks its "q"); the unknown
    token written out in the text itself is not counted. A tokenizer without offsets gives None for each unknown
    id. ``add_special_tokens`` as for the tokenization being checked (it only adds special tokens, never unknown
    ones)."""
    token_id = unknown_id(tokenizer)
    if token_id is None or not text:
        return []
    try:
        encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a Python ("slow") tokenizer has no offsets
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return [None] * _id_list(ids).count(token_id)
    ids = _id_list(encoded["input_ids"])
    try:
        word_ids = encoded.word_ids()
    except (AttributeError, ValueError, TypeError):
        word_ids = [None] * len(ids)
    keys = [position if word is None else ("word", word) for position, word in enumerate(word_ids)]
    spans = {}  # word -> (start, end) over all of its pieces
    for key, (start, end) in zip(keys, offsets):
        first, last = spans.get(key, (start, end))
        spans[key] = (min(first, start), max(last, end))
    spelling = unknown_spelling(tokenizer)
    words, named = [], set()
    for position, token in enumerate(ids):
        if token != token_id:
            continue
        key = keys[position]
        if key in named:
            continue  # one entry per word, however many of its pieces are unknown
        named.add(key)
        start, end = spans[key]
        if text[offsets[position][0]:offsets[position][1]] != spelling:
            words.append(text[start:end].strip())  # a SentencePiece word's span starts at its space
    return words


def word_listing(words: list[str], shown: int | None = _SHOWN) -> str:
    """'a', 'b' ×2, ... and 3 more: each word once, in order, with its count; ``shown``: how many are named (None:
    all)."""
    counts = {}
    for word in words:
        counts[word] = counts.get(word, 0) + 1
    shown = len(counts) if shown is None else shown
    named = [repr(w) + (f" ×{n}" if n > 1 else "") for w, n in list(counts.items())[:shown]]
    more = len(counts) - shown
    return ", ".join(named) + (f" and {more} more" if more > 0 else "")


def _excerpt(text: str, size: int = 60) -> str:
    return repr(text if len(text) <= size else text[:size] + "...")


def unknown_words_message(tokenizer, text: str, words: list[str | None]) -> str:
    """The warning for the ``words`` of ``text`` that became the unknown token (:func:`unknown_words`)."""
    count = len(words)
    what = "word is" if count == 1 else "words are"
    named = [w for w in words if w is not None]
    listed = f": {word_listing(named)}" if named else " (this tokenizer gives no offsets to name them)"
    return (f"mamba_captum: in the text {_excerpt(text)}, {count} {what} not in the tokenizer's vocabulary and "
            f"became its unknown token {unknown_spelling(tokenizer)!r}{listed}; the explanation treats "
            f"{'it as one unknown word' if count == 1 else 'them as one unknown word each'} (use words of the "
            "vocabulary, or a tokenizer that covers them).")


def warn_unknown_words(tokenizer, text: str, *, add_special_tokens: bool = True, stacklevel: int = 1) -> list:
    """Warn (:class:`UnknownTokenWarning`) if words of ``text`` became the unknown token; returns them
    (:func:`unknown_words`). ``stacklevel`` as for :func:`warnings.warn`, counted from the caller."""
    words = unknown_words(tokenizer, text, add_special_tokens=add_special_tokens)
    if words:
        warnings.warn(unknown_words_message(tokenizer, text, words), UnknownTokenWarning, stacklevel=stacklevel + 1)
    return words


def warn_unknown_ids(tokenizer, ids, what: str = "the prompt", *, stacklevel: int = 1) -> list[int]:
    """Warn (:class:`UnknownTokenWarning`) if ``ids`` (L,) or (1, L), whose text is not at hand, hold the unknown
    token; returns its positions (:func:`unknown_positions`). ``what`` names the ids in the message."""
    positions = unknown_positions(tokenizer, ids)
    if positions:
        count = len(positions)
        shown = ", ".join(map(str, positions[:_SHOWN])) + (f" and {count - _SHOWN} more" if count > _SHOWN else "")
        warnings.warn(f"mamba_captum: {what} has {count} unknown token{'s' if count > 1 else ''} "
                      f"{unknown_spelling(tokenizer)!r} (position{'s' if count > 1 else ''} {shown} of "
                      f"{len(_id_list(ids))}): words not in the tokenizer's vocabulary became "
                      f"{'it' if count == 1 else 'them'}, and the explanation treats each as one unknown word (use "
                      "words of the vocabulary, or a tokenizer that covers them).",
                      UnknownTokenWarning, stacklevel=stacklevel + 1)
    return positions
