"""Captum's argument forms: the inputs (token ids, embeddings, pixels, packed patches), the mask, the query
positions, the targets and the start layer checked and normalised, and the relevance put back into the inputs' shape.

Shapes: B batch, L tokens, D model width, K classes / vocabulary.
"""
from __future__ import annotations

import torch

from ..checks import check_mask, index_list, is_int, single_index
from ..operators import REDUCTIONS


def format_inputs(inputs, image_model: bool = False):
    """Captum's input forms -> (tensor, was_tuple). Token ids (B, L) or embeddings (B, L, D) (``inputs_embeds``);
    pixels (B, C, H, W) for an image model, packed patches (N, P) for a vision tower (checked against the model by
    the runner)."""
    was_tuple = isinstance(inputs, tuple)
    if was_tuple:
        if len(inputs) != 1:
            raise ValueError(
                f"mamba_captum: inputs is a tuple of {len(inputs)} tensors; the token input is the only one explained. "
                "Pass (input_ids,) or (inputs_embeds,) and the rest as attention_mask= or additional_forward_args.")
        inputs = inputs[0]
    if not torch.is_tensor(inputs):
        raise TypeError(f"mamba_captum: inputs must be a tensor (or a 1-tuple of one), got {type(inputs).__name__}.")
    if image_model:
        return inputs, was_tuple
    if inputs.is_floating_point():
        if inputs.dim() != 3:
            raise ValueError(f"mamba_captum: float inputs are embeddings (B, L, D); got shape {tuple(inputs.shape)}.")
    elif inputs.dim() != 2:
        raise ValueError(f"mamba_captum: token ids must be (B, L); got shape {tuple(inputs.shape)}. "
                         "Add a batch dimension with input_ids[None].")
    if inputs.shape[1] == 0:
        raise ValueError("mamba_captum: inputs has no tokens (L = 0).")
    return inputs, was_tuple


def check_forward_func_inputs(model, inputs: torch.Tensor) -> None:
    """The inputs of a ``forward_func``, checked as :func:`mamba_captum.checks.check_inputs` checks the model's own,
    but for what a forward_func may do itself: move them to the model's device, project embeddings to its width.
    Token ids must be ids of the model's vocabulary, in a dtype its embeddings take: the relevance is laid over
    them, and the model's embeddings must see them as given (checked after the forward pass).

    Raises:
        ValueError / TypeError naming the problem and the fix, instead of an error from inside the forward pass.
    """
    if inputs.shape[0] == 0:
        raise ValueError("mamba_captum: the inputs hold no examples (batch size 0).")
    if inputs.is_floating_point():
        return
    if inputs.is_complex() or inputs.dtype == torch.bool:
        raise TypeError(f"mamba_captum: input_ids must hold integer token ids, not {inputs.dtype}; pass embeddings "
                        "(B, L, D) as float inputs.")
    if inputs.dtype not in (torch.int64, torch.int32):  # what embedding lookups take
        raise TypeError(f"mamba_captum: input_ids are {inputs.dtype}; token ids must be torch.long (or int32): pass "
                        "input_ids.long().")
    if inputs.is_meta:
        raise ValueError("mamba_captum: input_ids are on the meta device, which holds no data; pass real token ids.")
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    vocabulary = getattr(embeddings, "num_embeddings", None)
    if vocabulary is not None:
        low, high = int(inputs.min()), int(inputs.max())
        if low < 0 or high >= vocabulary:
            raise ValueError(f"mamba_captum: input_ids hold token id {low if low < 0 else high}, outside the model's "
                             f"vocabulary (0..{vocabulary - 1}); were they made by another tokenizer?")


def format_mask(attention_mask, inputs) -> torch.Tensor:
    """The checked mask (:func:`mamba_captum.checks.check_mask`) as float32 (B, L); all ones when None."""
    batch, length = inputs.shape[:2]
    if attention_mask is None:
        return torch.ones(batch, length, device=inputs.device)
    check_mask(attention_mask, batch, length, inputs.device)
    return attention_mask.to(torch.float32)


def last_real_token(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last token with mask 1 (left or right padding)."""
    index = torch.arange(mask.shape[1], device=mask.device)
    return (index * (mask > 0)).argmax(-1)


def format_positions(position, mask: torch.Tensor) -> torch.Tensor:
    """``position=`` (None: last real token; int, or one per example; negative counts from the end) -> (B,)."""
    batch, length = mask.shape
    if position is None:
        return last_real_token(mask)
    positions = torch.tensor(index_list(position, "position"), dtype=torch.long, device=mask.device)
    if positions.numel() == 1:
        positions = positions.expand(batch)
    if positions.numel() != batch:
        raise ValueError(f"mamba_captum: position= has {positions.numel()} entries for a batch of {batch}.")
    if bool(((positions < -length) | (positions >= length)).any()):
        raise IndexError(f"mamba_captum: position={positions.tolist()} out of range for {length} tokens.")
    positions = positions % length
    if not bool(mask[torch.arange(batch, device=mask.device), positions].all()):
        raise ValueError(f"mamba_captum: position={positions.tolist()} points at a padding token.")
    return positions.clone()


def format_targets(target, scores: torch.Tensor) -> torch.Tensor:
    """Captum's target forms for (B, K) scores -> (B,) class indices; None -> the argmax of each example.

    As Captum's ``_select_targets`` reads them: an int, a 1-tuple ``(c,)`` or a one-element tensor: the same class
    for every example; a list (of ints or 1-tuples) or a 1-D tensor: one per example, exactly B of them. A list is
    never broadcast: ``target=[c]`` for a batch of 2 is refused, as Captum refuses it (``target=c`` is one class
    for all).
    """
    batch, classes = scores.shape
    if target is None:
        return scores.argmax(-1)
    if isinstance(target, tuple):
        if len(target) != 1:
            raise IndexError(f"mamba_captum: target={target} indexes {len(target)} output dimensions; "
                             f"the explained scores are (B, K) = {tuple(scores.shape)}: give one class index.")
        if not is_int(target[0]):
            raise TypeError(f"mamba_captum: target={target!r}: a tuple target holds one class index, the same for "
                            "every example; give one per example as a list or a 1-D tensor.")
        target = target[0]
    if isinstance(target, list):
        if len(target) != batch:
            raise ValueError(f"mamba_captum: {len(target)} targets for a batch of {batch} examples: a target list "
                             f"gives one per example, so it must have {batch} (as in Captum); one class for every "
                             "example is an int, not a list.")
        target = [t[0] if isinstance(t, tuple) and len(t) == 1 else t for t in target]
        if not all(is_int(t) or (torch.is_tensor(t) and t.numel() == 1 and not t.is_floating_point()
                                 and not t.is_complex() and t.dtype != torch.bool) for t in target):
            raise TypeError(f"mamba_captum: target list must hold one integer class index per example, got "
                            f"{target}.")
        targets = torch.tensor([int(t) for t in target], dtype=torch.long, device=scores.device)
    else:
        if isinstance(target, str):  # Captum's targets are indices; a word needs the tokenizer, which is not here
            raise TypeError(f"mamba_captum: target={target!r} is a string; targets are class / token indices, as in "
                            f"Captum: pass target=tokenizer.convert_tokens_to_ids({target!r}) (a token of the "
                            "vocabulary), or use mamba_captum.explain.explain(model, tokenizer, text, "
                            f"target={target!r}), which takes words.")
        try:
            targets = torch.as_tensor(target, device=scores.device)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"mamba_captum: target={target!r} is not an int, a tuple, a list or a tensor.") \
                from error
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(f"mamba_captum: target must hold integer class indices, got dtype {targets.dtype}.")
        if targets.numel() != 1 and (targets.dim() != 1 or targets.numel() != batch):
            raise ValueError(f"mamba_captum: {targets.numel()} targets (a tensor of shape {tuple(targets.shape)}) "
                             f"for a batch of {batch} examples; give one class for all (one element) or one per "
                             f"example, shape ({batch},), as in Captum.")
        targets = targets.reshape(-1).long().expand(batch)
    if bool(((targets < -classes) | (targets >= classes)).any()):
        raise IndexError(f"mamba_captum: target {targets.tolist()} out of range: the explained output has "
                         f"{classes} classes (indices 0..{classes - 1}).")
    return (targets % classes).clone()


def start_layer_index(start_layer, count: int) -> int:
    if start_layer is None:
        return 0
    start = single_index(start_layer, "start_layer")
    if not -count <= start < count:
        raise IndexError(f"mamba_captum: start_layer={start_layer} out of range for {count} decoder layers.")
    return start % count


def check_reduce(reduce):
    if reduce not in REDUCTIONS:
        raise ValueError(f"mamba_captum: reduce={reduce!r}; choose one of {REDUCTIONS}.")


def as_attributions(relevance: torch.Tensor, inputs: torch.Tensor, was_tuple: bool, layout=None, packed=False):
    """(B, L) relevance in the shape of the inputs: (B, L) for ids, broadcast over D for (B, L, D) embeddings;
    for an image model (``layout``), pixel relevance (B, 1, H, W) as Captum's upsampled layer attributions; for
    packed patches (N, P) (``packed``), each patch's relevance repeated over its P values."""
    if packed:
        out = relevance[0, :, None].expand(*inputs.shape).to(inputs.dtype).contiguous()
        return (out,) if was_tuple else out
    if layout is not None:
        relevance = layout.to_pixels(relevance.to(inputs.dtype if inputs.is_floating_point() else torch.float32))
        return (relevance,) if was_tuple else relevance
    if inputs.is_floating_point():  # a real tensor, not a stride-0 view (captum.metrics reshapes it)
        relevance = relevance[..., None].expand(*inputs.shape).to(inputs.dtype).contiguous()
    return (relevance,) if was_tuple else relevance
