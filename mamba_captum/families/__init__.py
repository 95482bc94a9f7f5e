"""Family adapters: which modules of an HF model mix tokens, and how to rebuild each one's operator.

An adapter module exposes ``MIXER_CLASSES`` (the HF class names it handles) and
``rebuild(call, formulation, components) -> operator`` (see :mod:`mamba_captum.operators`). Adapters know nothing
of the explanation methods; the methods know nothing of the families.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import mamba, mamba2

ADAPTERS = {name: adapter for adapter in (mamba, mamba2) for name in adapter.MIXER_CLASSES}
SUPPORTED_MIXERS = tuple(sorted(ADAPTERS))

# Token mixers of transformers that are recognised but have no adapter yet: they must not be silently skipped.
KNOWN_UNSUPPORTED = (
    "RwkvSelfAttention",
    "RecurrentGemmaRecurrentBlock",
    "Lfm2ShortConv",
    "Qwen3NextGatedDeltaNet",
    "KimiLinearDeltaAttention",
)
COMPONENTS = ("s6", "gate", "act", "conv", "norm")


@dataclass(eq=False)
class LocatedMixer:
    """An SSM mixer found in decoder layer ``layer`` at module path ``name``."""

    layer: int
    name: str
    module: nn.Module
    adapter: object


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder-layer list (``backbone.layers``, ``model.layers``, ...): the shallowest ModuleList
    named ``layers`` or ``blocks``."""
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks") and len(module):
            depth = name.count(".")
            if best is None or depth < best[0]:
                best = (depth, module)
    if best is None:
        raise TypeError(
            f"mamba_captum: {type(model).__name__} has no decoder-layer list (a ModuleList named 'layers' or "
            f"'blocks'); pass a transformers model with one of these mixers: {', '.join(SUPPORTED_MIXERS)}.")
    return best[1]


def _is_unsupported_mixer(module: nn.Module) -> bool:
    name = type(module).__name__
    if name in ADAPTERS:
        return False
    if name in KNOWN_UNSUPPORTED:
        return True
    # Any other selective-SSM-like module (a learned A_log and a Mixer-ish name) is a variant we cannot vouch for.
    return hasattr(module, "A_log") and any(key in name for key in ("Mixer", "Mamba", "SSM", "Ssm"))


def locate(model: nn.Module) -> tuple[nn.ModuleList, list[LocatedMixer]]:
    """Find the decoder layers and every supported SSM mixer in them.

    Raises:
        TypeError: a token mixer without an adapter is present (its class is named), or no mixer at all.
    """
    layers = decoder_layers(model)
    found: list[LocatedMixer] = []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if _is_unsupported_mixer(module):
                raise TypeError(
                    f"mamba_captum: layer {index} uses the token mixer {type(module).__name__}, which is not "
                    f"supported yet. Supported mixers: {', '.join(SUPPORTED_MIXERS)}.")
            adapter = ADAPTERS.get(type(module).__name__)
            if adapter is not None:
                found.append(LocatedMixer(index, f"{index}.{name}" if name else str(index), module, adapter))
    if not found:
        raise TypeError(
            f"mamba_captum: {type(model).__name__} contains none of the supported token mixers "
            f"({', '.join(SUPPORTED_MIXERS)}).")
    return layers, found


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
