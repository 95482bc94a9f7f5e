"""flash-linear-attention's preconditioned Kimi delta attention: ``PrecondKDA`` (model type ``precond_kda``).

Forward (fla 0.6.0, ``fla/layers/precond_kda.py``), h the layer input (pads: :mod:`.fla_delta_net`): q, k, v =
silu(short conv(projection of h)) each (without convs silu(projection)); q, k with H heads of K channels, repeated to
the HV value heads of P channels; β = σ(b_proj h) (one per key head, repeated; × 2 with ``allow_neg_eigval``); the
decay g = ``fused_kda_gate(f_proj h)`` one per value head and key channel, −exp(A_log_h)·softplus(f + dt_bias) (with
``lower_bound``: lower_bound·σ(exp(A_log_h)·(f + dt_bias))), returned in float32 (rounded so in a float64 model);
the preconditioner's β^atk = σ(b_atk_proj h) and g^atk = −exp(A_log_atk)·softplus(a_proj h + dt_bias_atk), one per
value head (from float32 casts of a_proj h and A_log_atk); ``chunk_precond_kda`` / ``fused_recurrent_precond_kda``
with q and k L2-normalised in the kernel (eps 1e-6 inside the root)::

    A_t = e^{g^atk_t} A_{t−1} + β^atk_t k_t ⊙ k_t,   r_t = log(A_t + ε) − c_h,   k̃_t = exp(−log(x)·r_t/(1 + |r_t|)) ⊙ k_t
    S_t = (I − β_t k̃_t k_tᵀ) D_t S_{t−1} + β_t k̃_t v_tᵀ,   D_t = diag(e^{g_t}),      o_t = K^−½ S_tᵀ q_t

(c_h = ``log_atk_scale``, x = ``squash_x``, ε = ``squash_eps``); then fla's σ-gated RMS norm (gate σ(g_proj h),
g_proj a low-rank projection with a bias), ``o_proj``. The rule is the DPLR rule of :mod:`mamba_captum.kernels.dplr`
with D_t, a = D_t k, b = −β k̃ and the written key β k̃ (:mod:`mamba_captum.kernels.dplr.precond`).

hidden:  α_h[t, s] = K^−½ q_tᵀ (I − β_t k̃_t k_tᵀ) D_t ⋯ (I − β_{s+1} k̃_{s+1} k_{s+1}ᵀ) D_{s+1} β_s k̃_s  (h a value head;
         q, k as the kernel uses them, k̃ from the head's own A), over v after its conv.
unified: H_c = diag(ν_c · σ(gate_c)) · α_h · diag(σ(pre_c) · m) · M_c   over v_proj's output before the conv
         (c = (h, p); pre the conv's output, M_c its taps; without a conv diag(σ(v_proj_c) · m)); ν the norm's
         per-token scale.
q, k, k̃ (through A_t), β and the decays come from the same tokens but, as B and C of the SSMs, enter α (detached),
not the attribution. Pads: the keys are zeroed at the pads, so they add nothing to A either (left padding is exact).
"""
from __future__ import annotations

import torch

from .common import run
from .fla_delta_net import (delta_layer_input, delta_lrp, delta_operator, dplr_output, output_gate,
                            write_strength)
from .fla_gated_deltanet import head_log_decay
from .fla_kda import channel_log_decay
from .fla_precond_gated_deltanet import precond_core

MIXER_CLASSES = ("PrecondKDA",)
INNER_MIXERS = {"PrecondKDA": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator (a DPLR core: the KDA rule with preconditioned written keys; module docstring)
    from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, h, (q, k, value_pre, act_pre, v) = delta_layer_input(call, formulation)
    core = _core(mixer, h, q, k, work_dtype)
    value_dim = mixer.head_v_dim
    gate, norm = output_gate(mixer, h, True, value_dim)
    return delta_operator(call, formulation, components, work_dtype, mixer=mixer, core=core, value_pre=value_pre,
                          act_pre=act_pre, v=v, gate=gate, norm=norm, heads=mixer.num_v_heads, head_dim=value_dim,
                          core_output=dplr_output(core))


def _core(mixer, h, q, k, work_dtype):
    """The detached core of the layer (:func:`.fla_precond_gated_deltanet.precond_core`) from h (B, L, D) and q, k
    (B, L, H·K) after their convs."""
    batch, length, _ = h.shape
    heads, value_heads, key_dim = mixer.num_heads, mixer.num_v_heads, mixer.head_k_dim
    with torch.no_grad():
        q, k = (x.double().reshape(batch, length, heads, key_dim) for x in (q, k))
        beta = write_strength(mixer, h).repeat_interleave(value_heads // heads, dim=2)
        raw = run(mixer.f_proj, h).reshape(batch, length, value_heads, key_dim)
        # fused_kda_gate returns float32 (its default output dtype), in a float64 model as well
        log_decay = channel_log_decay(raw, mixer.A_log, mixer.dt_bias, mixer.lower_bound).float().double()
        log_decay_atk = head_log_decay(run(mixer.a_proj, h).float(), mixer.A_log_atk.float(), mixer.dt_bias_atk)
        beta_atk = torch.sigmoid(run(mixer.b_atk_proj, h).double())
        return precond_core(mixer, q, k, beta, log_decay, log_decay_atk, beta_atk, mixer.log_atk_scale, work_dtype)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_delta_net.delta_lrp`: the core α (q, k, the
    preconditioned written keys, β, the per-channel decays) detached, the values' SiLU by the identity rule, ν
    detached, the sigmoid gate by :func:`mamba_captum.rules.sigmoid_gate`). (B, L, D), float64."""
    with torch.no_grad():
        mixer, h, (q, k, *_) = delta_layer_input(call, "lrp")
        core = _core(mixer, h, q, k, work_dtype)
    return delta_lrp(call, work_dtype, core=core, gated=True, heads=mixer.num_v_heads, head_dim=mixer.head_v_dim)
