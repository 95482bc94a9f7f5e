"""The registry of family adapters: which adapter module handles which mixer class, what an adapter provides
(:class:`Adapter`, its contract as code), and the loading of an adapter when a model first needs it.

The registry names the classes of each family without importing its adapter, so that ``import mamba_captum``
imports no adapter and a model loads only its own families. Loading an adapter checks its module against the
contract; a missing or mistyped piece is an :class:`AdapterContractError` naming the adapter and the piece.
"""
from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import ModuleType

# adapter module of mamba_captum.families -> the transformers (or library) mixer classes it handles, as the module's
# MIXER_CLASSES says (checked on load)
FAMILY_MIXERS: dict[str, tuple[str, ...]] = {
    "mamba": ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer"),
    "mamba2": ("Mamba2Mixer", "BambaMixer", "Zamba2MambaMixer", "NemotronHMamba2Mixer", "FalconH1Mixer",
               "GraniteMoeHybridMambaLayer"),
    "rwkv": ("RwkvSelfAttention",),
    "recurrent_gemma": ("RecurrentGemmaRecurrentBlock",),
    "vim": ("VimMixer",),
    "gated_deltanet": ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                       "Qwen4ExpTextGatedDeltaNet", "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet"),
    "kda": ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention", "Glm5NextTextLinearAttention"),
    "lightning": ("MiniMaxLightningAttention",),
    "mlstm": ("xLSTMLayer", "mLSTMLayer"),
    "short_conv": ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
    "zamba": ("ZambaMambaMixer",),
    "conv_attention": ("ZayaAttention",),
    "vision_short_conv": ("Lfm3VlVisionShortConv",),
    "vmamba": ("SS2D",),
    "mambaout": ("GatedConvBlock",),
    "efficientvim": ("HSMSSD", "ConvLayer2d"),
    "mambavision": ("MambaVisionMixer", "MambaVisionAttention", "MambaVisionConvBlock"),
    "packed_attention": ("Lfm3VlVisionAttention",),
    "inkling": ("InklingAttention", "InklingShortConvolution"),
    # flash-linear-attention's layers (fla.layers), one adapter each (docs/families/fla.md)
    "fla_gla": ("GatedLinearAttention",),
    "fla_retnet": ("MultiScaleRetention",),
    "fla_hgrn": ("HGRNAttention",),
    "fla_hgrn2": ("HGRN2Attention",),
    "fla_lightnet": ("LightNetAttention",),
    "fla_linear_attn": ("LinearAttention",),
    "fla_rodimus": ("RodimusAttention",),
    "fla_gsa": ("GatedSlotAttention",),
    "fla_abc": ("ABCAttention",),
    "fla_raven": ("Raven",),
    "fla_mesa_net": ("MesaNet",),
    "fla_cyfa": ("CyclicFlowAttention",),
    "fla_delta_net": ("DeltaNet",),
    "fla_gated_deltanet": ("GatedDeltaNet",),
    "fla_kda": ("KimiDeltaAttention",),
    "fla_comba": ("Comba",),
    "fla_gated_deltaproduct": ("GatedDeltaProduct",),
    "fla_precond_gated_deltanet": ("PrecondGatedDeltaNet",),
    "fla_precond_kda": ("PrecondKDA",),
    "fla_mom": ("MomAttention",),
    "fla_rwkv7": ("RWKV7Attention",),
    "fla_rwkv6": ("RWKV6Attention",),
    "fla_mamba": ("Mamba",),
    "fla_mamba2": ("Mamba2",),
    "fla_log_linear_mamba2": ("LogLinearMamba2",),
    "inkling2": ("Inkling2SlidingAttention", "Inkling2FullAttention", "Inkling2LoopSlidingAttention",
                 "Inkling2LoopFullAttention", "Inkling2ShortConvolution", "Inkling2LoopShortConvolution"),
}
# adapter module -> the modules that call transformers' attention interface over earlier layers' outputs at each
# token (they mix layers, not tokens; the module's DEPTH_ATTENTION_CLASSES, checked on load). Known before any adapter
# loads, since the attention interface is patched for every model.
FAMILY_DEPTH_ATTENTION: dict[str, tuple[str, ...]] = {
    "inkling2": ("Inkling2BlockAttentionResidual", "Inkling2LoopBlockAttentionResidual",
                 "Inkling2LoopMessageAttentionResidual"),
}

MIXER_FAMILIES: dict[str, str] = {name: family for family, names in FAMILY_MIXERS.items() for name in names}
SUPPORTED_MIXERS: tuple[str, ...] = tuple(sorted(MIXER_FAMILIES))
DEPTH_ATTENTION: frozenset[str] = frozenset(name for names in FAMILY_DEPTH_ATTENTION.values() for name in names)


class AdapterContractError(TypeError):
    """An adapter module does not provide what :class:`Adapter` describes (a bug of the library, not of the model)."""


@dataclass(frozen=True, eq=False)
class Adapter:
    """What a family adapter provides: the pieces of its module ``mamba_captum.families.<family>``, under the names the
    module gives them (required: ``MIXER_CLASSES``, ``rebuild``, and ``lrp`` or ``LRP_UNSUPPORTED``).

    Attributes:
        MIXER_CLASSES: the class names of the token mixers it explains.
        rebuild: ``rebuild(call, formulation, components, work_dtype[, attention]) -> (operator, rebuilt output)``,
            the mixer's operator from one recorded call (:mod:`mamba_captum.operators`).
        lrp: ``lrp(call, work_dtype) -> tensor``, the mixer's output under MambaLRP's rules as a differentiable
            function of ``call.hidden_states``; None where the family has no rules, with ``LRP_UNSUPPORTED`` the reason.
        follows: ``follows(layer, name, module) -> name | None``: the mixer of the same decoder layer whose output is
            this one's input (composed mixers, Inkling); None: every mixer stands on its own residual branch.
        layer_schedule: ``layer_schedule(module, N) -> list[int] | None``, a looped model's decoder-layer calls.
        preserved_state: ``preserved_state(model)``, a context manager undoing what a forward changes on the model's
            own modules (RWKV's weight rescaling, RecurrentGemma's cached states).
        claims: ``claims(module) -> bool``: whether a module of one of MIXER_CLASSES mixes tokens and is the
            adapter's to explain (None: every one is; a conv class whose 1×1 members mix only channels says no).
        lrp_refusal: ``lrp_refusal(module) -> str | None``, why this mixer as loaded has no rules (a layout of
            another transformers release), or None; MambaLRP refuses the model when it plans it, not mid-call.
        INNER_MIXERS: class name -> submodule paths that the mixer's operator already explains.
        CONSUMES_ATTENTION: True, or the class names, whose operator is built from attention-interface calls.
        ATTENTION_SEGMENTS: one interface call per segment of a packed sequence (all of them make the operator).
        IGNORES_ATTENTION_MASK: the mixer ignores ``attention_mask`` in transformers (left padding is refused).
        NONCAUSAL: every token sees every other (vision mixers).
        DEPTH_ATTENTION_CLASSES: modules calling the attention interface over layers, not tokens.
    """

    module: ModuleType
    MIXER_CLASSES: tuple[str, ...]
    rebuild: Callable
    lrp: Callable | None = None
    LRP_UNSUPPORTED: str | None = None
    lrp_refusal: Callable | None = None
    follows: Callable | None = None
    layer_schedule: Callable | None = None
    preserved_state: Callable | None = None
    claims: Callable | None = None
    INNER_MIXERS: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    CONSUMES_ATTENTION: bool | tuple[str, ...] = False
    ATTENTION_SEGMENTS: bool = False
    IGNORES_ATTENTION_MASK: bool = False
    NONCAUSAL: bool = False
    DEPTH_ATTENTION_CLASSES: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The adapter module's name (``mamba_captum.families.mamba``)."""
        return self.module.__name__

    def __reduce__(self):  # copied and pickled by name: the adapter of a family is one object per process
        return load_adapter, (self.name.rpartition(".")[2],)

    def __repr__(self):
        return f"Adapter({self.name})"


def _check_type(family: str, piece: str, value, expected) -> None:
    ok = {
        "MIXER_CLASSES": lambda v: isinstance(v, tuple) and v and all(isinstance(n, str) for n in v),
        "LRP_UNSUPPORTED": lambda v: v is None or (isinstance(v, str) and v),
        "INNER_MIXERS": lambda v: isinstance(v, Mapping) and all(
            isinstance(k, str) and isinstance(p, tuple) for k, p in v.items()),
        "CONSUMES_ATTENTION": lambda v: isinstance(v, bool) or (
            isinstance(v, tuple) and all(isinstance(n, str) for n in v)),
        "DEPTH_ATTENTION_CLASSES": lambda v: isinstance(v, tuple) and all(isinstance(n, str) for n in v),
    }.get(piece, lambda v: isinstance(v, bool) if expected == "bool" else (v is None or callable(v)))
    if not ok(value):
        raise AdapterContractError(
            f"mamba_captum: the adapter mamba_captum.families.{family} gives {piece} = {value!r}, which is not "
            f"{expected} (the contract: mamba_captum.families.registry.Adapter).")


def adapter_from_module(family: str, module: ModuleType) -> Adapter:
    """Check an adapter module against the contract and describe it.

    Raises:
        AdapterContractError: a required piece is missing, a piece has the wrong type, or the module's classes are not
            the registry's (naming the adapter and the piece).
    """
    pieces = {}
    for piece in fields(Adapter):
        if piece.name == "module":
            continue
        if hasattr(module, piece.name):
            _check_type(family, piece.name, getattr(module, piece.name), piece.type)
            pieces[piece.name] = getattr(module, piece.name)
        elif piece.name in ("MIXER_CLASSES", "rebuild"):
            raise AdapterContractError(
                f"mamba_captum: the adapter mamba_captum.families.{family} has no {piece.name} (required by the "
                "contract: mamba_captum.families.registry.Adapter).")
    if "lrp" not in pieces and "LRP_UNSUPPORTED" not in pieces:
        raise AdapterContractError(
            f"mamba_captum: the adapter mamba_captum.families.{family} has neither lrp (MambaLRP's rules) nor "
            "LRP_UNSUPPORTED (the reason it has none).")
    rebuild_arity = len(inspect.signature(pieces["rebuild"]).parameters)
    if rebuild_arity < 4:
        raise AdapterContractError(
            f"mamba_captum: mamba_captum.families.{family}.rebuild takes {rebuild_arity} arguments; the contract is "
            "rebuild(call, formulation, components, work_dtype[, attention]).")
    for piece, registered in (("MIXER_CLASSES", FAMILY_MIXERS.get(family)),
                              ("DEPTH_ATTENTION_CLASSES", FAMILY_DEPTH_ATTENTION.get(family, ()))):
        if tuple(pieces.get(piece, ())) != tuple(registered or ()):
            raise AdapterContractError(
                f"mamba_captum: the adapter mamba_captum.families.{family} gives {piece} = "
                f"{pieces.get(piece, ())!r}, but the registry (mamba_captum/families/registry.py) lists "
                f"{registered!r}: update the registry with the adapter.")
    return Adapter(module=module, **pieces)


_loaded: dict[str, Adapter] = {}
_loading = threading.Lock()


def load_adapter(family: str) -> Adapter:
    """The adapter of ``family`` (a module name of :mod:`mamba_captum.families`), imported and checked on first use."""
    adapter = _loaded.get(family)
    if adapter is None:
        if family not in FAMILY_MIXERS:
            raise KeyError(f"mamba_captum: no adapter named {family!r}; the adapters are {sorted(FAMILY_MIXERS)}.")
        with _loading:
            adapter = _loaded.get(family)
            if adapter is None:
                module = importlib.import_module(f"{__package__}.{family}")
                adapter = _loaded[family] = adapter_from_module(family, module)
    return adapter


def adapter_for(class_name: str) -> Adapter | None:
    """The adapter that explains mixers of class ``class_name``, or None for a class no adapter handles."""
    family = MIXER_FAMILIES.get(class_name)
    return None if family is None else load_adapter(family)


def all_adapters() -> dict[str, Adapter]:
    """Class name -> adapter for every supported mixer class (loads every adapter)."""
    return {name: load_adapter(family) for name, family in MIXER_FAMILIES.items()}
