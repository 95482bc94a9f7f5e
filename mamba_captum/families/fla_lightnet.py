"""flash-linear-attention's LightNet: ``LightNetAttention`` (model type ``lightnet``).

Forward (fla 0.6.0, ``fla/layers/lightnet.py``): q, k, v = the projections of h (each through a short conv without
activation when ``use_short_conv``); q ← silu(q); per head (K = ``expand_ratio`` key channels, P value channels) the
additive gate of the key logits k (``fla.ops.gsa.gate.fused_additive_gate``): z_t = log Σ_{s≤t} e^{k_s} per key
channel, k̃_t = e^{k_t − z_t}, g_t = z_{t−1} − z_t (0 at a sequence's first token); ``o = gla(q, k̃, v, g)``:
S_t = diag(e^{g_t}) S_{t−1} + k̃_t v_tᵀ, o_t = K^−½ S_tᵀ q_t — so α[t, s] = K^−½ Σ_k q_t,k e^{k_s,k − z_t,k}, a
softmax-like normalisation over the keys that does not touch v; then ``o_proj(rms_norm(o) · swish(g_proj h))`` with
ONE gated RMS norm over all H·P channels of a token (fla's ``rms_norm_swish_gate_linear``, its default eps 1e-6: the
layer does not pass ``g_norm.eps``), ``g_proj`` a low-rank pair of linears.

hidden:  α_h[t, s] = K^−½ Σ_k q_t,k k̃_s,k e^{Γ_t,k − Γ_s,k}  (s ≤ t; Γ the cumulative g)  over v (after its conv).
unified: H_c = diag(ν_c · swish(g_c)) · α_h · diag(m) · M_c  over v before its conv (M_c the conv's band; without
         a conv diag(ν_c · swish(g_c)) · α_h · diag(m)); ν_c = weight_c / rms of the token's whole o, from the real
         activations.
q, k̃ and the decays come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import GatedLinearCore
from .common import run
from .fla_heads import head_lrp, head_operator, rule_values
from .fla_hgrn2 import checked_input, gated_linear_output, projected, refuse_norm_bias

MIXER_CLASSES = ("LightNetAttention",)
INNER_MIXERS = {"LightNetAttention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H
GATED_NORM_LINEAR_EPS = 1e-6  # fla.modules.norm.fused_norm_gate.rms_norm_swish_gate_linear's default


def additive_gate(logits: torch.Tensor, mask: torch.Tensor | None):
    """(k̃, g) of fla's additive gate on logits (B, L, H, K), float64, each row one sequence: its pads take no part
    (k̃ = 0, g = 0 there), so a left-padded row starts at its first real token as fla's unpadded run does."""
    logits = logits.double()
    if mask is not None:
        logits = logits.masked_fill(~mask.bool()[:, :, None, None], float("-inf"))
    z = torch.logcumsumexp(logits, dim=1)
    previous = torch.cat([torch.full_like(z[:, :1], float("-inf")), z[:, :-1]], dim=1)
    fresh = torch.isneginf(previous)
    gate = torch.where(fresh, torch.zeros_like(z), previous.masked_fill(fresh, 0.0) - z)
    keys = (logits - z.masked_fill(torch.isneginf(z), 0.0)).exp()  # e^{−∞} = 0 at the pads
    return keys, gate


def _core_inputs(mixer, h: torch.Tensor, mask: torch.Tensor | None):
    """(q, k̃, g) (B, L, H, K) float64 of the layer's op from h (B, L, D): q = swish(q), the additive gate's keys and
    log decays (:func:`additive_gate`)."""
    batch, length, _ = h.shape
    split = lambda t: t.reshape(batch, length, mixer.num_heads, mixer.head_f_dim)  # noqa: E731
    q = split(F.silu(projected(mixer, h, "q_proj", "q_conv1d")[2].double()))
    keys, log_decay = additive_gate(split(projected(mixer, h, "k_proj", "k_conv1d")[2]), mask)
    return q, keys, log_decay


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_heads.head_lrp`), a differentiable function of
    ``call.hidden_states``: v_proj and its conv linear (a bias a constant), the core α (q, the additive gate's keys
    and decays) detached, the layer-wide norm's ν detached, the gate swish(g_proj h) (a low-rank pair of linears) by
    the identity and half rules. (B, L, D), float64."""
    mixer, mask = call.located.module, call.attention_mask
    h = checked_input(call, "lrp", "LightNet", "v_conv1d")
    batch, length, _ = h.shape
    heads, value_dim = mixer.num_heads, mixer.head_i_dim
    with torch.no_grad():
        q, keys, log_decay = _core_inputs(mixer, h, mask)
        core = GatedLinearCore(q.to(work_dtype), keys.to(work_dtype), log_decay, mixer.head_f_dim ** -0.5)
    values = rule_values(mixer, h, mask, work_dtype, "v_proj", "v_conv1d").reshape(batch, length, heads, value_dim)
    low_rank, up = mixer.g_proj
    return head_lrp(call, work_dtype, core=core, values=values, gate_input=run(up, run(low_rank, h)),
                    gate_activation="swish", norm=mixer.g_norm, out_proj=mixer.o_proj, heads=heads,
                    head_dim=value_dim, norm_over_width=True, norm_eps=GATED_NORM_LINEAR_EPS)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    h = checked_input(call, formulation, "LightNet", "v_conv1d")
    mixer, mask = call.located.module, call.attention_mask
    refuse_norm_bias(mixer.g_norm, "LightNet")
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_f_dim, mixer.head_i_dim
    split = lambda t, d: t.reshape(batch, length, heads, d)  # noqa: E731
    q, keys, log_decay = _core_inputs(mixer, h, mask)
    value_pre, _, v = projected(mixer, h, "v_proj", "v_conv1d")
    if mask is not None:  # pads write nothing (fla drops them; a conv bias would give them values)
        v = v * mask[:, :, None].to(v.dtype)
    v = split(v, value_dim)
    scale = key_dim ** -0.5
    core, values, output = gated_linear_output(q, keys, log_decay, v, scale, work_dtype)
    low_rank, up = mixer.g_proj  # nn.Sequential of two linears, run one by one (no hooks)
    gate = F.silu(run(up, run(low_rank, h)).double()).reshape(batch, length, heads, value_dim)
    taps = mixer.v_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                         values=values, output=output, gate=gate, norm=mixer.g_norm, out_proj=mixer.o_proj,
                         value_pre=value_pre if mixer.use_short_conv else None, taps=taps, norm_over_width=True,
                         norm_eps=GATED_NORM_LINEAR_EPS)
