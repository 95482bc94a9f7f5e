"""MambaRawAttention: the layer-averaged implicit-attention row of the query (class-agnostic).

product:  R[b, :] = mean_{ℓ ≥ s} A^ℓ[b, q_b, :],  A^ℓ = reduce_c H^ℓ_c   (signed; padding columns 0).
official: per layer, min-max of the per-channel query rows over (channels × real tokens), channel mean; mean over
          layers; query entry set to 0; negatives clamped to 0 (Ali et al.'s Raw-Attention notebook).
"""
from __future__ import annotations

import torch

from ._base import ImplicitAttentionMethod
from ._rollout import drop_query, minmax, refuse_pooled, unique_positions


class MambaRawAttention(ImplicitAttentionMethod):
    """Raw implicit attention: the query token's row of the channel-reduced maps, averaged over layers.

    ``MambaRawAttention(model).attribute(input_ids)`` -> (B, L). See :meth:`attribute` for the keywords and
    ``docs/methods/raw_attention.md`` for the formulas.
    """

    def _relevance(self, explained, options):
        if explained.staged:
            return self._staged(explained, options)
        official = options["recipe"] == "official"
        if official:
            refuse_pooled(explained.queries)
        rows = unique_positions(explained.queries, explained.length)
        sums, count = [0.0] * len(explained.queries), 0
        for record in explained.layers():
            reduced = record.operator.maps(None if official else options["reduce"], rows)  # (B, [C,] R, L)
            by_position = {position: reduced[..., index, :] for index, position in enumerate(rows)}
            for number, query in enumerate(explained.queries):
                row = query.gather(by_position)  # (B, [C,] L)
                if official:  # min-max over channels × the query's real context, then the channel mean
                    context = query.context(explained.mask).to(row.dtype)[:, None, :]
                    row = minmax(row, context, dims=(-2, -1)).mean(1)
                sums[number] = sums[number] + row
            count += 1
        out = []
        for query, total in zip(explained.queries, sums):
            relevance = total / count if count else torch.zeros(explained.batch, explained.length)
            out.append(drop_query(relevance, query.positions) if official else relevance)
        return out

    @staticmethod
    def _staged(explained, options):
        """A multi-stage model: each layer's map read by the head's pooled query as it falls on that layer's stage
        (the last stage's mean, spread over the downsample windows: ``layout.carry``), then carried to the first
        stage's tokens and averaged over the layers."""
        if options["recipe"] == "official":
            refuse_pooled(explained.queries)
        layout = explained.layout
        sums, count = [0.0] * len(explained.queries), 0
        for record in explained.layers():
            reduced = record.operator.maps(options["reduce"])  # (B, L_s, L_s)
            stage = layout.stage_of_length(reduced.shape[-1])
            for number, query in enumerate(explained.queries):
                footprint = layout.carry(query.weights.to(reduced.dtype), stage)  # (B, L_s): the query on stage s
                row = torch.einsum("bq,bqj->bj", footprint, reduced)
                sums[number] = sums[number] + layout.carry(row, 0)
            count += 1
        return [total / count if count else torch.zeros(explained.batch, explained.length) for total in sums]
