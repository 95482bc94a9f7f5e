"""MambaSelectionAttribution: Mamba-Attribution that also credits each token for what it does through the
selection path (its Δ, B, C, gates, activation and the attention's queries and keys), not only through its value.

Per layer ℓ and explained target T, from the one backward pass the gradient methods already take:

    G[i, j] = Σ_c g_c[i] · H_c[i, j] · x_c[j]        the value path (MambaAttribution's gradient × operator rule),
    e[j]    = Σ_d ∂T/∂u[j, d] · u[j, d]              gradient × input at the layer's inputs u (the mixer input; an
                                                      attention layer's queries and keys, its values being G's),
    s[j]    = e[j] − Σ_i G[i, j]                      what token j does besides being read: the selection share.

The value path is linear in x with the operator fixed, so Σ_i G[i, j] is exactly the value share of e[j] (biases
aside); s[j] is every other first-order effect of token j's input: the decays and the write / read strengths its
own Δ, B, C set, its gate, its activation, its query and key. These effects are token-local inputs, so they belong to
token j, but the row they act on is not known without one backward pass per row. ``spread`` says where they go:
``"query"`` adds s to the query's row (exact at the last layer, where only the query's row reaches the target),
``"column"`` spreads s[j] over the rows in proportion to |G[:, j]| (the rows token j's value reaches). Then
Ã^ℓ = rownorm(I + W(G + S)) and R = (Ã^Λ ⋯ Ã^s)[q, :] as for MambaAttribution (same sign= and normalise=).
Cost: MambaAttribution's, plus the gradients at the layer inputs in the same backward pass.
"""
from __future__ import annotations

import torch
from captum.log import log_usage

from ._inputs import as_attributions, format_inputs
from ._rollout import RunningProduct, layer_weights, rollout_step
from .attribution import MambaAttribution

SPREADS = ("query", "column", "exact")


def selection_share(contributions: torch.Tensor, effects: torch.Tensor, mask: torch.Tensor,
                    include_values: bool = True) -> torch.Tensor:
    """s[j] = e[j] − Σ_i G[i, j]: (B, L, L) value-path contributions G, (B, L) input effects e -> (B, L).
    ``include_values=False`` (e at an attention layer's queries and keys, which do not feed its values): s = e."""
    effects = effects.to(contributions.dtype)
    if include_values:
        effects = effects - contributions.sum(1)
    return effects * mask.to(contributions.dtype)


def exact_share(contributions: torch.Tensor, row_effects: torch.Tensor, mask: torch.Tensor,
                include_values: bool = True) -> torch.Tensor:
    """G + S with the selection share on the rows it acts through: (B, L, L) G and the per-row effects J of the
    layer's inputs (J[i, j]: token j's gradient × input through output row i) -> (B, L, L). A mixer's input feeds
    the value path too, so there J already holds G (the first-order effect of x through the fixed operator) and
    G + S = J; an attention layer's queries and keys do not, so G + S = G + J."""
    row_effects = row_effects.to(contributions.dtype) * mask.to(contributions.dtype)[:, None, :]
    return row_effects if include_values else contributions + row_effects


def spread_share(contributions: torch.Tensor, share: torch.Tensor, query, spread: str) -> torch.Tensor:
    """G + S: the selection share (B, L) placed on rows, ``"query"`` (the query's row, or a pooled query's rows by
    its weights) or ``"column"`` (column j over the rows by |G[:, j]|; on the diagonal where G[:, j] is 0)."""
    if spread == "query":
        if query.pooled:
            rows = query.weights.to(contributions.dtype)
        else:
            rows = torch.zeros(contributions.shape[:2], dtype=contributions.dtype, device=contributions.device)
            rows[torch.arange(rows.shape[0], device=rows.device), query.positions.to(rows.device)] = 1
        return contributions + rows[:, :, None] * share[:, None, :]
    weight = contributions.abs()
    total = weight.sum(1, keepdim=True)
    eye = torch.eye(weight.shape[-1], dtype=weight.dtype, device=weight.device).expand_as(weight)
    weight = torch.where(total > 0, weight / torch.where(total > 0, total, torch.ones_like(total)), eye)
    return contributions + weight * share[:, None, :]


class MambaSelectionAttribution(MambaAttribution):
    """Selection-aware Mamba-Attribution: the value path's gradient × operator plus each token's selection share.

    ``MambaSelectionAttribution(model).attribute(input_ids, target=c)`` -> (B, L). See the module docstring and
    ``docs/methods/selection.md``.
    """

    def _wants_residual(self, options):
        return False

    def _wants_operator_grads(self, options):
        return True

    def _wants_input_effects(self, options):
        return "rows" if options["spread"] == "exact" else True

    def _options(self, recipe, start_layer, reduce, spread="query", sign="absolute", normalise="row_max", **extra):
        if spread not in SPREADS:
            raise ValueError(f"mamba_captum: spread={spread!r}; choose one of {SPREADS}.")
        if recipe != "product":
            raise ValueError("mamba_captum: MambaSelectionAttribution has no official recipe (the papers' methods "
                             "read the operator only); use MambaAttribution(recipe='official').")
        return super()._options(recipe, start_layer, reduce, gradient_rule="grad_x_operator", sign=sign,
                                normalise=normalise, spread=spread, **extra)

    @log_usage()
    def attribute(self, inputs, target=None, additional_forward_args=None, *, attention_mask=None, position=None,
                  formulation="unified", start_layer=None, reduce="mean", components=None, spread="query",
                  sign="absolute", normalise="row_max", **forward_kwargs):
        """As :meth:`MambaAttribution.attribute` (gradient × operator rule), plus:

        Args:
            spread: ``"query"`` (default) or ``"column"``: the rows each token's selection share is placed on.

        Returns (B, L) as the inputs."""
        inputs_tensor, was_tuple = format_inputs(inputs, self._runner.layout is not None)
        _, relevance = self._relevance_per_query(inputs_tensor, target, additional_forward_args, attention_mask,
                                                 position, formulation, start_layer, reduce, components, "product",
                                                 forward_kwargs, spread=spread, sign=sign, normalise=normalise)
        return as_attributions(relevance[0], inputs_tensor, was_tuple, self._runner.layout)

    def _relevance(self, explained, options):
        if options["spread"] == "exact" and (explained.staged or self._runner.packed):
            raise ValueError("mamba_captum: spread='exact' takes one backward per token row of each layer, over a "
                             "sequence of tokens; a multi-stage image model or a packed vision tower has no such "
                             "rows: use spread='query'.")
        products = [RunningProduct(explained.layout) for _ in explained.queries]
        for record in explained.layers():
            if record.input_effects is None:
                raise RuntimeError(f"mamba_captum: layer {record.key} gave no gradient at its inputs (the layer "
                                   "input is not part of the graph of the explained scores); please report this.")
            for number, (query, product) in enumerate(zip(explained.queries, products)):
                contributions = record.operator.contributions(record.operator_grads[number])
                mask = explained.mask_for(contributions.shape[-1])
                if options["spread"] == "exact":
                    factor = exact_share(contributions, record.row_effects[number], mask,
                                         record.effects_include_values)
                else:
                    share = selection_share(contributions, record.input_effects[number], mask,
                                            record.effects_include_values)
                    factor = spread_share(contributions, share, query, options["spread"])
                factor = factor / record.operator.value_channels
                product.push(rollout_step(layer_weights(factor, options["sign"], options["normalise"])))
        return [q.row_of(product, explained.length) for q, product in zip(explained.queries, products)]
