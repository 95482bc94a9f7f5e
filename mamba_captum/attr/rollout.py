"""MambaRollout: attention rollout of the implicit-attention maps (class-agnostic).

product:  Ã^ℓ = rownorm(I + (A^ℓ)₊),  ρ = Ã^Λ ⋯ Ã^s,  R[b, :] = ρ[b, q_b, :]   (full L×L matrices).
official: the official notebooks' rank-1 rollout: v^ℓ = channel-mean query row (signed), M^ℓ = rownorm(1·v^ℓᵀ + I),
          R = (M^Λ ⋯ M^s)[q, :], query entry set to 0, negatives clamped to 0.
"""
from __future__ import annotations

from ._base import ImplicitAttentionMethod
from ._rollout import (RunningProduct, add_identity, broadcast_row, drop_query, refuse_pooled, row_normalise,
                       rollout_step, unique_positions)


class MambaRollout(ImplicitAttentionMethod):
    """Attention rollout over the layers' implicit attention (Abnar & Zuidema; Ali et al. Eq. 20-21).

    ``MambaRollout(model).attribute(input_ids)`` -> (B, L). See :meth:`attribute` for the keywords and
    ``docs/methods/rollout.md`` for the formulas.
    """

    def _relevance(self, explained, options):
        if options["recipe"] == "official":
            return self._official(explained, options)
        product = RunningProduct(explained.layout)
        for record in explained.layers():
            product.push(rollout_step(record.operator.maps(options["reduce"])))
        return [q.row_of(product, explained.length) for q in explained.queries]

    @staticmethod
    def _official(explained, options):
        refuse_pooled(explained.queries)
        rows = unique_positions(explained.queries)
        products = [RunningProduct(explained.layout) for _ in explained.queries]
        for record in explained.layers():
            reduced = record.operator.maps("mean", rows)  # (B, R, L): the channel-mean query rows, signed
            by_position = {position: reduced[:, index] for index, position in enumerate(rows)}
            for query, product in zip(explained.queries, products):
                vector = query.gather(by_position)
                product.push(row_normalise(add_identity(broadcast_row(vector))))
        return [drop_query(product.rows(q.positions, explained.length), q.positions)
                for q, product in zip(explained.queries, products)]
