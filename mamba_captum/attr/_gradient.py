"""The gradients a method asks for: of each explained score, at the recorded layers' outputs, residual streams and
inputs, loss-scaled where the graph is float16.

Shapes: B batch, L tokens, D model width, K classes / vocabulary.
"""
from __future__ import annotations

import math

import torch

from ..checks import check_finite


def score_gradients(explained, trace, queries, layers, residual_grads, operator_grads, input_effects=False):
    """The gradients of each query's target score that a method asks for, stored where the methods read them:
    ``residual_grads``, (B, L, D) at the residual stream entering each of ``layers``
    (``explained.residual_grads``); ``operator_grads``, at each recorded call's output (``call.output_grads``);
    ``input_effects``, (B, L) Σ_features gradient × input at each call's inputs (``call.input_effects``);
    ``input_effects="rows"`` also gives the same per output row of the call, (B, L, L) (``call.row_effects``, see
    :func:`row_effects`; needs ``operator_grads``). ``queries``: per query, (positions (B,), scores (B, K), targets (B,)). float16 graphs are loss-scaled
    (:func:`scaled_grad`).

    Raises:
        RuntimeError: the forward pass built no autograd graph through the recorded layers or the scores.
    """
    tensors = []
    if residual_grads:
        missing = [i for i in layers if i not in trace.residuals]
        if missing:
            raise RuntimeError(f"mamba_captum: decoder layers {missing} did not run in the forward pass.")
        tensors += [trace.residuals[i] for i in layers]
    calls = (trace.mixer_calls + trace.attention_calls) if operator_grads else []
    tensors += [call.output for call in calls]
    # gradient × input at each layer's inputs: the mixer input, or an attention call's queries and keys
    inputs = []
    if input_effects:
        inputs = [(call, (call.hidden_states,)) for call in trace.mixer_calls] + \
                 [(call, (call.query, call.key)) for call in trace.attention_calls]
        inputs = [(call, pieces) for call, pieces in inputs if all(p.requires_grad for p in pieces)]
        for call, _ in inputs:
            call.input_effects = []
            call.row_effects = [] if input_effects == "rows" else None
    if input_effects == "rows" and not operator_grads:
        raise ValueError("mamba_captum: the effects per row need the gradients at the calls' outputs "
                         "(operator_grads=True).")
    effect_tensors = [piece for _, pieces in inputs for piece in pieces]
    if any(not t.requires_grad for t in tensors):
        raise RuntimeError("mamba_captum: the forward pass built no autograd graph through the recorded "
                           "layers (a forward_func that runs the model under torch.no_grad or inference_mode?).")
    for call in calls:
        call.output_grads = []
    loss_scale = {}  # float16 graphs: the scale found for the first score serves the next ones
    for number, (_, scores, targets) in enumerate(queries):
        picked = scores.gather(1, targets[:, None].to(scores.device)).sum()
        if not picked.requires_grad:
            raise RuntimeError("mamba_captum: the explained scores carry no autograd graph (forward_func "
                               "returned detached scores, or ran the model under torch.no_grad / inference_mode); "
                               "return the scores as computed from the model's output.")
        per_row = input_effects == "rows"
        everything = scaled_grad(picked, tensors + effect_tensors,
                                 retain_graph=per_row or number < len(queries) - 1, memo=loss_scale)
        grads, effect_grads = everything[:len(tensors)], list(everything[len(tensors):])
        for call, pieces in inputs:
            effect = 0
            for piece in pieces:
                grad = effect_grads.pop(0)
                if grad is not None:
                    product = (grad * piece).detach()
                    if product.dim() == 4 and getattr(explained, "staged", False) \
                            and getattr(call, "located", None) is not None:  # a mixer's grid input: (B, L, C)
                        product = explained.layout.as_tokens(product, explained.layout.stage_of_block(
                            call.located.layer))
                    # (B, L, D) mixer input, or (B, H, L, d) queries / keys: summed to (B, L)
                    effect = effect + (product.sum(-1) if product.dim() == 3 else product.sum((1, 3)))
            call.input_effects.append(effect if torch.is_tensor(effect) else None)
        if any(g is None for g in grads):
            # Every recorded layer lies between the inputs and the scores: a tensor the gradient cannot reach
            # was computed outside autograd's view (compiled code, a CUDA graph, a detach in forward_func).
            raise RuntimeError(
                "mamba_captum: the explained scores do not depend, for autograd, on the recorded layers: the "
                "forward pass ran them where autograd cannot follow (code compiled with torch.compile inside "
                "forward_func, a CUDA graph, or a .detach()). Pass the model itself (compiled models are run "
                "eagerly by the library) or a forward_func that keeps the graph.")
        for grad in grads:
            check_finite(grad, "the gradients of the explained scores", explained.model)
        if residual_grads:
            staged = getattr(explained, "staged", False)
            for i, grad in zip(layers, grads[:len(layers)]):
                grad = grad[None] if grad.dim() == 2 else grad  # a packed (N, D) stream is one sequence
                if staged:  # a block's (B, C, H, W) or (B, H, W, C) stream as (B, L, C) tokens
                    grad = explained.layout.as_tokens(grad, explained.layout.stage_of_block(i))
                explained.residual_grads.setdefault(i, []).append(grad.detach())
            grads = grads[len(layers):]
        for call, grad in zip(calls, grads):
            call.output_grads.append(grad.detach())
        if per_row:
            for call, pieces in inputs:
                call.row_effects.append(row_effects(call.output, pieces, call.output_grads[-1],
                                                    loss_scale.get("scale", 1.0)))


# Rows of one call's Jacobian-vector products taken in one batched backward (torch.autograd.grad's
# is_grads_batched, a vmap over the backward): at most this many elements of the call's output at once.
ROW_BATCH_ELEMENTS = 2 ** 24


def row_effects(output: torch.Tensor, pieces: tuple, grad: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """J[b, i, j] = Σ_pieces Σ_features ∂(grad[b, i] · output[b, i]) / ∂piece[b, j] · piece[b, j]: each input
    token's first-order effect on the explained score, split by the output row i it acts through.

    ``output``: (B, L, ...) a call's output (tokens on dim 1), ``grad``: the explained score's gradient there;
    ``pieces``: its inputs in the graph, (B, L, D) (a mixer's input) or (B, H, L, d) (an attention call's queries
    and keys). Σ_i J[b, i, j] is the call's ``input_effects`` (gradient × input at the pieces). One backward per
    output row, batched (``is_grads_batched``; rows one by one where an op has no batching rule). ``scale``: a loss
    scale for float16 graphs (a power of two, divided out). Returns (B, L, L) in float32 or wider.
    """
    batch, length = output.shape[:2]
    dtype = torch.promote_types(output.dtype, torch.float32)
    effects = torch.zeros(batch, length, pieces[0].shape[-2] if pieces[0].dim() == 4 else pieces[0].shape[1],
                          dtype=dtype, device=output.device)
    seed = (grad * scale).to(output.dtype)
    chunk = max(1, ROW_BATCH_ELEMENTS // max(1, output.numel()))
    for start in range(0, length, chunk):
        rows = torch.arange(start, min(length, start + chunk), device=output.device)
        picked = torch.zeros((len(rows),) + tuple(output.shape), dtype=output.dtype, device=output.device)
        picked[torch.arange(len(rows)), :, rows] = seed[:, rows].transpose(0, 1)
        try:
            grads = torch.autograd.grad(output, pieces, picked, retain_graph=True, allow_unused=True,
                                        is_grads_batched=True)
        except RuntimeError:  # an op without a batching rule under vmap: the rows one backward each
            per_row = [torch.autograd.grad(output, pieces, row, retain_graph=True, allow_unused=True)
                       for row in picked]
            grads = tuple(None if per_row[0][k] is None else torch.stack([g[k] for g in per_row])
                          for k in range(len(pieces)))
        for piece, piece_grad in zip(pieces, grads):
            if piece_grad is None:
                continue
            product = piece_grad.to(dtype) * piece.detach().to(dtype)  # (R, B, L, D) or (R, B, H, L, d)
            summed = product.sum(-1) if piece.dim() == 3 else product.sum((2, 4))  # (R, B, L)
            effects[:, rows] += summed.transpose(0, 1) / scale
    return effects


# float16 has 5 exponent bits: a gradient below 6e-8 flushes to zero in the model's own backward. The gradients of
# one score span ~1e10 across tokens (measured: 3e-12 .. 0.15 on a tiny Bamba), and the gradient methods normalise
# each row, so tiny rows carry full weight: unscaled they silently became identity rows (relevance 10 % off the
# float32 copy of the model). So the score is loss-scaled: an unscaled backward first measures the largest gradient,
# the scale is the power of two that takes it to FLOAT16_GRAD_TARGET (headroom for larger gradients inside the
# graph), at most 2^15 (float16's largest power of two), halved while the backward still overflows; later scores of
# the same call start from the scale found. The gradients are unscaled exactly (powers of two), in float32 or wider.
# bfloat16 has float32's exponent range and is not scaled.
FLOAT16_GRAD_SCALE = 2.0 ** 15  # the largest scale
FLOAT16_GRAD_TARGET = 2.0 ** 10  # the largest gradient after scaling: 64× below float16's largest number


def _all_finite(grads) -> bool:
    return all(g is None or bool(torch.isfinite(g).all()) for g in grads)


def scaled_grad(score: torch.Tensor, tensors: list, retain_graph: bool, memo: dict | None = None) -> tuple:
    """``torch.autograd.grad(score, tensors)`` (None for unused tensors), with a loss scale where any is float16.

    ``memo``: a dict kept across the scores of one call; it remembers the scale found (one backward per later score).
    """
    if not any(t.dtype == torch.float16 for t in tensors):
        return torch.autograd.grad(score, tensors, retain_graph=retain_graph, allow_unused=True)
    memo = {} if memo is None else memo
    scale = memo.get("scale")
    if scale is None:
        grads = torch.autograd.grad(score, tensors, retain_graph=True, allow_unused=True)
        largest = max((float(g.abs().max()) for g in grads if g is not None and g.numel()), default=0.0)
        if not _all_finite(grads) or largest >= FLOAT16_GRAD_TARGET:
            memo["scale"] = 1.0  # non-finite unscaled (the caller's check names it), or too large to scale up
            return tuple(None if g is None else g.to(torch.promote_types(g.dtype, torch.float32)) for g in grads)
        scale = FLOAT16_GRAD_SCALE if largest == 0 else min(
            FLOAT16_GRAD_SCALE, 2.0 ** math.floor(math.log2(FLOAT16_GRAD_TARGET / largest)))
    while True:
        grads = torch.autograd.grad(score * scale, tensors, retain_graph=retain_graph or scale > 1, allow_unused=True)
        if scale == 1 or _all_finite(grads):
            break
        scale /= 2
    memo["scale"] = scale
    return tuple(None if g is None else g.to(torch.promote_types(g.dtype, torch.float32)) / scale for g in grads)
