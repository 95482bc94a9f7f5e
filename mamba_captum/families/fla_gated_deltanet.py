"""flash-linear-attention's gated DeltaNet: ``GatedDeltaNet`` (model type ``gated_deltanet``; also the self-decoder
layers of ``yoco``).

Forward (fla 0.6.0, ``fla/layers/gated_deltanet.py``), h the layer input (pads: :mod:`.fla_delta_net`): q, k, v =
silu(short conv(projection of h)) each (without convs silu(projection)); q, k with H heads of K channels, v with HV
value heads (HV a multiple of H: a key head serves HV / H value heads) of P channels; β = σ(b_proj h) (× 2 with
``allow_neg_eigval``) and the decay g = −exp(A_log)·softplus(a_proj h + dt_bias), one per value head and token, both
computed in the kernel; ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` with q and k L2-normalised
in the kernel (eps 1e-6 inside the root)::

    S_t = (I − β_t k_t k_tᵀ) exp(g_t) S_{t−1} + β_t k_t v_tᵀ,      o_t = K^−½ S_tᵀ q_t

then ``o_norm``: with ``use_gate`` fla's gated RMS norm (norm, then the gate act(g_proj h), act = swish or sigmoid
per ``output_gate_activation``), else its RMS norm; ``o_proj``.

hidden:  α_h[t, s] = q_tᵀ (I − β_t k_t k_tᵀ) e^{g_t} ⋯ (I − β_{s+1} k_{s+1} k_{s+1}ᵀ) e^{g_{s+1}} β_s k_s  (h a value
         head, q and k those of its key head as the kernel uses them, q scaled by K^−½), over v after its conv.
unified: H_c = diag(ν_c · act(g_c)) · α_h · diag(σ(pre_c) · m) · M_c   over v_proj's output before the conv
         (c = (h, p); pre the conv's output, M_c its taps; without a conv diag(σ(v_proj_c) · m)); ν the norm's
         per-token scale (weight / rms over the head's P channels), the gate factor 1 without ``use_gate``.
q, k, β and g come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import run
from .fla_delta_net import delta_layer_input, delta_lrp, delta_operator, output_gate, write_strength
from .gated_deltanet import delta_rule_inputs

MIXER_CLASSES = ("GatedDeltaNet",)
INNER_MIXERS = {"GatedDeltaNet": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def head_log_decay(a, A_log, dt_bias):
    """g = −exp(A_log) · softplus(a + dt_bias) (B, L, HV) float64, fla's in-kernel gate (softplus linear above 20, as
    fla's). a: (B, L, HV) the raw gate input; A_log, dt_bias: (HV,), dt_bias may be None. exp(A_log) is taken in
    A_log's own dtype (fla's Comba and DeltaProduct layers pass ``A_log.float()``: float32 even in a float64 model)."""
    a = a.double()
    if dt_bias is not None:
        a = a + dt_bias.double()
    return -A_log.exp().double() * F.softplus(a)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (module docstring).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, h, (q, k, value_pre, act_pre, v) = delta_layer_input(call, formulation)
    value_heads, value_dim = mixer.num_v_heads, mixer.head_v_dim
    with torch.no_grad():
        beta = write_strength(mixer, h)
        log_decay = head_log_decay(run(mixer.a_proj, h), mixer.A_log, mixer.dt_bias)
        core = delta_rule_inputs(q, k, beta, log_decay, value_heads, mixer.head_k_dim, work_dtype)
    gate, norm = output_gate(mixer, h, mixer.use_gate, value_dim)
    return delta_operator(call, formulation, components, work_dtype, mixer=mixer, core=core, value_pre=value_pre,
                          act_pre=act_pre, v=v, gate=gate, norm=norm, heads=value_heads, head_dim=value_dim)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_delta_net.delta_lrp`: q, k, β and the decay g detached
    in the core, the values' SiLU by the identity rule, ν detached, the gate by its rule). (B, L, D), float64."""
    with torch.no_grad():
        mixer, h, (q, k, *_) = delta_layer_input(call, "lrp")
        beta = write_strength(mixer, h)
        log_decay = head_log_decay(run(mixer.a_proj, h), mixer.A_log, mixer.dt_bias)
        core = delta_rule_inputs(q, k, beta, log_decay, mixer.num_v_heads, mixer.head_k_dim, work_dtype)
    return delta_lrp(call, work_dtype, core=core, gated=mixer.use_gate, heads=mixer.num_v_heads,
                     head_dim=mixer.head_v_dim)
