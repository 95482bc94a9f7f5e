"""Family adapters: which modules of an HF model mix tokens, and how to rebuild each one's operator.

One adapter module per family (``mamba_captum.families.mamba`` ...), loaded when a model first needs it
(:mod:`.registry`: which class is whose, and :class:`~.registry.Adapter`, what an adapter provides, checked on load):
``MIXER_CLASSES`` (the HF class names it handles), ``rebuild(call, formulation, components, work_dtype)`` (the
operator, see :mod:`mamba_captum.operators`) and, for MambaLRP, ``lrp(call, work_dtype)`` (the mixer's output under the
LRP rules as a differentiable function of ``call.hidden_states``) or ``LRP_UNSUPPORTED`` (the reason it has none). The
rules of the modules around the mixers are in :mod:`.lrp_plan`. Adapters know nothing of the explanation methods; the
methods know nothing of the families.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..checks import check_continuation
from . import catalogue
from .registry import (DEPTH_ATTENTION, MIXER_FAMILIES, SUPPORTED_MIXERS, Adapter, AdapterContractError, adapter_for,
                       all_adapters, load_adapter)

# Token mixers of transformers that are recognised and known not to fit any operator: class name -> why (the message
# names the class and the model type). None at present; a class listed here is refused by name, never skipped.
REFUSED: dict[str, str] = {}
COMPONENTS = ("s6", "gate", "act", "conv", "norm")


def __getattr__(name):
    # ADAPTERS (class name -> adapter) loads every adapter: built on first use, never by ``import mamba_captum``
    if name == "ADAPTERS":
        return all_adapters()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), "ADAPTERS"})


@dataclass(eq=False)
class LocatedMixer:
    """An SSM mixer found in decoder layer ``layer`` at module path ``name``.

    ``follows``: the ``name`` of the mixer of the same decoder layer whose output is this one's input, with no
    residual connection between them (Inkling's ``attn_sconv`` after ``self_attn``): the two are one token mixer,
    their composition (:class:`mamba_captum.operators.ComposedOperator`). None for a mixer of its own residual
    branch.
    """

    layer: int
    name: str
    module: nn.Module
    adapter: Adapter
    follows: str | None = None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder-layer list (``backbone.layers``, ``model.layers``, ...): the shallowest ModuleList
    named ``layers`` or ``blocks`` in the model's decoder (HF's ``get_decoder()``: the language model of a
    vision-language model such as Qwen3.5 or GLM-5-Next, whose vision tower's ``blocks`` are just as shallow). A
    multi-stage image model (:class:`mamba_captum.layout.StagedLayout`) lists its blocks itself: ``stage_blocks()``,
    every block of every stage in execution order."""
    stage_blocks = getattr(model, "stage_blocks", None)
    if callable(stage_blocks):
        blocks = stage_blocks()
        if not isinstance(blocks, nn.ModuleList) or not len(blocks):
            raise TypeError(f"mamba_captum: {type(model).__name__}.stage_blocks() must return a non-empty "
                            f"nn.ModuleList of the blocks; got {type(blocks).__name__}.")
        return blocks
    root = model
    try:
        decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    except (AttributeError, NotImplementedError, ValueError):  # HF raises for models without a decoder rule
        decoder = None
    if isinstance(decoder, nn.Module) and decoder is not model and any(decoder is m for m in model.modules()):
        root = decoder
    best, lists = None, []
    for name, module in root.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and name.rsplit(".", 1)[-1] in ("layers", "blocks") \
                and len(module):
            depth = name.count(".")
            lists.append((depth, name, module))
            if isinstance(module, nn.ModuleList) and (best is None or depth < best[0]):
                best = (depth, module)
    if lists:
        # a multi-stage model (timm's stages.{i}.blocks) has one block list per stage, all as shallow: taking the
        # first would explain one stage and drop the others; it must list its blocks and stages itself
        shallowest = min(depth for depth, _, _ in lists)
        mixing = [name for depth, name, module in lists if depth == shallowest and any(
            type(m).__name__ in MIXER_FAMILIES for m in module.modules())]
        if len(mixing) > 1:
            raise TypeError(
                f"mamba_captum: {type(model).__name__} mixes tokens in {len(mixing)} block lists ({', '.join(mixing[:4])}"
                f"{' ...' if len(mixing) > 4 else ''}): a multi-stage model, whose stages the library cannot tell "
                "from its modules. Explain the library's copy of it: mamba_captum.vision.from_timm(model) for timm's "
                "EfficientViM and MambaOut (the same weights, checked to give the same logits), or give the model "
                "stage_blocks() and token_layout() (docs/vision.md).")
    if best is None:
        raise TypeError(
            f"mamba_captum: {type(model).__name__} has no decoder-layer list (a ModuleList named 'layers' or "
            f"'blocks'); pass a transformers model with one of these mixers: {', '.join(SUPPORTED_MIXERS)}.")
    return best[1]


# Class-name fragments of token mixers that are not softmax attention (transformers' naming): a module called so
# without an adapter must be refused, not skipped.
MIXER_NAME_FRAGMENTS = ("DeltaNet", "DeltaAttention", "ShortConv", "LightningAttention", "mLSTMLayer", "xLSTMLayer",
                        "Retention")
CONTAINER_NAME_FRAGMENTS = ("DecoderLayer", "Block", "Model", "For")  # layers and models named after their mixer


def is_fla_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of flash-linear-attention's token-mixer layers (a class of ``fla.layers.__all__``, or
    one of fla's model-specific mixers that the catalogue refuses)."""
    cls = type(module)
    if cls.__module__.startswith("fla.") and cls.__name__ in catalogue.FLA_EXCLUDED:
        return True  # a model-specific mixer of fla.models (CAT's attention), refused with its reason
    if not cls.__module__.startswith("fla.layers."):
        return False
    layers = sys.modules.get("fla.layers")
    return layers is not None and cls.__name__ in getattr(layers, "__all__", ())


def claimed(module: nn.Module) -> bool:
    """Whether the registry's adapter for the module's class name is meant for this module: an ``fla_*`` adapter only
    for flash-linear-attention's own classes (mamba-ssm's layers, the official Vim code's included, are also called
    ``Mamba`` / ``Mamba2``)."""
    family = MIXER_FAMILIES.get(type(module).__name__)
    return family is not None and (not family.startswith("fla_") or type(module).__module__.startswith("fla."))


def _is_unsupported_mixer(module: nn.Module) -> bool:
    name = type(module).__name__
    if is_fla_layer(module):  # every fla layer mixes tokens: an adapter explains it, or it is refused
        return name not in MIXER_FAMILIES
    if name in REFUSED or name in catalogue.DECODER_MIXERS:  # known not to fit, whether or not an adapter exists
        return True
    if claimed(module):
        return False
    if any(fragment in name for fragment in MIXER_NAME_FRAGMENTS) \
            and not any(fragment in name for fragment in CONTAINER_NAME_FRAGMENTS):
        return True
    # Any other selective-SSM-like module (a learned A_log and a Mixer-ish name) is a variant we cannot vouch for.
    return hasattr(module, "A_log") and any(key in name for key in ("Mixer", "Mamba", "SSM", "Ssm"))


def locate(model: nn.Module) -> tuple[nn.ModuleList, list[LocatedMixer]]:
    """Find the decoder layers and every supported SSM mixer in them.

    Raises:
        TypeError: a token mixer without an adapter is present (its class is named), or no mixer at all.
    """
    layers = decoder_layers(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    found: list[LocatedMixer] = []
    for index, layer in enumerate(layers):
        inside: list[str] = []  # submodules that a located mixer's adapter explains as part of its own operator
        for name, module in layer.named_modules():
            if any(name == path or name.startswith(path + ".") for path in inside):
                continue
            if _is_unsupported_mixer(module):
                if getattr(module, "bimamba_type", None) is not None:  # the official Vim code's mamba-ssm fork
                    raise TypeError(
                        f"mamba_captum: layer {index} is the official Vim code's Mamba mixer (mamba-ssm fork, "
                        f"bimamba_type={module.bimamba_type!r}). Load its weights into the library's Vim: "
                        "mamba_captum.vision.load_vim(model.state_dict()) (same keys, same function, any device).")
                why = REFUSED.get(type(module).__name__) or catalogue.refusal(type(module).__name__)
                if why is not None:  # known, and known not to fit any operator: say why
                    raise TypeError(
                        f"mamba_captum: layer {index} ({name}) uses the token mixer {type(module).__name__}"
                        f"{f' (model type {model_type!r})' if model_type else ''}, which cannot be explained "
                        f"exactly: {why}.")
                raise TypeError(
                    f"mamba_captum: layer {index} uses the token mixer {type(module).__name__}"
                    f"{f' (model type {model_type!r})' if model_type else ''}, which is not supported yet; please "
                    f"report it. Supported mixers: {', '.join(SUPPORTED_MIXERS)}.")
            adapter = adapter_for(type(module).__name__) if claimed(module) else None
            if adapter is not None and adapter.claims is not None and not adapter.claims(module):
                adapter = None  # a module of the class that mixes no tokens (a 1×1 conv of a conv class)
            if adapter is not None:
                # where the mixer sits in its decoder layer may decide how it composes with the others (Inkling's
                # convolutions after the attention and after the MLP); an adapter refuses a place it does not know
                follows = None if adapter.follows is None else adapter.follows(index, name, module)
                found.append(LocatedMixer(index, f"{index}.{name}" if name else str(index), module, adapter,
                                          None if follows is None else f"{index}.{follows}"))
                inside += [f"{name}.{part}" if name else part
                           for part in adapter.INNER_MIXERS.get(type(module).__name__, ())]
    if not found:
        raise TypeError(
            f"mamba_captum: {type(model).__name__} contains none of the supported token mixers "
            f"({', '.join(SUPPORTED_MIXERS)}).")
    return layers, found


def layer_schedule(decoder_layers: nn.ModuleList, mixers: list[LocatedMixer]) -> list[int]:
    """The decoder-layer index of each decoder-layer call of one forward pass, in execution order: ``0 .. N-1`` for a
    model that runs each layer once; a looped model (inkling2_loop) runs a block of layers several times, as its
    adapter's ``layer_schedule(module, N)`` says. The maps are keyed by the position of the call in this list (HF's
    numbering of ``output_hidden_states``), which is the decoder-layer index for every model without a loop."""
    for located in mixers:
        schedule = located.adapter.layer_schedule
        found = None if schedule is None else schedule(located.module, len(decoder_layers))
        if found is not None:
            return list(found)
    return list(range(len(decoder_layers)))


def parse_components(components, formulation: str) -> frozenset[str]:
    """Normalise ``components=`` (None: all; an iterable of names to keep; or a mapping name -> bool)."""
    if components is None:
        return frozenset(COMPONENTS)
    if formulation != "unified":
        raise ValueError("mamba_captum: components= switches parts of the unified operator; "
                         "use formulation='unified' (the hidden formulation is the S6 part alone).")
    if isinstance(components, str):
        components = (components,)
    if hasattr(components, "items"):
        unknown = set(components) - set(COMPONENTS)
        kept = {name for name in COMPONENTS if components.get(name, True)}
    else:
        components = set(components)
        unknown = components - set(COMPONENTS)
        kept = components
    if unknown:
        raise ValueError(f"mamba_captum: unknown component(s) {sorted(unknown)}; choose from {list(COMPONENTS)}.")
    return frozenset(kept)


def check_forward(mixers: list[LocatedMixer], attention_mask, forward_kwargs: dict):
    """Refuse what the operators cannot describe: continuing a cached prefix, and left padding for families whose
    token mixers ignore ``attention_mask`` (RWKV, RecurrentGemma), where the pads change the real tokens' result.

    Raises:
        ValueError: naming the problem and the fix.
    """
    check_continuation(forward_kwargs)
    if attention_mask is None:
        return
    ignoring = sorted({type(m.module).__name__ for m in mixers if m.adapter.IGNORES_ATTENTION_MASK})
    if not ignoring:
        return
    mask = torch.as_tensor(attention_mask) != 0
    # right padding: once a row has a pad, every later token is a pad too
    left_padded = (mask[:, 1:] & ~mask[:, :-1]).any()
    if bool(left_padded):
        raise ValueError(
            f"mamba_captum: {', '.join(ignoring)} ignores attention_mask in transformers, so left padding changes "
            "what the model computes for the real tokens. Pad on the right (tokenizer.padding_side = 'right'); "
            "the real tokens of a right-padded batch give the unpadded result.")


@contextlib.contextmanager
def preserved_state(model: nn.Module):
    """Undo what a forward pass of the model changes on its own modules, on every exit path: RWKV's in-place
    rescaling of weights on its first eval (or train) forward, and RecurrentGemma's cached recurrent states: each
    adapter's ``preserved_state``, for the families whose mixers the model contains (only those adapters load)."""
    families = sorted({MIXER_FAMILIES[type(m).__name__] for m in model.modules() if claimed(m)})
    with contextlib.ExitStack() as stack:
        for family in families:
            adapter = load_adapter(family)
            if adapter.preserved_state is not None:
                stack.enter_context(adapter.preserved_state(model))
        yield
