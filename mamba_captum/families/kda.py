"""Kimi delta attention (KDA): KimiLinearDeltaAttention (kimi_linear), BailingHybridDeltaAttention
(bailing_hybrid), Glm5NextTextLinearAttention (glm5_next); their MLA / softmax layers are softmax layers.

Forward (transformers 5.23, ``KimiLinearDeltaAttention.forward``): the gated delta rule of :mod:`.gated_deltanet`
with one decay per key channel, ``D_t = diag(exp(g_t))``, g from the layer's ``forget_gate`` module (Kimi:
``−exp(A_log)·softplus(f_b(f_a(h)) + dt_bias)``; Bailing and GLM-5-next: the "safe gate"
``lower_bound·σ(exp(A_log)·(f(h) + dt_bias))``); ``h·m``; ``q, k, v = silu(conv(q_proj h ‖ k_proj h ‖ v_proj h))``
(one depthwise causal conv, no bias); ``β = σ(b_proj h)``; q, k L2-normalised, q scaled by d^−½; one head count
for q, k and v; ``out = o_proj(ν · σ(gate) · o)`` with the σ-gated RMS norm (gate: ``g_b(g_a(h))`` or ``g_proj h``).

hidden:  α_h[t, s] = q_tᵀ (I − β_t k_t k_tᵀ) D_t ⋯ (I − β_{s+1} k_{s+1}k_{s+1}ᵀ) D_{s+1} β_s k_s   over v (after conv).
unified: H_c = diag(ν_c · σ(gate_c)) · α_h · diag(σ(pre_c)·m) · M_c                             over v before the conv.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import masked_tokens
from .gated_deltanet import (causal_conv, delta_rule_inputs, delta_rule_lrp, gate_activation, operator_from_pieces,
                             output_modules, silu_mixer)
from .common import run

MIXER_CLASSES = ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention", "Glm5NextTextLinearAttention")


def _pieces(call, why: str, work_dtype: torch.dtype, conv_dtype: torch.dtype | None = None):
    """What :func:`rebuild` and :func:`lrp` both start from: (mixer, masked input h, q/k/v width, the conv's
    pre-activation over cat(q, k, v) in ``conv_dtype`` (None: the conv's own, as HF runs it), the delta-rule core
    (detached: the operator's and the rules' alike), the gate's input, the gated norm and out_proj)."""
    mixer = silu_mixer(call, why)
    h = masked_tokens(call.hidden_states, call.attention_mask)
    width = mixer.qkv_dim
    conv_pre = causal_conv(torch.cat([run(mixer.q_proj, h), run(mixer.k_proj, h), run(mixer.v_proj, h)], dim=-1),
                           mixer.conv1d, conv_dtype)
    batch, length, _ = h.shape
    with torch.no_grad():
        mixed = F.silu(conv_pre)
        log_decay = run(mixer.forget_gate, h).double().reshape(batch, length, mixer.num_heads, mixer.head_dim)
        beta = torch.sigmoid(run(mixer.b_proj, h).double())
        core = delta_rule_inputs(mixed[..., :width], mixed[..., width:2 * width], beta, log_decay, mixer.num_heads,
                                 mixer.head_dim, work_dtype)
    gate_input = run(mixer.g_proj, h) if hasattr(mixer, "g_proj") else run(mixer.g_b_proj, run(mixer.g_a_proj, h))
    norm, out_proj = output_modules(mixer)
    return mixer, h, width, conv_pre, core, gate_input, norm, out_proj


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed, (B, L, D).
    """
    mixer, h, width, conv_pre, core, gate_input, norm, out_proj = _pieces(
        call, "the unified operator is defined for silu", work_dtype)
    value = run(mixer.v_proj, h)
    return operator_from_pieces(call, formulation, components, work_dtype, core=core, value_pre=value,
                                conv_pre=conv_pre[..., 2 * width:], taps=mixer.conv1d.weight[2 * width:, 0, :],
                                gate=gate_activation(norm, gate_input), norm=norm, out_proj=out_proj,
                                value_heads=mixer.num_heads, head_dim=mixer.head_dim)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP-style rules (:func:`.gated_deltanet.delta_rule_lrp`): the per-channel
    decays, β, q and k detached, the values' SiLU by the identity rule, the σ-gated norm's normaliser detached and
    its sigmoid gate by :func:`mamba_captum.rules.sigmoid_gate`. The conv runs in the work dtype, whatever dtype the
    model keeps it in (transformers ≥ 5.24 keeps BailingHybrid's in float32): a relevance path rounded to float32
    would break conservation in a float64 model. (B, L, D), float64."""
    mixer, _, width, conv_pre, core, gate_input, norm, out_proj = _pieces(
        call, "MambaLRP's rules are written for silu", work_dtype, conv_dtype=work_dtype)
    return delta_rule_lrp(core, conv_pre[..., 2 * width:], gate_input, norm, out_proj, mixer.num_heads,
                          mixer.head_dim, work_dtype)
