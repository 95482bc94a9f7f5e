"""flash-linear-attention's Kimi delta attention: ``KimiDeltaAttention`` (model type ``kda``).

Forward (fla 0.6.0, ``fla/layers/kda.py``), h the layer input (pads: :mod:`.fla_delta_net`): q, k, v =
silu(short conv(projection of h)) each (without convs silu(projection)); q, k with H heads of K channels, v with HV
value heads of P channels (HV a multiple of H); the decay one per value head and key channel, computed in the kernel
from the raw ``f = f_proj h`` (a two-layer low-rank projection): g = −exp(A_log_h)·softplus(f + dt_bias), or with
``lower_bound`` set ("safe gate") g = lower_bound·σ(exp(A_log_h)·(f + dt_bias)); β = σ(b_proj h) (× 2 with
``allow_neg_eigval``); ``chunk_kda`` / ``fused_recurrent_kda`` with q and k L2-normalised in the kernel::

    S_t = (I − β_t k_t k_tᵀ) diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,      o_t = K^−½ S_tᵀ q_t

then fla's σ-gated RMS norm (norm over each head's P channels, then the gate σ(g_proj h), g_proj a low-rank
projection with a bias), ``o_proj``.

hidden:  α_h[t, s] = q_tᵀ (I − β_t k_t k_tᵀ) D_t ⋯ (I − β_{s+1} k_{s+1} k_{s+1}ᵀ) D_{s+1} β_s k_s,  D_t = diag(e^{g_t})
         (h a value head, q and k those of its key head as the kernel uses them, q scaled by K^−½), over v after
         its conv.
unified: H_c = diag(ν_c · σ(gate_c)) · α_h · diag(σ(pre_c) · m) · M_c   over v_proj's output before the conv
         (c = (h, p); pre the conv's output, M_c its taps; without a conv diag(σ(v_proj_c) · m)); ν the norm's
         per-token scale (weight / rms over the head's P channels).
q, k, β and the decays come from the same tokens but, as B and C of the SSMs, enter α (detached), not the
attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import run
from .fla_delta_net import delta_layer_input, delta_lrp, delta_operator, output_gate, write_strength
from .gated_deltanet import delta_rule_inputs

MIXER_CLASSES = ("KimiDeltaAttention",)
INNER_MIXERS = {"KimiDeltaAttention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def channel_log_decay(f, A_log, dt_bias, lower_bound=None):
    """KDA's in-kernel gate (fla's ``kda_gate``), (B, L, HV, K) float64: −exp(A_log_h)·softplus(f + dt_bias), or
    lower_bound·σ(exp(A_log_h)·(f + dt_bias)) with a lower bound. f: (B, L, HV, K) the raw gate input; A_log (HV,)
    or None (a factor 1 then, as fla's kernel); dt_bias (HV·K,) or None."""
    f = f.double()
    if dt_bias is not None:
        f = f + dt_bias.double().reshape(f.shape[2:])
    rate = None if A_log is None else A_log.double().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(f if rate is None else rate * f)
    return -(torch.e if rate is None else rate) * F.softplus(f)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator (the delta rule with a decay per value head and key channel; module docstring)
    from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, h, (q, k, value_pre, act_pre, v) = delta_layer_input(call, formulation)
    value_heads, key_dim, value_dim = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    with torch.no_grad():
        beta = write_strength(mixer, h)
        raw = run(mixer.f_proj, h).reshape(*h.shape[:2], value_heads, key_dim)
        log_decay = channel_log_decay(raw, mixer.A_log, mixer.dt_bias, mixer.lower_bound)
        core = delta_rule_inputs(q, k, beta, log_decay, value_heads, key_dim, work_dtype)
    gate, norm = output_gate(mixer, h, True, value_dim)
    return delta_operator(call, formulation, components, work_dtype, mixer=mixer, core=core, value_pre=value_pre,
                          act_pre=act_pre, v=v, gate=gate, norm=norm, heads=value_heads, head_dim=value_dim)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_delta_net.delta_lrp`: q, k, β and the per-channel
    decays detached in the core, the values' SiLU by the identity rule, ν detached, the sigmoid gate by
    :func:`mamba_captum.rules.sigmoid_gate`). (B, L, D), float64."""
    with torch.no_grad():
        mixer, h, (q, k, *_) = delta_layer_input(call, "lrp")
        value_heads, key_dim = mixer.num_v_heads, mixer.head_k_dim
        beta = write_strength(mixer, h)
        raw = run(mixer.f_proj, h).reshape(*h.shape[:2], value_heads, key_dim)
        log_decay = channel_log_decay(raw, mixer.A_log, mixer.dt_bias, mixer.lower_bound)
        core = delta_rule_inputs(q, k, beta, log_decay, value_heads, key_dim, work_dtype)
    return delta_lrp(call, work_dtype, core=core, gated=True, heads=value_heads, head_dim=mixer.head_v_dim)
