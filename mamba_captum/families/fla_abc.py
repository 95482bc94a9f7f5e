"""flash-linear-attention's attention with bounded-memory control: ``ABCAttention`` (model type ``abc``).

Forward (fla 0.6.0, ``fla/layers/abc.py``; the layer does NOT unpad a masked batch): q, k, v = the projections of h
(each through a SiLU short conv when ``use_short_conv``, its input zeroed at the pads); ``swish`` on q, k, v with
``use_input_gate``; the pads' values zeroed; rotary embeddings on q and k (positions 0 … L−1); the slot logits
``s = clamp(s_proj h, clamp_min, clamp_max)`` (M slots per head); ``o = chunk_abc(q, k, v, s)``: per head and slot m,
z_t = log Σ_{r≤t} e^{s_r}, the slot memories Hk_t = Σ_{r≤t} k_r e^{s_r − z_t} (K × M), Hv_t = Σ_{r≤t} e^{s_r − z_t} v_r
(M × V), the slot read weights p_t = softmax_m(K^−½ Hk_tᵀ q_t), o_t = Hv_tᵀ p_t; then the output norm and gate:
``g_norm(o, g_proj h)`` (RMS norm over each head's value channels, then swish(g)) by default, ``g_norm(o)`` without
the output gate, ``swish(g) · o`` without the norm; ``o_proj``.

hidden:  α_h[t, s] = Σ_m p_t,m e^{s_s,m − z_t,m}  (s ≤ t): slot m's read weight at t times token s's normalised write
         weight into slot m — GLA with queries p, keys s̃ = e^{s − z} and per-slot log decays z_{t−1} − z_t, scale 1
         (:class:`GatedLinearCore`), over v (after its conv and input gate, pads zeroed).
unified: H_c = diag(ν_c · swish(g_c)) · α_h · diag(σ(pre_c) · m) · M_c  over v before its conv (without a conv:
         diag(ν_c · swish(g_c)) · α_h · diag(m), and with the input gate's swish, diag(σ(x_c) · m)).
q, k and s (hence p and s̃) come from the same tokens but, as B and C of the SSMs, enter α (detached), not the
attribution: o is linear in v given them.

Pads: fla's ABC zeroes only the pads' values: their keys and slot logits still enter the slot memories and z, so a
left pad changes what the real tokens compute (left padding is refused, ``IGNORES_ATTENTION_MASK``); right pads come
after every real token, and the rebuild reproduces them as fla runs them (pad rows included). Packed sequences
(``cu_seqlens``, refused by fla's layer too) and, in the unified operator, a value conv with a bias or the input gate
with a conv are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.gated_linear import abc_slot_gates, slot_read_weights
from .common import run
from .fla_heads import head_operator, short_conv
from .fla_hgrn2 import gated_linear_output, refuse_conv_bias, refuse_norm_bias, refuse_packed
from .fla_retnet import rotary

MIXER_CLASSES = ("ABCAttention",)
INNER_MIXERS = {"ABCAttention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H
# fla's layer does not pass its attention mask to the slot memories (only the values are zeroed)
IGNORES_ATTENTION_MASK = True
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's ABC has none yet (its softmax "
                   "over slots and gated norm need their own)")


def _projected(mixer, h, mask, name: str, conv_name: str):
    """(before the conv, the conv's pre-activation or None, after the conv and the input gate) of projection
    ``name``; fla's conv zeroes its input at the pads first."""
    x = run(getattr(mixer, name), h)
    pre, out = None, x
    if mixer.use_short_conv:
        masked = x if mask is None else x * mask[:, :, None].to(x.dtype)
        pre, out = short_conv(getattr(mixer, conv_name), masked)
    if mixer.use_input_gate:
        out = F.silu(out.double())
    return x, pre, out


def _gate_and_norm(mixer, h, batch: int, length: int):
    """(the output gate (B, L, H, P) float64 or None, the RMS norm whose scale multiplies o, or None)."""
    gate = None
    if mixer.use_output_gate:
        activation = getattr(mixer.g_norm, "activation", "swish") if mixer.use_norm else "swish"
        act = torch.sigmoid if activation == "sigmoid" else F.silu
        gate = act(run(mixer.g_proj, h).double()).reshape(batch, length, mixer.num_heads, mixer.head_v_dim)
    norm = mixer.g_norm if mixer.use_norm else None
    if norm is not None:
        refuse_norm_bias(norm, "ABC")
    return gate, norm


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (the pads as fla runs them).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D),
        pads included.
    """
    mixer, mask = call.located.module, call.attention_mask
    refuse_packed(call, "ABC")
    refuse_conv_bias(mixer, "v_conv1d", formulation, "ABC")
    if formulation == "unified" and mixer.use_input_gate and mixer.use_short_conv:
        raise NotImplementedError("mamba_captum: the unified operator of an ABC layer with use_input_gate and a "
                                  "value conv (two activations on the values); use formulation='hidden'.")
    h = call.hidden_states
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    q = _projected(mixer, h, mask, "q_proj", "q_conv1d")[2]
    k = _projected(mixer, h, mask, "k_proj", "k_conv1d")[2]
    value_pre, conv_pre, v = _projected(mixer, h, mask, "v_proj", "v_conv1d")
    if mask is not None:  # fla zeroes the pads' values (not their keys or slot logits)
        v = v * mask[:, :, None].to(v.dtype)
    q, k = q.reshape(batch, length, heads, key_dim), k.reshape(batch, length, heads, key_dim)
    if mixer.use_rope:
        positions = torch.arange(length, device=h.device).expand(batch, length)
        q, k = rotary(mixer.rotary, q, positions), rotary(mixer.rotary, k, positions)
    logits = run(mixer.s_proj, h).reshape(batch, length, heads, mixer.num_slots)
    logits = logits.clamp(mixer.clamp_min, mixer.clamp_max).double()
    slot_weights, log_decay = abc_slot_gates(logits)
    with torch.no_grad():
        read = slot_read_weights(q.detach().double(), k.detach().double(), slot_weights.double(), log_decay.double(),
                                 key_dim ** -0.5)
    v = v.reshape(batch, length, heads, value_dim)
    core, values, output = gated_linear_output(read, slot_weights, log_decay, v, 1.0, work_dtype)
    gate, norm = _gate_and_norm(mixer, h, batch, length)
    if mixer.use_short_conv:
        taps = mixer.v_conv1d.weight[:, 0, :]
    elif mixer.use_input_gate:  # v = swish(x): the activation's gain σ(x) is a column weight, as a conv's would be
        value_pre, conv_pre, taps = value_pre, value_pre, None
    else:
        value_pre, taps = None, None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                         values=values, output=output, gate=gate, norm=norm, out_proj=mixer.o_proj,
                         value_pre=value_pre, conv_pre=conv_pre, taps=taps, zero_pads=False)
