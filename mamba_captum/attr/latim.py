"""MambaLaTIM: token-to-token contributions of each layer, scored as LaTIM does (Pitorro & Treviso, ACL 2025).

Per decoder layer ℓ with input h (the residual stream) and output y (B, L, D), the token mixer's output is
``m_i = Σ_j T_{i←j} + b_i``, with ``T_{i←j} = R (H_c[i, j] x_c[j])_c`` (D,): the operator's per-channel matrix H,
its values x and the Jacobian R of its affine readout into the residual stream (out_proj and whatever the mixer
does after the operator); ``b_i`` (no token's: the D skip, the biases, the conv biases' share) and the rest of the
layer (its residual h_i, a token-local MLP) go to the token itself:

    T̃_{i←j} = T_{i←j} + δ_ij (y_i − Σ_k T_{i←k}),      Σ_j T̃_{i←j} = y_i  (exactly).

Scores of a layer (B, L, L), each row normalised to sum 1 (a row with no weight: its own token), rolled out over
the layers (ρ = Ã^Λ ⋯ Ã^s):
    alti:   Ã[i, j] ∝ max(0, ‖y_i‖₁ − ‖y_i − T̃_{i←j}‖₁)       (Ferrando et al.'s ALTI, Manhattan proximity)
    l2:     Ã[i, j] ∝ ‖T̃_{i←j}‖₂
    alti_logit (class-specific): the target's logit split over the input tokens,
            R[j] = ⟨h^s_q, w⟩ δ_qj + Σ_ℓ Σ_k ⟨T̃^ℓ_{q←k} − δ_qk h^ℓ_q, w⟩ ρ^{ℓ−1}[k, j],
            w = the final norm (its scale frozen at the query) composed with the target's unembedding row, ρ the
            ALTI rollout of the earlier layers; Σ_j R[j] = the logit minus the norm's and the head's biases.
The identity Σ_j T_{i←j} + b_i = the mixer's real output is checked at run time on every real row.
"""
from __future__ import annotations

import torch
from captum.log import log_usage

from ..operators import operator_output_grad
from ..verification import ReconstructionError, bias_operator
from ._base import ImplicitAttentionMethod
from ._inputs import as_attributions, format_inputs
from ._rollout import RunningProduct

VARIANTS = ("alti", "alti_logit", "l2")
# the decomposition must reproduce the mixer's real (float32) output to float precision: relative to the largest
# entry of the layer's output, as the engine's own map checks do
IDENTITY_RTOL = 1e-4


def contribution_vectors(operator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token j's contribution vector to token i's mixer output, for an operator whose readout is affine.

    Returns ``(T, b)``: T (B, L, L, D) float64 with ``T[:, i, j] = R (H_c[i, j] x_c[j])_c`` (R the readout's
    Jacobian; zero where j is padding or cannot reach i), and b (B, L, D), what comes from no token: ``readout(0)``
    (the D skip, biases) plus R applied to the conv biases' share of the output (the engine's ``bias_operator``),
    so that ``Σ_j T[:, i, j] + b[:, i] = readout(output)[:, i]``. One ``contributions`` call per output feature d
    (twice with a conv bias): the gradient of feature d of the readout is R's row d, whatever the channels are.

    Raises:
        TypeError: the operator has no readout into (B, L, D) or its readout is not affine.
    """
    name = type(operator).__name__
    if getattr(operator, "readout", None) is None or getattr(operator, "output", None) is None:
        raise TypeError(f"mamba_captum: MambaLaTIM needs the operator's output and readout; {name} has none.")
    work = operator.to(torch.float64) if hasattr(operator, "to") else operator
    output = work.output.detach().to(torch.float64)
    with torch.no_grad():
        full, zero, double = (work.readout(scale * output) for scale in (1.0, 0.0, 2.0))
    if full.dim() != 3:
        raise TypeError(f"mamba_captum: MambaLaTIM decomposes into the residual stream, but the readout of {name} "
                        f"gives {tuple(full.shape)}, not (B, L, D) (an attention layer's output before its o_proj).")
    scale = full.abs().amax().clamp(min=1e-30)
    if (double - 2 * full + zero).abs().amax() > 1e-9 * scale:
        raise TypeError(f"mamba_captum: the readout of {name} is not affine in the operator's output, so its "
                        "token contributions cannot be mapped into the residual stream.")
    biased = bias_operator(work)  # the conv biases acting at every token: their share of output is no token's
    columns, bias_share = [], torch.zeros_like(zero)
    for feature in range(full.shape[-1]):
        unit = torch.zeros_like(full)
        unit[..., feature] = 1.0
        grad = operator_output_grad(work, unit)
        columns.append(work.contributions(grad).to(torch.float64))  # (B, L, L)
        if biased is not None:
            bias_share[..., feature] = biased.contributions(grad).to(torch.float64).sum(-1)
    return torch.stack(columns, dim=-1), zero + bias_share


def alti_weights(contributions: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """ALTI's row-normalised proximities: max(0, ‖y_i‖₁ − ‖y_i − T̃_{i←j}‖₁) / Σ_j (·).
    contributions (B, L, L, D), output (B, L, D) -> (B, L, L)."""
    proximity = output.abs().sum(-1)[:, :, None] - (output[:, :, None, :] - contributions).abs().sum(-1)
    return normalise_rows(proximity.clamp(min=0))


def l2_weights(contributions: torch.Tensor) -> torch.Tensor:
    """‖T̃_{i←j}‖₂ / Σ_j (·): (B, L, L, D) -> (B, L, L)."""
    return normalise_rows(contributions.norm(dim=-1))


def normalise_rows(weights: torch.Tensor) -> torch.Tensor:
    """Each row over its sum. A row with no weight (every contribution farther from the output than the origin, in
    ALTI; a padding token's zero output) keeps its token: the unit row, so that every row of the rollout sums to 1."""
    total = weights.sum(-1, keepdim=True)
    eye = torch.eye(weights.shape[-1], dtype=weights.dtype, device=weights.device)
    return torch.where(total > 0, weights / torch.where(total > 0, total, torch.ones_like(total)), eye)


class MambaLaTIM(ImplicitAttentionMethod):
    """LaTIM: each layer's output decomposed into per-token contribution vectors, scored by ALTI, ALTI-logit or
    their ℓ2 norm and rolled out over the layers; any family whose token mixers have an operator with an affine
    readout into the residual stream (tried: Mamba-1/2, Qwen3-Next's gated delta net, RWKV-4, Griffin, xLSTM).

    ``MambaLaTIM(model, variant="alti").attribute(input_ids)`` -> (B, L); ``attribute_map(input_ids)`` -> the
    rolled-out (B, L, L). See ``docs/methods/latim.md``.

    Args:
        model: as :class:`ImplicitAttentionMethod`.
        forward_func: as :class:`ImplicitAttentionMethod`.
        variant: ``"alti"`` (default), ``"alti_logit"`` (class-specific) or ``"l2"``; ``attribute`` may override it.
    """

    def __init__(self, model, forward_func=None, variant: str = "alti"):
        super().__init__(model, forward_func)
        check_variant(variant)
        self.variant = variant
        self._recorded = None  # during a call: what the hooks saw (layer inputs / outputs, the final norm)

    # -- options ---------------------------------------------------------------------------------------------------
    def _options(self, recipe, start_layer, reduce, variant=None, result="rows", **extra):
        variant = self.variant if variant is None else variant
        check_variant(variant)
        if recipe != "product":
            raise ValueError("mamba_captum: MambaLaTIM has no official recipe; leave recipe= out.")
        return super()._options(recipe, start_layer, reduce, variant=variant, result=result, **extra)

    @log_usage()  # Captum's wrapper: NoiseTunnel calls attribute.__wrapped__
    def attribute(self, inputs, target=None, additional_forward_args=None, *, attention_mask=None, position=None,
                  start_layer=None, variant=None, **forward_kwargs):
        """Relevance (B, L) of every input token for the explained position (the row ``position`` of the rollout;
        for ``alti_logit``, the target's logit split over the tokens).

        As :meth:`ImplicitAttentionMethod.attribute` for ``inputs``, ``target``, ``additional_forward_args``,
        ``attention_mask``, ``position``, ``start_layer`` and ``**forward_kwargs`` (the unified operators; ``target``
        is read by ``alti_logit`` only, None: the argmax token).

        Args:
            variant: ``"alti"`` | ``"alti_logit"`` | ``"l2"``; None: the constructor's.
        Returns:
            (B, L) for token ids, (B, L, D) for embeddings; a 1-tuple when ``inputs`` was a tuple.
        Raises:
            TypeError: a layer whose operator has no affine readout into the residual stream, more than one token
                mixer in a decoder layer, or an image model, named.
            ReconstructionError: the contributions do not sum to the mixer's real output.
        """
        inputs_tensor, was_tuple = format_inputs(inputs, self._runner.image_model)
        _, relevance = self._relevance_per_query(inputs_tensor, target, additional_forward_args, attention_mask,
                                                 position, "unified", start_layer, "mean", None, "product",
                                                 forward_kwargs, variant=variant)
        return as_attributions(relevance[0], inputs_tensor, was_tuple, self._runner.layout, self._runner.packed)

    def attribute_positions(self, inputs, positions, target=None, *, attention_mask=None, start_layer=None,
                            variant=None, **forward_kwargs) -> torch.Tensor:
        """Several explained positions of the same inputs from one forward pass and one decomposition (the costly
        part): (Q, B, L), entry q as ``attribute(inputs, target=target[q], position=positions[q])``.

        Args:
            positions: Q query positions, each an int (every example) or one per example (B,).
            target: Q targets, each an int or (B,) (read by ``alti_logit``, which needs them); None for ``alti`` /
                ``l2``.
        """
        inputs_tensor, _ = format_inputs(inputs, self._runner.image_model)
        batch = inputs_tensor.shape[0]
        variant = self.variant if variant is None else variant
        if target is None and variant == "alti_logit":
            raise ValueError("mamba_captum: attribute_positions(..., variant='alti_logit') needs one target per "
                             "position.")
        as_rows = lambda value: torch.as_tensor(value, dtype=torch.long).expand(batch).to(inputs_tensor.device)
        targets = [None] * len(positions) if target is None else [as_rows(t) for t in target]
        if len(targets) != len(positions):
            raise ValueError(f"mamba_captum: {len(positions)} positions but {len(targets)} targets.")
        queries = [(as_rows(p), t) for p, t in zip(positions, targets)]
        _, relevance = self._relevance_per_query(inputs_tensor, None, None, attention_mask, None, "unified",
                                                 start_layer, "mean", None, "product", forward_kwargs,
                                                 queries=queries, variant=variant)
        return torch.stack(relevance)

    def attribute_map(self, inputs, additional_forward_args=None, *, attention_mask=None, start_layer=None,
                      variant=None, **forward_kwargs) -> torch.Tensor:
        """The rolled-out token-to-token map ρ = Ã^Λ ⋯ Ã^s (B, L, L) float64 (``alti`` or ``l2``): row i is the
        relevance of every token for position i (``attribute(..., position=i)`` is row i)."""
        variant = self.variant if variant is None else variant
        if variant == "alti_logit":
            raise ValueError("mamba_captum: alti_logit splits one target's logit; it has no token × token map. Use "
                             "variant='alti' or 'l2'.")
        inputs_tensor, _ = format_inputs(inputs, self._runner.image_model)
        _, maps = self._relevance_per_query(inputs_tensor, None, additional_forward_args, attention_mask, None,
                                            "unified", start_layer, "mean", None, "product", forward_kwargs,
                                            variant=variant, result="map")
        return maps[0]

    def decompose(self, inputs, additional_forward_args=None, *, attention_mask=None, **forward_kwargs):
        """Each decoder layer's contribution vectors T̃ (layers, B, L, L, D) float64: ``T̃[ℓ, :, i, j]`` is token
        j's share of layer ℓ's output at token i (its own residual and token-local parts on the diagonal), so
        ``T̃[ℓ].sum(2)`` is layer ℓ's real output (B, L, D)."""
        inputs_tensor, _ = format_inputs(inputs, self._runner.image_model)
        _, stacked = self._relevance_per_query(inputs_tensor, None, additional_forward_args, attention_mask, None,
                                               "unified", 0, "mean", None, "product", forward_kwargs,
                                               result="layers")
        return stacked[0]

    # -- the captured forward, with the layers' inputs and outputs ---------------------------------------------------
    def _captured_relevance(self, *args, **kwargs):
        recorder = _Recorder(self._runner.decoder_layers, self.model)
        self._recorded = recorder
        try:
            with recorder:
                return super()._captured_relevance(*args, **kwargs)
        finally:
            self._recorded = None

    def _relevance(self, explained, options):
        if explained.layout is not None or self._runner.packed:
            raise TypeError("mamba_captum: MambaLaTIM explains token models; image models are not supported.")
        variant, result = options["variant"], options["result"]
        logit = variant == "alti_logit" and result == "rows"
        directions = [self._logit_direction(query) for query in explained.queries] if logit else None
        product = RunningProduct()
        logit_rows = [None] * len(explained.queries)
        stacked = []
        for record in explained.layers():
            contributions, layer_input, output = self._layer(explained, record)
            if result == "layers":
                stacked.append(contributions)
                continue
            if logit:  # the layer's update (no residual) read by the target's direction, sent back by ρ^{ℓ-1}
                update = contributions.clone()
                index = torch.arange(update.shape[1])
                update[:, index, index] -= layer_input
                for number, (query, direction) in enumerate(zip(explained.queries, directions)):
                    rows = update[torch.arange(update.shape[0]), query.positions.cpu()]  # (B, L, D)
                    shares = torch.einsum("bkd,bd->bk", rows, direction)
                    if logit_rows[number] is None:  # the first layer's input stays with the query token itself
                        start = torch.einsum("bd,bd->b", layer_input[torch.arange(len(query.positions)),
                                                                     query.positions.cpu()], direction)
                        logit_rows[number] = torch.zeros_like(shares)
                        logit_rows[number][torch.arange(len(start)), query.positions.cpu()] = start
                    sent = shares if product.product is None else torch.einsum("bk,bkj->bj", shares,
                                                                               product.product)
                    logit_rows[number] = logit_rows[number] + sent
            weights = l2_weights(contributions) if variant == "l2" else alti_weights(contributions, output)
            product.push(weights)
        if result == "layers":
            return [torch.stack(stacked)]
        if logit:
            return [row if row is not None else torch.zeros(explained.batch, explained.length, dtype=torch.float64)
                    for row in logit_rows]
        if result == "map":
            eye = torch.eye(explained.length, dtype=torch.float64).expand(explained.batch, -1, -1)
            return [product.product if product.product is not None else eye.clone()]
        return [q.row_of(product, explained.length) for q in explained.queries]

    def _layer(self, explained, record):
        """(T̃ (B, L, L, D), the layer's input h (B, L, D), its output y (B, L, D)), float64, after the check that
        the mixer's contributions rebuild its real output."""
        operator = record.operator
        name = type(operator).__name__
        if not isinstance(record.key, int):
            raise TypeError(f"mamba_captum: MambaLaTIM decomposes each decoder layer through one token mixer; the "
                            f"{name} at {record.key!r} is a second mixing part of layer {record.layer}.")
        calls = [c for c in explained.trace.mixer_calls
                 if c.located.layer == record.layer and c.located.follows is None]
        io = self._recorded.layers.get(record.layer)
        if len(calls) != 1 or io is None or len(io) != 1:
            raise TypeError(f"mamba_captum: MambaLaTIM needs one token mixer per decoder layer, run once; layer "
                            f"{record.layer} ({name}) has {len(calls)} mixer call(s) and ran "
                            f"{0 if io is None else len(io)} time(s).")
        layer_input, output = (t.to(torch.float64) for t in io[0])
        mixed, own = contribution_vectors(operator)
        if mixed.shape[-1] != output.shape[-1]:
            raise TypeError(f"mamba_captum: the {name} of layer {record.layer} reads out {mixed.shape[-1]} features "
                            f"into a residual stream of {output.shape[-1]}; MambaLaTIM cannot place them.")
        real = calls[0].output.detach().to(torch.float64)
        rebuilt = mixed.sum(2) + own
        rows = explained.mask.bool().cpu()
        gap = (rebuilt - real)[rows].abs().amax() if rows.any() else torch.tensor(0.0)
        if gap > IDENTITY_RTOL * real[rows].abs().amax().clamp(min=1e-12):
            raise ReconstructionError(
                f"mamba_captum: MambaLaTIM's contributions of layer {record.layer} ({name}) do not sum to the mixer's "
                f"real output (largest gap {gap.item():.3g} against {real[rows].abs().amax().item():.3g}); please "
                "report this.")
        contributions = mixed
        index = torch.arange(contributions.shape[1])
        contributions[:, index, index] += output - mixed.sum(2)  # residual, D skip, biases, token-local MLP
        return contributions, layer_input, output

    def _logit_direction(self, query) -> torch.Tensor:
        """(B, D) w with logit_t(q) = ⟨h_q, w⟩ + constants: the final norm at the query, its scale frozen, then
        the target's unembedding row."""
        final = self._recorded
        if final.head_input is None or final.norm_input is None:
            raise TypeError("mamba_captum: MambaLaTIM(variant='alti_logit') needs a causal LM whose output embeddings "
                            "read a final norm of the last layer's output; use 'alti' or 'l2'.")
        batch = torch.arange(len(query.positions))
        positions = query.positions.cpu()
        hidden = final.norm_input[batch, positions].to(torch.float64)  # (B, D)
        normed = final.head_input[batch, positions].to(torch.float64)
        head = final.head.weight.detach().to(torch.float64)[query.targets.cpu()]  # (B, D)
        return frozen_norm_direction(final.norm, hidden, normed, head)


def frozen_norm_direction(norm, hidden: torch.Tensor, normed: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """w (B, D) with ⟨normed, u⟩ = ⟨hidden, w⟩ + ⟨β, u⟩ for an RMSNorm / LayerNorm ``norm`` (weight γ or 1 + γ,
    bias β) whose statistic is frozen at ``hidden``: w = center(γ ⊙ u) / s (center only for LayerNorm), s fitted
    from ``hidden`` -> ``normed`` by least squares. Refuses a norm that fits neither form."""
    weight = getattr(norm, "weight", None)
    if weight is None:
        raise TypeError(f"mamba_captum: the final norm {type(norm).__name__} has no weight; alti_logit cannot "
                        "linearise it.")
    weight = weight.detach().to(torch.float64)
    bias = getattr(norm, "bias", None)
    bias = torch.zeros_like(weight) if bias is None else bias.detach().to(torch.float64)
    layer_norm = "LayerNorm" in type(norm).__name__ and "RMS" not in type(norm).__name__
    centered = hidden - hidden.mean(-1, keepdim=True) if layer_norm else hidden
    for gain in (weight, 1 + weight):
        scaled = gain * centered  # normed − β = scaled / s
        inverse = (scaled * (normed - bias)).sum(-1, keepdim=True) / (scaled * scaled).sum(-1, keepdim=True)
        if ((scaled * inverse + bias - normed).abs().amax() <= 1e-4 * normed.abs().amax()):
            direction = gain * head_rows * inverse
            return direction - direction.mean(-1, keepdim=True) if layer_norm else direction
    raise TypeError(f"mamba_captum: the final norm {type(norm).__name__} is neither an RMSNorm nor a LayerNorm of "
                    "its input; alti_logit cannot linearise it.")


def check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"mamba_captum: variant={variant!r}; choose one of {VARIANTS}.")


class _Recorder:
    """Forward hooks for one call: each decoder layer's (input, output) hidden states, and the final norm before the
    output embeddings with what it read and gave."""

    def __init__(self, decoder_layers, model):
        self.decoder_layers = decoder_layers
        self.model = model
        self.layers: dict[int, list] = {}
        self.head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.norm = self.norm_input = self.head_input = None
        self._norm_calls: list = []
        self._handles: list = []

    def __enter__(self):
        for index, layer in enumerate(self.decoder_layers):
            self._handles.append(layer.register_forward_hook(self._on_layer(index), with_kwargs=True))
        inside = {id(m) for layer in self.decoder_layers for m in layer.modules()}
        for module in self.model.modules():
            if "Norm" in type(module).__name__ and id(module) not in inside:
                self._handles.append(module.register_forward_hook(self._on_norm))
        if isinstance(self.head, torch.nn.Module):
            self._handles.append(self.head.register_forward_pre_hook(self._on_head))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return False

    def _on_layer(self, index):
        def hook(module, args, kwargs, output):
            hidden = args[0] if args else kwargs.get("hidden_states")
            out = output[0] if isinstance(output, (tuple, list)) else output
            if torch.is_tensor(hidden) and torch.is_tensor(out):
                self.layers.setdefault(index, []).append((hidden.detach(), out.detach()))
        return hook

    def _on_norm(self, module, args, output):
        if args and torch.is_tensor(args[0]) and torch.is_tensor(output):
            self._norm_calls.append((module, args[0].detach(), output.detach()))

    def _on_head(self, module, args):
        if not args or not torch.is_tensor(args[0]):
            return
        self.head_input = args[0].detach()
        for norm, seen, given in reversed(self._norm_calls):  # the norm whose output the head reads
            if given.shape == self.head_input.shape and torch.equal(given, self.head_input):
                self.norm, self.norm_input = norm, seen
                break
