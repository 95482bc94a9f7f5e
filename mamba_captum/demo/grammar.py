"""A small English sentiment grammar with negation and contrast, whose deciding words are known by construction.

A sentence is one clause (``the plot was not very good``) or two joined by ``but`` (``the music was dull but the
acting was great``), with optional openers and closers. A clause's polarity is its adjective's, flipped by ``not`` /
``never`` right before it (or before its intensifier); after ``but`` the second clause decides. The deciding words
(the deciding clause's adjective and its negator) are returned as a word mask, so explanations can be checked.
"""
from __future__ import annotations

import dataclasses
import random

SUBJECTS = ["the movie", "the film", "the plot", "the acting", "the music", "the ending", "the cast", "the story",
            "the dialogue", "the food", "the service", "the book", "the show", "the hotel"]
VERBS = ["was", "is", "seemed", "felt", "looked"]
INTENSIFIERS = ["very", "really", "quite", "so", "truly"]
NEGATORS = ["not", "never"]
POSITIVE = ["good", "great", "wonderful", "excellent", "brilliant", "lovely", "superb", "delightful", "charming",
            "enjoyable"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "dull", "poor", "weak", "horrible", "mediocre", "disappointing"]
OPENERS = ["honestly ,", "overall ,", "well ,", "i think", "to be fair ,", "in my view ,"]
CLOSERS = [", i think", "today", "to me", "at times", "in the end", "for sure"]
ENDINGS = [".", "!"]
LABELS = ("negative", "positive")  # label k is the word LABELS[k]


def words() -> list[str]:
    """Every word the grammar can produce (the demo tokenizer's vocabulary, before special tokens)."""
    seen = []
    groups = (SUBJECTS, VERBS, INTENSIFIERS, NEGATORS, POSITIVE, NEGATIVE, OPENERS, CLOSERS, ENDINGS, ["but"], LABELS)
    for group in groups:
        for phrase in group:
            for word in phrase.split():
                if word not in seen:
                    seen.append(word)
    return seen


@dataclasses.dataclass
class Sentence:
    """One generated sentence: its words, label (1 = positive) and which words decide the label."""
    words: list[str]
    label: int
    deciding: list[bool]

    @property
    def text(self) -> str:
        return " ".join(self.words)


def _clause(rng: random.Random) -> tuple[list[str], int, list[bool]]:
    positive = rng.random() < 0.5
    adjective = rng.choice(POSITIVE if positive else NEGATIVE)
    negated = rng.random() < 0.4
    subject = SUBJECTS[rng.randrange(len(SUBJECTS))].split()
    # negation only after "was" / "is" ("the plot was not good"; "felt never good" is not English)
    body = subject + [rng.choice(VERBS[:2] if negated else VERBS)]
    deciding = [False] * len(body)
    if negated:
        body.append(rng.choice(NEGATORS))
        deciding.append(True)
    if rng.random() < 0.4:
        body.append(rng.choice(INTENSIFIERS))
        deciding.append(False)
    body.append(adjective)
    deciding.append(True)
    return body, int(positive != negated), deciding


def sentence(rng: random.Random) -> Sentence:
    """One random sentence of the grammar."""
    words_, deciding = [], []
    if rng.random() < 0.3:
        opener = rng.choice(OPENERS).split()
        words_ += opener
        deciding += [False] * len(opener)
    first, label, first_deciding = _clause(rng)
    words_ += first
    if rng.random() < 0.35:  # contrast: the clause after "but" decides
        second, label, second_deciding = _clause(rng)
        words_ += ["but"] + second
        deciding += [False] * (len(first) + 1) + second_deciding
    else:
        deciding += first_deciding
    if rng.random() < 0.3:
        closer = rng.choice(CLOSERS).split()
        words_ += closer
        deciding += [False] * len(closer)
    if rng.random() < 0.5:
        words_.append(rng.choice(ENDINGS))
        deciding.append(False)
    return Sentence(words_, label, deciding)


def sentences(count: int, seed: int) -> list[Sentence]:
    """``count`` sentences from ``seed`` (the same list on every machine)."""
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(count)]


def deciding_words(text: str) -> list[bool]:
    """The word mask of a sentence of this grammar by its rules: the adjective of the last clause (after ``but`` if
    there is one) and the negator right before it or before its intensifier. Raises ValueError for a text with no
    adjective of the grammar."""
    words_ = text.split()
    adjectives = [i for i, word in enumerate(words_) if word in POSITIVE or word in NEGATIVE]
    if not adjectives:
        raise ValueError(f"mamba_captum: {text!r} has no adjective of the demo grammar; it cannot say which words "
                         "decide it.")
    mask = [False] * len(words_)
    adjective = adjectives[-1]
    mask[adjective] = True
    before = adjective - 1
    if before >= 0 and words_[before] in INTENSIFIERS:
        before -= 1
    if before >= 0 and words_[before] in NEGATORS:
        mask[before] = True
    return mask
