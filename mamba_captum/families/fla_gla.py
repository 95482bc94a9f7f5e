"""flash-linear-attention's gated linear attention: ``GatedLinearAttention`` (model type ``gla``).

Forward (fla 0.6.0, ``fla/layers/gla.py``): q, k, v = the projections of h (optionally each through a SiLU short
conv); ``gk = logsigmoid(gk_proj h) / gate_logit_normalizer`` (clamped below at ``clamp_min`` when set), one log decay
per key channel; key / value heads repeated for ``num_kv_heads``; an optional feature map on q and k;
``o = gla(q, k, v, gk)``: S_t = diag(exp(gk_t)) S_{t−1} + k_t v_tᵀ, o_t = K^−½ S_tᵀ q_t; then the RMS norm over each
head's value channels and the output gate ``swish(g_proj h)`` (fused or not), ``o_proj``.

hidden:  α_h[t, s] = K^−½ Σ_k q_t,k k_s,k exp(Γ_t,k − Γ_s,k)  (s ≤ t; Γ the cumulative gk)  over v (after its conv).
unified: H_c = diag(ν_c · swish(g_c)) · α_h · diag(σ(pre_c) · m) · M_c  over v before its conv (without a conv:
         diag(ν_c · swish(g_c)) · α_h · diag(m)).
q, k and the decays come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.gated_linear import gated_linear_chunked
from ..operators import GatedLinearCore, masked_tokens
from ..rules import silu_rule
from .common import run
from .fla_heads import head_lrp, head_operator, short_conv

MIXER_CLASSES = ("GatedLinearAttention",)
INNER_MIXERS = {"GatedLinearAttention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def _projected(mixer, h, name, conv_name, dtype=None):
    """(before the conv, the conv's pre-activation or None, after the conv) of one projection."""
    x = run(getattr(mixer, name), h)
    if not mixer.use_short_conv:
        return x, None, x
    pre, out = short_conv(getattr(mixer, conv_name), x, dtype)
    return x, pre, out


def gate_function(mixer):
    """The output gate's activation of a GLA or RetNet layer (fla's fused norm uses swish), float64."""
    if mixer.fuse_norm_and_gate:
        return F.silu
    name = getattr(mixer.gate_fn, "__name__", "")
    # a function, or a module of transformers' ACT2FN (RetNet's unfused gate)
    if mixer.gate_fn in (F.silu,) or name in ("swish", "silu", "SwishFunction") or type(mixer.gate_fn) is nn.SiLU:
        return F.silu
    if name in ("sigmoid",) or mixer.gate_fn is torch.sigmoid or type(mixer.gate_fn) is nn.Sigmoid:
        return torch.sigmoid
    raise NotImplementedError(f"mamba_captum: the output gate {mixer.gate_fn!r} of {type(mixer).__name__} is not a "
                              "known activation.")


def _head_values(mixer, v):
    """v (B, L, H_kv·P) -> (B, L, H, P), the key / value heads repeated for the query heads as fla does."""
    return v.reshape(*v.shape[:2], -1, mixer.head_v_dim).repeat_interleave(mixer.num_kv_groups, dim=2)


def _core(mixer, h, mask, work_dtype):
    """(the :class:`GatedLinearCore` of the layer's op, gk (B, L, H, K) float64), detached: q, k after their convs
    (keys zeroed at the pads: fla drops pads, and a conv bias would give them keys), key heads repeated, the feature
    map; gk = logsigmoid(gk_proj h) / normaliser, clamped."""
    batch, length, _ = h.shape
    key_dim, groups = mixer.head_k_dim, mixer.num_kv_groups
    with torch.no_grad():
        q = _projected(mixer, h, "q_proj", "q_conv1d")[2]
        k = masked_tokens(_projected(mixer, h, "k_proj", "k_conv1d")[2], mask)
        gk = F.logsigmoid(run(mixer.gk_proj, h).double()) / mixer.gate_logit_normalizer
        if mixer.clamp_min is not None:
            gk = torch.clamp_min(gk, mixer.clamp_min)
        split = lambda t: t.reshape(batch, length, -1, key_dim)  # noqa: E731
        q = split(q)
        k, gk = (split(t).repeat_interleave(groups, dim=2) for t in (k, gk))
        if mixer.feature_map_fn is not None:
            q, k = mixer.feature_map_fn(q), mixer.feature_map_fn(k)
        core = GatedLinearCore(q.to(work_dtype), k.to(work_dtype), gk, key_dim ** -0.5)
    return core, gk


def _checked_input(call):
    """The layer's input h (B, L, D), pads zeroed, after refusing packed sequences."""
    if call.options.get("cu_seqlens") is not None:
        raise NotImplementedError("mamba_captum: a GLA layer called on packed sequences (cu_seqlens); pass a padded "
                                  "batch with attention_mask instead.")
    return masked_tokens(call.hidden_states, call.attention_mask)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules, a differentiable function of ``call.hidden_states``: the
    projections and the value conv linear (its bias a constant), the conv's SiLU by the identity rule (σ(pre)
    detached), the core α (q, k, the decays: the layer's selection) detached, the RMS norm's ν detached, the output
    gate swish(g) by the identity and half rules (a sigmoid gate: :func:`mamba_captum.rules.sigmoid_gate`).
    (B, L, D), float64."""
    mixer = call.located.module
    h = _checked_input(call)
    core, _ = _core(mixer, h, call.attention_mask, work_dtype)
    value = run(mixer.v_proj, h).to(work_dtype)
    if mixer.use_short_conv:
        value = silu_rule(short_conv(mixer.v_conv1d, value, work_dtype)[0])
    values = _head_values(mixer, masked_tokens(value, call.attention_mask))
    gate_input, activation = None, None
    if mixer.use_output_gate:
        gate_input = run(mixer.g_proj, h)
        activation = "swish" if gate_function(mixer) is F.silu else "sigmoid"
    norm = mixer.g_norm_swish_gate if mixer.use_output_gate and mixer.fuse_norm_and_gate else mixer.g_norm
    return head_lrp(call, work_dtype, core=core, values=values, gate_input=gate_input, gate_activation=activation,
                    norm=norm, out_proj=mixer.o_proj, heads=mixer.num_heads, head_dim=mixer.head_v_dim)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    if mixer.use_short_conv and mixer.v_conv1d.bias is not None and formulation == "unified":
        raise NotImplementedError("mamba_captum: the unified operator of a GLA layer whose value conv has a bias is "
                                  "not linear in the values; use formulation='hidden'.")
    h = _checked_input(call)
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    value_pre, conv_pre, v = _projected(mixer, h, "v_proj", "v_conv1d")
    v = _head_values(mixer, masked_tokens(v, call.attention_mask))
    if mixer.num_kv_groups > 1 and formulation == "unified" and mixer.use_short_conv:
        raise NotImplementedError("mamba_captum: the unified operator of a GLA layer with num_kv_heads < num_heads and "
                                  "a value conv; use formulation='hidden'.")
    core, gk = _core(mixer, h, call.attention_mask, work_dtype)
    scale = key_dim ** -0.5
    values = v.to(work_dtype)
    output, _ = gated_linear_chunked(core.q.double(), core.k.double(), values.double(), gk, scale=scale)
    if mixer.use_output_gate:
        gate = gate_function(mixer)(run(mixer.g_proj, h).double()).reshape(batch, length, heads, value_dim)
        norm = mixer.g_norm_swish_gate if mixer.fuse_norm_and_gate else mixer.g_norm
    else:
        gate, norm = None, mixer.g_norm
    taps = mixer.v_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                         values=values, output=output, gate=gate, norm=norm, out_proj=mixer.o_proj,
                         value_pre=value_pre if mixer.use_short_conv else None, conv_pre=conv_pre, taps=taps)
