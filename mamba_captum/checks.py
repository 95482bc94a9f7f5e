"""Argument checks shared by :func:`mamba_captum.implicit_attention` and the Captum classes.

Nothing is coerced silently: a boolean where indices are expected, a float where an int is expected, a mask
that is not 0/1 or not exactly (B, L), inputs on another device than the model are refused with a message that
names the problem and the fix.
"""
from __future__ import annotations

import difflib
import inspect
import numbers

import torch
from torch import nn

from .offload import is_dispatched


class NonFiniteError(ValueError):
    """The model produced NaN or inf (in a layer's output, the explained scores or their gradients): an explanation
    of non-finite numbers is meaningless, so the library stops and names where they came from."""


def index_list(value, name: str) -> list[int]:
    """``value`` as a list of Python ints: an int, a sequence of ints, or an integer tensor (0-D or 1-D).

    Raises:
        TypeError: booleans (a mask is not a list of indices), floats, strings, other types.
        ValueError: an empty selection.
    """
    if torch.is_tensor(value):
        if value.dtype == torch.bool:
            raise TypeError(f"mamba_captum: {name}= is a boolean tensor; pass indices (e.g. mask.nonzero()"
                            ".flatten().tolist()), not a mask.")
        if value.is_floating_point() or value.is_complex():
            raise TypeError(f"mamba_captum: {name}= holds {value.dtype} numbers; pass integer indices.")
        if value.dim() > 1:
            raise ValueError(f"mamba_captum: {name}= must be an int or a 1-D list of ints; got shape "
                             f"{tuple(value.shape)}.")
        items = value.reshape(-1).tolist()
    elif isinstance(value, (str, bytes)):
        raise TypeError(f"mamba_captum: {name}={value!r} is a string; pass an int or a list of ints.")
    elif _is_int(value):
        items = [value]
    else:
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"mamba_captum: {name}= must be an int or a list of ints, not "
                            f"{type(value).__name__}.") from None
    bad = [item for item in items if not _is_int(item)]
    if bad:
        raise TypeError(f"mamba_captum: {name}= must hold ints; got {bad[0]!r} ({type(bad[0]).__name__}).")
    if not items:
        raise ValueError(f"mamba_captum: {name}= is empty; pass at least one index (or None for all).")
    return [int(item) for item in items]


def is_int(value) -> bool:
    """A Python / numpy integer or a 0-D integer tensor; not a bool."""
    return _is_int(value)


def check_forward_devices(kwargs: dict, device, model: nn.Module) -> None:
    """Tensor forward arguments (``position_ids``, ...) must be on the inputs' device (unless accelerate moves them).

    Raises:
        ValueError: naming the argument and the fix.
    """
    if is_dispatched(model):
        return
    for name, value in kwargs.items():
        if torch.is_tensor(value) and value.device != torch.device(device):
            raise ValueError(f"mamba_captum: {name} is on {value.device}, the inputs on {device}; move it with "
                             f"{name}.to({str(device)!r}).")


def _is_int(value) -> bool:
    if isinstance(value, bool) or (torch.is_tensor(value) and value.dtype == torch.bool):
        return False
    if torch.is_tensor(value):
        return value.dim() == 0 and not (value.is_floating_point() or value.is_complex())
    return isinstance(value, numbers.Integral)


def single_index(value, name: str) -> int:
    """One int (a Python int or a 0-D integer tensor); refuses booleans and floats."""
    if not _is_int(value):
        raise TypeError(f"mamba_captum: {name}= must be an int, not {value!r} ({type(value).__name__}).")
    return int(value)


def input_device(model: nn.Module) -> torch.device:
    """The device the model's inputs must be on (its input embeddings' weight, else its first parameter).

    Raises:
        ValueError: the model's weights are on the meta device and no accelerate hook loads them.
    """
    meta = [name for name, parameter in model.named_parameters() if parameter.device.type == "meta"]
    if meta and not is_dispatched(model):
        raise ValueError(f"mamba_captum: the model's weights are on the meta device ({meta[0]}, ... {len(meta)} "
                         "tensors): it holds no numbers to explain. Load it with from_pretrained(...) (or "
                         "to_empty(device=...) and load_state_dict) before explaining it.")
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    if torch.is_tensor(weight) and weight.device.type != "meta":
        return weight.device
    for parameter in model.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return torch.device("cpu")


def model_dtype(model) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 for a model without one)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def check_inputs(model: nn.Module, input_ids=None, inputs_embeds=None) -> tuple[int, int]:
    """Token ids (B, L) or embeddings (B, L, D) on the model's device, with B ≥ 1 and L ≥ 1, ids inside the
    vocabulary. Returns (B, L).

    Raises:
        ValueError / TypeError naming the problem and the fix.
    """
    if input_ids is not None and inputs_embeds is not None:
        raise ValueError("mamba_captum: pass input_ids or inputs_embeds, not both.")
    if input_ids is None and inputs_embeds is None:
        raise ValueError("mamba_captum: pass input_ids, or inputs_embeds= as a keyword argument.")
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if input_ids is not None:
        name, tensor = "input_ids", input_ids
        if not torch.is_tensor(tensor):
            raise TypeError(f"mamba_captum: input_ids must be a tensor of token ids, not {type(tensor).__name__}.")
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
            raise TypeError(f"mamba_captum: input_ids must hold integer token ids, not {tensor.dtype}; pass "
                            "embeddings as inputs_embeds=.")
        if tensor.dtype not in (torch.int64, torch.int32):  # what embedding lookups take
            raise TypeError(f"mamba_captum: input_ids are {tensor.dtype}; token ids must be torch.long (or int32): "
                            "pass input_ids.long().")
        if tensor.dim() != 2:
            raise ValueError(f"mamba_captum: input_ids must be (B, L); got shape {tuple(tensor.shape)}."
                             + (" Add a batch dimension with input_ids[None]." if tensor.dim() == 1 else ""))
    else:
        name, tensor = "inputs_embeds", inputs_embeds
        if not torch.is_tensor(tensor) or not tensor.is_floating_point():
            raise TypeError("mamba_captum: inputs_embeds must be a floating-point tensor (B, L, D).")
        if tensor.dim() != 3:
            raise ValueError(f"mamba_captum: inputs_embeds must be (B, L, D); got shape {tuple(tensor.shape)}.")
        width = getattr(embeddings, "embedding_dim", None)
        if width is not None and tensor.shape[-1] != width:
            raise ValueError(f"mamba_captum: inputs_embeds has width {tensor.shape[-1]}; the model's embeddings "
                             f"have {width}.")
    batch, length = tensor.shape[:2]
    if batch == 0:
        raise ValueError(f"mamba_captum: {name} holds no examples (batch size 0).")
    if length == 0:
        raise ValueError(f"mamba_captum: {name} has no tokens (L = 0).")
    device = input_device(model)
    if tensor.device != device and not is_dispatched(model):
        raise ValueError(f"mamba_captum: {name} is on {tensor.device}, the model on {device}; move it with "
                         f"{name}.to({str(device)!r}).")
    vocabulary = getattr(embeddings, "num_embeddings", None)
    if input_ids is not None and vocabulary is not None:
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= vocabulary:
            raise ValueError(f"mamba_captum: input_ids hold token id {low if low < 0 else high}, outside the "
                             f"model's vocabulary (0..{vocabulary - 1}); were they made by another tokenizer?")
    return batch, length


def check_mask(attention_mask, batch: int, length: int, device) -> None:
    """An attention mask must be a (B, L) tensor of 0 (padding) and 1 (real token), on the inputs' device, with at
    least one real token per example. Any dtype (bool, int, float) is accepted; nothing is broadcast.

    Raises:
        ValueError / TypeError naming the problem and the fix.
    """
    if attention_mask is None:
        return
    if not torch.is_tensor(attention_mask):
        raise TypeError(f"mamba_captum: attention_mask must be a (B, L) tensor, not {type(attention_mask).__name__}.")
    if tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"mamba_captum: attention_mask has shape {tuple(attention_mask.shape)}; the inputs are "
                         f"({batch}, {length}). Give one row of 0/1 per example (nothing is broadcast).")
    if attention_mask.device != torch.device(device):
        raise ValueError(f"mamba_captum: attention_mask is on {attention_mask.device}, the inputs on {device}; put "
                         "them on the same device.")
    if attention_mask.is_complex():
        raise TypeError("mamba_captum: attention_mask must hold 0 and 1, not complex numbers.")
    if attention_mask.dtype != torch.bool:
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)].reshape(-1)[0].item()
            raise ValueError(f"mamba_captum: attention_mask holds {bad!r}; it must hold 0 (padding) and 1 (real "
                             "token) only. The library explains padding masks, not soft token weights.")
    if not bool((attention_mask != 0).any(-1).all()):
        raise ValueError("mamba_captum: an example of the batch has no real token (its attention_mask row is all 0); "
                         "drop it from the batch.")


def nonfinite_parameters(module: nn.Module, limit: int = 3) -> list[str]:
    """Names of (up to ``limit``) parameters of ``module`` holding NaN or inf, each with the count."""
    names = []
    for name, parameter in module.named_parameters():
        if parameter.is_floating_point() and parameter.device.type != "meta":
            bad = int((~torch.isfinite(parameter.detach())).sum())
            if bad:
                names.append(f"{name} ({bad} non-finite values)")
                if len(names) == limit:
                    break
    return names


def check_finite(tensor: torch.Tensor, what: str, model: nn.Module | None = None) -> None:
    """Raise :class:`NonFiniteError` if ``tensor`` holds NaN or inf, naming the model's non-finite parameters."""
    if tensor is None or not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return
    culprits = nonfinite_parameters(model) if model is not None else []
    where = (f" The model has non-finite weights: {', '.join(culprits)}; reload or repair them." if culprits else
             " The model's weights are finite: the numbers overflowed (try float32) or the inputs are not finite.")
    raise NonFiniteError(f"mamba_captum: {what} contain NaN or inf.{where}")


# -- keyword arguments that would be dropped silently ----------------------------------------------------------------
# transformers 5 forwards take **kwargs and ignore names they do not know; these are the ones they do read from it
# (TransformersKwargs, the return_dict decorator, the cache position some models still take).
_FORWARD_KWARGS = ("return_dict", "cache_position", "num_items_in_batch", "output_hidden_states", "output_attentions",
                   "output_router_logits", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                   "position_ids", "is_causal", "seq_idx")


def underlying_forward(model: nn.Module):
    """The ``forward`` whose signature says what ``model`` reads: through ``torch.compile``'s wrapper (``_orig_mod``)
    and PEFT's ``PeftModel`` (its base model), whose own forwards take ``*args, **kwargs`` and pass them on."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
        elif type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
    return model.forward


def accepted_keywords(function) -> set[str] | None:
    """The keyword names ``function`` reads, or None when it takes any (a plain ``**kwargs`` of a user function).
    For a transformers model's ``forward``, its named parameters plus what transformers reads from ``**kwargs``."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    names = {name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return names
    owner = getattr(function, "__self__", None)
    if owner is not None and type(owner).__module__.startswith("transformers."):
        return names | set(_FORWARD_KWARGS)
    return None


# forward keywords that continue a cached prefix: the operator of the new tokens alone would miss the prefix.
# transformers 5.24 renamed cache_params / past_key_values to cache; its forwards still take the old names (with a
# FutureWarning, until 5.40) although their signatures no longer show them.
CONTINUATION_KEYWORDS = ("state", "past_key_values", "cache_params", "cache")


def check_continuation(keywords: dict) -> None:
    """Refuse a forward keyword that continues a cached prefix (any of :data:`CONTINUATION_KEYWORDS`, not None).

    Raises:
        ValueError: naming the keyword and the fix.
    """
    for name in CONTINUATION_KEYWORDS:
        if keywords.get(name) is not None:
            raise ValueError(f"mamba_captum: {name}= continues a cached prefix, whose tokens the explanation could "
                             "not see; pass the whole sequence instead (and use_cache=False).")


def check_keywords(keywords: dict, function, options, where: str) -> None:
    """Refuse keyword arguments that neither the library call (``options``) nor ``function`` would read: a typo
    such as ``formulaton=`` would otherwise be passed to the model's forward and dropped there. A keyword that
    continues a cached prefix is refused first (:func:`check_continuation`), whatever the signature shows.

    Raises:
        ValueError: a cached prefix. TypeError: naming the keyword, where it went, and the closest known names.
    """
    check_continuation(keywords)
    accepted = accepted_keywords(function)
    if accepted is None:
        return
    for name in keywords:
        if name not in accepted:
            close = difflib.get_close_matches(name, sorted(set(options) | accepted), n=2)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise TypeError(f"mamba_captum: {name}= is neither an option of {where} nor an argument of "
                            f"{getattr(function, '__qualname__', function)!s}, which would drop it.{hint}")


def unwrap_parallel(model):
    """``nn.DataParallel`` / ``DistributedDataParallel`` -> the model inside: it runs replicas in other threads,
    where the library's hooks cannot follow, and the explanation needs one plain forward pass anyway."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model
