"""The copy task of LaTIM (Pitorro & Treviso, ACL 2025) with its ground-truth alignment, and its scores.

A sequence is ``[BOS] x_0 … x_{n-1} [SEP] x_0 … x_{n-1}``: n random symbols, a separator, the same symbols again.
A causal LM that has learned the task predicts ``x_k`` at the query position ``n + 1 + k`` (the separator for
k = 0, else the copied ``x_{k-1}``), and the token it copies sits at the source position ``1 + k``: that is the
ground-truth alignment. An explanation of the prediction at a query position is scored against it over the source
span only (the n positions ``1 … n``; the separator, BOS and the copy half are left out, as a translation alignment
is read off the target × source block):

- AUC: the ROC AUC of the explanation's scores with the aligned source token as the one positive (the share of
  the other source tokens scored below it, ties counted half);
- AP: the average precision, here ``1 / rank`` of the aligned token;
- R@K: the recall among the K best-scored source tokens with K the number of aligned tokens (K = 1 here: whether
  the aligned token is scored highest, ties broken against it).

Each score is the mean over every query of every example. The paper's code could not be read here (the repository
was not reachable); the per-query averaging and K = the number of gold tokens are our reading of its protocol.

Shapes: E examples, n copied symbols, L = 2 n + 2 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAD, SEP, BOS = 0, 1, 2
FIRST_SYMBOL = 3


@dataclass
class CopyExamples:
    """E copy sequences of n symbols: ids (E, L), the query positions (n,), and their aligned source positions
    (n,); the target of query k is ``ids[:, sources[k]]``."""

    input_ids: torch.Tensor  # (E, L), L = 2 n + 2
    queries: torch.Tensor  # (n,) the positions whose next-token prediction is explained
    sources: torch.Tensor  # (n,) the aligned (copied) source position of each query

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def copied(self) -> int:
        return self.queries.shape[0]

    def targets(self, query: int) -> torch.Tensor:
        """(E,) the token each example must predict at query number ``query``."""
        return self.input_ids[:, int(self.sources[query])]

    @property
    def source_span(self) -> torch.Tensor:
        """(n,) the candidate positions an explanation is scored over: the first copy of the symbols."""
        return torch.arange(1, self.copied + 1)


def vocab_size(symbols: int) -> int:
    """The model's vocabulary for ``symbols`` symbols: pad, separator, BOS, then the symbols."""
    return FIRST_SYMBOL + symbols


def copy_examples(count: int, copied: int, symbols: int, generator: torch.Generator) -> CopyExamples:
    """``count`` copy sequences of ``copied`` symbols drawn uniformly from ``symbols`` (seeded by ``generator``)."""
    if copied < 2 or symbols < 2:
        raise ValueError("mamba_captum: the copy task needs at least 2 copied tokens and 2 symbols.")
    body = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + symbols, (count, copied), generator=generator)
    bos = torch.full((count, 1), BOS, dtype=torch.long)
    sep = torch.full((count, 1), SEP, dtype=torch.long)
    ids = torch.cat([bos, body, sep, body], dim=1)
    queries = torch.arange(copied + 1, 2 * copied + 1)
    return CopyExamples(ids, queries, torch.arange(1, copied + 1))


def copy_loss_mask(examples: CopyExamples) -> torch.Tensor:
    """(E, L) 1 at the positions whose next token is a copied symbol (the queries): the positions trained on."""
    mask = torch.zeros(examples.input_ids.shape, dtype=torch.bool)
    mask[:, examples.queries] = True
    return mask


def alignment_scores(scores: torch.Tensor, aligned: torch.Tensor) -> dict:
    """AUC, AP and R@K of explanation rows against one aligned candidate each.

    Args:
        scores: (Q, n) each query's scores over the n candidate (source) positions; higher = more relevant.
        aligned: (Q,) long, the index among the n candidates of each query's aligned token.
    Returns:
        ``{"auc", "ap", "r_at_k"}``: floats, the means over the Q queries (K = 1: one aligned token per query).
    """
    scores = scores.detach().to(torch.float64)
    if scores.dim() != 2 or aligned.shape != scores.shape[:1]:
        raise ValueError(f"mamba_captum: scores (Q, n) and aligned (Q,); got {tuple(scores.shape)} and "
                         f"{tuple(aligned.shape)}.")
    if not torch.isfinite(scores).all():
        raise ValueError("mamba_captum: the explanation scores hold NaN or inf.")
    gold = scores.gather(1, aligned[:, None].to(scores.device))  # (Q, 1)
    others = scores.shape[1] - 1
    below = (scores < gold).sum(1).to(torch.float64)
    ties = (scores == gold).sum(1).to(torch.float64) - 1  # the gold entry itself is not a tie
    auc = (below + 0.5 * ties) / others
    rank = (scores > gold).sum(1).to(torch.float64) + ties + 1  # ties ranked ahead of the gold token (pessimistic)
    return {"auc": auc.mean().item(), "ap": (1.0 / rank).mean().item(), "r_at_k": (rank == 1).double().mean().item()}
