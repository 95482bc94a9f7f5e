"""Inkling2 (model types inkling2_text, inkling2's language model, and inkling2_loop_text / inkling2_loop's language
model): Inkling's layout (:mod:`.inkling`) with gated attention, sink logits, RMS-normalised values, dynamic value
convolutions in the full-attention layers, scaled short convolutions and attention residuals over depth; inkling2_loop
runs a block of its decoder layers several times per forward pass.

Decoder layer (``Inkling2SlidingDecoderLayer`` / ``Inkling2FullDecoderLayer``), with the scaled short convolution
``S(x) = (x + conv(m ⊙ x)) / √(K+1)`` (``Inkling2ShortConvolution``, float32)::

    a  = post_attention_convolution(o_proj(σ(gate_proj h') ⊙ Attn(q, k, v)))
    r  = a (at an attention-residual block boundary) or h + a
    out = r + post_mlp_convolution(mlp(norm(depth_attention(blocks, r))))

where h' are the (per-token) depth-attention mixes of earlier blocks' states, normalised (the full layers give the
query, key and value their own), and the depth attention mixes layers, not tokens. The values::

    sliding: v = ν ⊙ (x + conv(m ⊙ x)) / √(K+1)                x = v_proj(h'_v)
    full:    v = ν ⊙ (x_t + Σ_τ w_{t,τ} m_{t−τ} x_{t−τ}) / √(2K+1)   x = v_proj(h'_v)

with the full layers' taps ``w_{t,τ} = static_weight[τ] + weight_proj(h'_v)_{t, kv head, τ}`` (per row: the output
token t has its own taps, a band that is still linear in x), and ``ν = 1 / √(mean_head(v̂²) + ε)`` the unweighted
RMS norm of each key/value head's convolved value v̂. ν depends on the values themselves; as for every norm of the
library (the gated norms of Mamba-2 and the delta rule, mLSTM's layer norm), its scale is fixed at its real value
(detached), so ``y = H x`` holds exactly at the explained input and ν is a diagonal factor on the value side.

Two layouts of the same value path, recognised from the attention module's structure (:func:`value_path`):

- on the attention itself (transformers 5.23): ``v_proj`` (a linear map), ``v_sconv``, ``v_norm``, ``gate_proj``
  and a linear ``o_proj``; the keys' ``k_sconv`` beside them;
- inside a key/value projection module and a gated output projection (5.24's ``Inkling2KeyValueProjection`` and
  ``Inkling2GatedOutputProjection``): ``v_proj.linear``, ``v_proj.sconv``, ``v_proj.norm``, ``o_proj.gate_proj``,
  ``o_proj.linear``; the keys' ``k_proj.sconv`` beside them.

Any other layout is refused by name (TypeError) when the mixers are located. The key convolutions (either place)
are inside the probabilities, never mixers of their own (:data:`INNER_MIXERS`).

Per query-head channel c = (h, p), the attention's operator is ``A_c = diag(σ(gate)_c) · P_h · diag(ν) · V_c`` over
x (P_h rebuilt from the interface call: sink logits, relative position logits and the full layers' log-scaled
query included; q and k, their L2 clips and k's convolution are inside P, detached), composed, as in Inkling, with
post_attention_convolution's band ``T_d`` on o_proj's output channel d (no residual between them), and the MLP
branch is post_mlp_convolution's band under ``"{i}.post_mlp_convolution"``.

Attention over depth: the block attention residuals (``Inkling2BlockAttentionResidual``; inkling2_loop's
``Inkling2LoopMessageAttentionResidual`` too) are a softmax, at each token, over earlier layers' (or the previous
pass's) outputs at that same token. They mix layers, not tokens: no token operator of theirs exists, and the layer
operators above are over whatever input they give. Those that call transformers' attention interface (5.24) are
listed in :data:`DEPTH_ATTENTION_CLASSES`, which the capture passes through unrecorded.

inkling2_loop: the decoder layers ``loop_layer_index_start`` to ``loop_layer_index_end − 1`` run
``loop_num_passes`` times in a row; every pass after the first restarts from the stream before the loop and
mixes, per token, messages from the previous pass (a depth attention over its blocks) into the layers' query,
key, value and MLP inputs (``Inkling2LoopMessageGate``: ``(1 − f) ⊙ h + g ⊙ message``, f and g from the same
token). Each call of a looped layer is a token mixer of its own, explained by the operator above over the input
that call received; :func:`layer_schedule` gives the decoder-layer index of every call, whose position keys the maps
(HF's numbering of ``output_hidden_states`` for this model).

formulation "hidden": the probabilities alone over the value the interface received, composed with the post-
attention band. Components of "unified": "s6" the probabilities, "conv" the convolutions' taps (off: their scaled
skips), "gate" σ(gate), "norm" ν.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import rules

from ..operators import skip_taps
from . import inkling
from .common import linear_readout, rerun_under_hooks, run

# class-name prefixes of the two model types (transformers' modular copies rename every class of inkling2_loop)
PREFIXES = ("Inkling2", "Inkling2Loop")
CONV_CLASSES = tuple(f"{prefix}ShortConvolution" for prefix in PREFIXES)
DYNAMIC_CONV_CLASSES = tuple(f"{prefix}DynamicShortConvolution" for prefix in PREFIXES)
NORM_CLASSES = tuple(f"{prefix}UnweightedRMSNorm" for prefix in PREFIXES)
# the modules that hold the value path in transformers 5.24's layout
KEY_VALUE_PROJECTION_CLASSES = tuple(f"{prefix}KeyValueProjection" for prefix in PREFIXES)
GATED_OUTPUT_CLASSES = tuple(f"{prefix}GatedOutputProjection" for prefix in PREFIXES)
ATTENTION_CLASSES = tuple(f"{prefix}{kind}Attention" for prefix in PREFIXES for kind in ("Sliding", "Full"))
MIXER_CLASSES = (*ATTENTION_CLASSES, *CONV_CLASSES)
# the attentions of the looped model, whose config gives the schedule of its decoder-layer calls
LOOPED_ATTENTION_CLASSES = ("Inkling2LoopSlidingAttention", "Inkling2LoopFullAttention")
# modules that call the attention interface over earlier layers' outputs at each token (mixing layers, not tokens):
# the capture does not record their calls as token attention
DEPTH_ATTENTION_CLASSES = (*(f"{prefix}BlockAttentionResidual" for prefix in PREFIXES),
                           "Inkling2LoopMessageAttentionResidual")
CONSUMES_ATTENTION = ATTENTION_CLASSES
# the key and value convolutions, in either layout: inside the attention's operator, not mixers of their own
INNER_MIXERS = {name: ("k_sconv", "v_sconv", "k_proj.sconv", "v_proj.sconv") for name in ATTENTION_CLASSES}
BRANCH_CONVOLUTIONS = {"post_attention_convolution": "self_attn", "post_mlp_convolution": None}


@dataclass(frozen=True)
class ValuePath:
    """The modules of an Inkling2 attention's value path and output, wherever its layout keeps them.

    ``projection``: x = projection(value input), (B, L, Hkv·d); ``convolution``: the value convolution (static or
    dynamic); ``norm``: the unweighted RMS norm of the convolved values; ``gate``: the gate's pre-activation
    projection of the query input, (B, L, Hq·d); ``output``: the output projection after the gate.
    """

    projection: nn.Module
    convolution: nn.Module
    norm: nn.Module
    gate: nn.Module
    output: nn.Module


def _class_name(module) -> str:
    return type(module).__name__


def value_path(module, layer=None, name=None) -> ValuePath:
    """Find the value path of an Inkling2 attention from its structure: on the attention (``v_proj``, ``v_sconv``,
    ``v_norm``, ``gate_proj``, ``o_proj``) or inside its key/value and gated output projections (``v_proj.linear``,
    ``v_proj.sconv``, ``v_proj.norm``, ``o_proj.gate_proj``, ``o_proj.linear``).

    Raises:
        TypeError: neither layout, or a part of an unknown class (named with the model type).
    """
    value, output = getattr(module, "v_proj", None), getattr(module, "o_proj", None)
    path = None
    if isinstance(getattr(module, "v_sconv", None), nn.Module):
        path = ValuePath(value, module.v_sconv, getattr(module, "v_norm", None), getattr(module, "gate_proj", None),
                         output)
    elif _class_name(value) in KEY_VALUE_PROJECTION_CLASSES and _class_name(output) in GATED_OUTPUT_CLASSES:
        path = ValuePath(getattr(value, "linear", None), getattr(value, "sconv", None), getattr(value, "norm", None),
                         getattr(output, "gate_proj", None), getattr(output, "linear", None))
    known = path is not None and all(isinstance(part, nn.Module) for part in
                                     (path.projection, path.gate, path.output)) \
        and _class_name(path.convolution) in (*CONV_CLASSES, *DYNAMIC_CONV_CLASSES) \
        and _class_name(path.norm) in NORM_CLASSES
    if not known:
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        where = "" if layer is None else f"layer {layer} ({name}) "
        raise TypeError(
            f"mamba_captum: {where}is a {_class_name(module)}{f' (model type {model_type!r})' if model_type else ''} "
            "whose value path the Inkling2 adapter does not recognise (known: v_proj, v_sconv, v_norm, gate_proj and "
            "o_proj on the attention; or v_proj.linear, v_proj.sconv, v_proj.norm, o_proj.gate_proj and "
            "o_proj.linear); its operator would be a guess. Please report the model class and config.")
    return path


def follows(layer: int, name: str, module):
    """As :func:`.inkling.follows` for the branch convolutions; an attention's value path is checked here, when the
    mixers are located, so that an unknown layout is refused before anything runs.

    Raises:
        TypeError: a branch convolution at an unknown place, or an attention whose layout is not recognised.
    """
    if _class_name(module) in ATTENTION_CLASSES:
        value_path(module, layer, name)
        return None
    return inkling.follows(layer, name, module, places=BRANCH_CONVOLUTIONS, classes=CONV_CLASSES)


def layer_schedule(module, count: int) -> list[int] | None:
    """The decoder-layer index of each decoder-layer call of one forward pass, for a looped model (inkling2_loop:
    layers ``loop_layer_index_start .. loop_layer_index_end − 1`` run ``loop_num_passes`` times in a row, between the
    layers before and after them), read from the config of ``module`` when it is one of inkling2_loop's attentions;
    None otherwise (each layer runs once, in order; an Inkling2 config with stray loop keys does not loop)."""
    if _class_name(module) not in LOOPED_ATTENTION_CLASSES:
        return None
    config = module.config
    start, end = config.loop_layer_index_start, config.loop_layer_index_end
    return [*range(start), *(list(range(start, end)) * config.loop_num_passes), *range(end, count)]


def _value_taps(path: ValuePath, module, value_input, work_dtype):
    """(x, taps, scale): the value projection (B, L, Hkv, d) and the value convolution's taps with its skip, scale
    included: static (Hkv, d, K) in the sliding layers, per row (B, L, Hkv, d, K) in the full ones."""
    kv_heads, head_dim = module.num_key_value_heads, module.head_dim
    batch, length, _ = value_input.shape
    x = run(path.projection, value_input).to(work_dtype).view(batch, length, kv_heads, head_dim)
    conv = path.convolution
    width = conv.conv_kernel_size
    if _class_name(conv) in DYNAMIC_CONV_CLASSES:
        scale = 1.0 / math.sqrt(2 * width + 1)
        dynamic = run(conv.weight_proj, value_input).to(work_dtype).view(batch, length, kv_heads, 1, width)
        static = conv.static_weight.to(work_dtype).T.reshape(kv_heads, head_dim, width)
        by_lag = static + dynamic  # (B, L, Hkv, d, K): [..., τ] weighs the token τ back
        return x, skip_taps(by_lag.flip(-1), scale), scale
    scale = 1.0 / math.sqrt(width + 1)
    taps = skip_taps(conv.conv1d.weight[:, 0, :].to(work_dtype), scale).view(kv_heads, head_dim, width)
    return x, taps, scale


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype, attention=None):
    """Rebuild one of the layer's mixers from its recorded input (and, for the attention, its interface call).

    Returns:
        (operator, rebuilt_output): for the attention a :class:`HeadOperator` (o_proj's output, (B, L, D)), which
        the engine composes with post_attention_convolution's band; for a branch convolution its band operator.
    """
    module = call.located.module
    if _class_name(module) in CONV_CLASSES:
        return inkling.branch_conv(call, components, work_dtype, scale=1.0 / math.sqrt(module.conv_kernel_size + 1))
    path = value_path(module)
    hidden = call.hidden_states
    batch, length, _ = hidden.shape
    value_input = call.options.get("value_hidden_states", hidden)  # the value's own input, where it has one
    x, taps, scale = _value_taps(path, module, value_input, work_dtype)
    gate = torch.sigmoid(run(path.gate, hidden).to(work_dtype)).view(batch, length, module.num_heads,
                                                                      module.head_dim)
    eps = path.norm.eps

    def norm(values):  # the unweighted RMS norm's scale, per token and key/value head
        return torch.rsqrt(values.square().mean(-1, keepdim=True) + eps)

    operator, attended = inkling.attention_operator(
        call, formulation, components, work_dtype, attention, x=x, taps=taps, scale=scale,
        mask=inkling.conv_mask(call, work_dtype), readout_proj=linear_readout(path.output), gate=gate, norm=norm)
    output_dtype = next((p.dtype for p in path.output.parameters() if p.is_floating_point()), attended.dtype)
    rebuilt = run(path.output, attended.reshape(batch, length, -1).to(output_dtype))
    return operator, rebuilt


def scaled_conv_rule(module, x: torch.Tensor, mask, work_dtype: torch.dtype) -> torch.Tensor:
    """An ``Inkling2ShortConvolution`` ``(x + conv(m ⊙ x)) / √(K+1)`` in the work dtype: linear in x."""
    return inkling.short_conv_rule(module, x, mask, work_dtype) / math.sqrt(module.conv_kernel_size + 1)


def dynamic_conv_rule(module, x: torch.Tensor, dynamic_input: torch.Tensor, mask, work_dtype) -> torch.Tensor:
    """An ``Inkling2DynamicShortConvolution`` ``(x_t + Σ_τ w_{t,τ} m_{t−τ} x_{t−τ}) / √(2K+1)``, its per-token taps
    w (static weights + a projection of the dynamic input) detached like a scan's selection: linear in x. (B, L, C)."""
    batch, length, width = x.shape
    kernel, heads = module.conv_kernel_size, module.num_heads
    with torch.no_grad():
        dynamic = module.weight_proj(dynamic_input.detach()).to(work_dtype).view(batch, length, heads, 1, kernel)
        taps = module.static_weight.to(work_dtype).T.view(heads, -1, kernel) + dynamic
    value = x.to(work_dtype)
    masked = value if mask is None else value * mask[:, :, None].to(work_dtype)
    context = F.pad(masked.transpose(1, 2), (kernel - 1, 0))
    windows = context.unfold(-1, kernel, 1).flip(-1).transpose(1, 2).reshape(batch, length, heads, -1, kernel)
    out = (windows * taps).sum(-1).reshape(batch, length, width)
    return (out + value) / math.sqrt(2 * kernel + 1)


def lrp_refusal(module) -> str | None:
    """Why MambaLRP's rules do not cover this Inkling2 mixer as loaded (transformers 5.23's layout), or None."""
    if _class_name(module) in CONV_CLASSES:
        return None
    if _class_name(getattr(module, "v_proj", None)) not in KEY_VALUE_PROJECTION_CLASSES or \
            _class_name(getattr(module, "o_proj", None)) not in GATED_OUTPUT_CLASSES:
        return (f"MambaLRP's rules for {type(module).__name__} are written for transformers 5.24's layout "
                "(Inkling2KeyValueProjection, Inkling2GatedOutputProjection); this one is an older release's.")
    return None


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The mixer's output under MambaLRP's rules, a differentiable function of its inputs.

    - A branch convolution (``post_attention_convolution``, ``post_mlp_convolution``): :func:`scaled_conv_rule`.
    - The attention (transformers 5.24's layout: ``Inkling2KeyValueProjection``, ``Inkling2GatedOutputProjection``):
      its own forward re-run with the graph on, HF's attention interface answered by the engine's P̄ v (P from the
      detached queries and keys, the relative and sink logits detached with it), and inside the value path: the
      convolution by :func:`scaled_conv_rule` or :func:`dynamic_conv_rule` (taps detached), the values' unweighted
      RMS norm with its normaliser detached (the identity rule), the output gate σ(gate_proj h) detached (signal
      takes all: ``sigmoid_gates="half"`` cannot reach it, and is refused) and the gated output projection computed
      in the work dtype (HF gates in float32). Linear in the value input.

    Needs the layer's own keywords (``call.options``), as MambaLRP's engine records them. (B, L, D_model)."""
    module = call.located.module
    options = dict(call.options)
    if options.get("cache") is not None:
        raise NotImplementedError("mamba_captum: MambaLRP explains whole sequences: call Inkling2 with "
                                  "use_cache=False (its rule re-runs the layer, which would write the cache twice).")
    if _class_name(module) in CONV_CLASSES:
        return scaled_conv_rule(module, call.hidden_states, options.get("conv_mask"), work_dtype)
    if rules.sigmoid_gate_rule() != "signal":
        raise NotImplementedError(f"mamba_captum: the sigmoid output gate of {type(module).__name__} sits inside its "
                                  "output projection's forward, where only sigmoid_gates='signal' can be applied.")
    refusal = lrp_refusal(module)
    if refusal:
        raise NotImplementedError(f"mamba_captum: {refusal}")
    if "attention_mask" not in options:
        raise ValueError("mamba_captum: Inkling2's MambaLRP rule needs the layer's attention mask as it got it.")

    def convolved(conv, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        mask = kwargs.get("conv_mask")
        if _class_name(conv) in DYNAMIC_CONV_CLASSES:
            dynamic = args[1] if len(args) > 1 else kwargs["dynamic_input"]
            return dynamic_conv_rule(conv, x, dynamic, mask, work_dtype).to(x.dtype)
        return scaled_conv_rule(conv, x, mask, work_dtype).to(x.dtype)

    def normalised(norm, args, output):  # the values' unweighted RMS norm: its normaliser detached
        x = args[0]
        return rules.rms_norm_rule(x.to(work_dtype), output.to(work_dtype)).to(x.dtype)

    def gated_output(projection, args, output):  # linear(attn ⊙ σ(gate_proj h)̄), in the work dtype
        attn, hidden = args
        with torch.no_grad():
            gate = torch.sigmoid(projection.gate_proj(hidden).float()).to(work_dtype)
        linear = projection.linear
        out = F.linear(attn.to(work_dtype) * gate, linear.weight.to(work_dtype),
                       None if linear.bias is None else linear.bias.to(work_dtype))
        return out.to(attn.dtype)

    detached = lambda _, args, out: out.detach()  # noqa: E731
    handles = [module.k_proj.sconv.register_forward_hook(convolved, with_kwargs=True),
               module.v_proj.sconv.register_forward_hook(convolved, with_kwargs=True),
               module.v_proj.norm.register_forward_hook(normalised),
               module.relative_position_bias.register_forward_hook(detached),
               module.sink_proj.register_forward_hook(detached),
               module.o_proj.register_forward_hook(gated_output)]
    return rerun_under_hooks(module, call.hidden_states, options, handles, work_dtype)
