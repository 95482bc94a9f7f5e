"""flash-linear-attention's preconditioned gated DeltaNet: ``PrecondGatedDeltaNet`` (model type
``precond_gated_deltanet``).

Forward (fla 0.6.0, ``fla/layers/precond_gated_deltanet.py``), h the layer input (pads: :mod:`.fla_delta_net`): q, k,
v = silu(short conv(projection of h)) each (without convs silu(projection)); q, k with H heads of K channels, v with
HV value heads of P channels (HV a multiple of H); β = σ(b_proj h) (× 2 with ``allow_neg_eigval``) and
g = −exp(A_log)·softplus(a_proj h + dt_bias), one per value head; the preconditioner's β^atk = σ(b_atk_proj h) and
g^atk = −exp(A_log_atk)·softplus(a_atk_proj h + dt_bias_atk), one per key head (g and g^atk from float32 casts of
the projections and of A_log, A_log_atk); ``chunk_precond_gated_delta_rule`` / ``fused_recurrent_…`` with q and k
L2-normalised in the kernel (eps 1e-6 inside the root)::

    A_t = e^{g^atk_t} A_{t−1} + β^atk_t k_t ⊙ k_t,   r_t = log(A_t + ε) − c_h,   k̃_t = exp(−log(x)·r_t/(1 + |r_t|)) ⊙ k_t
    S_t = (I − β_t k̃_t k_tᵀ) e^{g_t} S_{t−1} + β_t k̃_t v_tᵀ,      o_t = K^−½ S_tᵀ q_t

(c_h = ``log_atk_scale``, x = ``squash_x``, ε = ``squash_eps``: the preconditioner rescales the written key only);
then ``o_norm`` (with ``use_gate`` fla's gated RMS norm with the gate swish(g_proj h), else its RMS norm), ``o_proj``.
The rule is the diagonal-plus-low-rank rule of :mod:`mamba_captum.kernels.dplr` with D_t = e^{g_t} I, a = e^{g_t} k,
b = −β k̃ and the written key β k̃ (:mod:`mamba_captum.kernels.dplr.precond`, as fla_on_cpu's
``chunk_precond_gated_delta_rule`` runs it).

hidden:  α_h[t, s] = K^−½ q_tᵀ (I − β_t k̃_t k_tᵀ) e^{g_t} ⋯ (I − β_{s+1} k̃_{s+1} k_{s+1}ᵀ) e^{g_{s+1}} β_s k̃_s  (h a value
         head; q, k, k̃ those of its key head as the kernel uses them), over v after its conv.
unified: H_c = diag(ν_c · swish(gate_c)) · α_h · diag(σ(pre_c) · m) · M_c   over v_proj's output before the conv
         (c = (h, p); pre the conv's output, M_c its taps; without a conv diag(σ(v_proj_c) · m)); ν the norm's
         per-token scale, the gate factor 1 without ``use_gate``.
q, k, k̃ (through A_t), β and g come from the same tokens but, as B and C of the SSMs, enter α (detached), not the
attribution. Pads: the keys are zeroed at the pads, so they add nothing to A either (left padding is exact).
"""
from __future__ import annotations

import torch

from ..kernels.dplr import l2_normalised, precond_rule_inputs
from ..operators import DPLRCore
from .common import run
from .fla_delta_net import (delta_layer_input, delta_lrp, delta_operator, dplr_output, output_gate,
                            write_strength)
from .fla_gated_deltanet import head_log_decay

MIXER_CLASSES = ("PrecondGatedDeltaNet",)
INNER_MIXERS = {"PrecondGatedDeltaNet": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def precond_core(mixer, q, k, beta, log_decay, log_decay_atk, beta_atk, log_atk_scale, work_dtype):
    """The DPLR core of a preconditioned delta rule (module docstring), from float64 pieces.

    Args:
        q, k: (B, L, H, K) as the layer passes them (normalised here, as in fla's kernel). beta: (B, L, HV).
        log_decay: (B, L, HV) or (B, L, HV, K). log_decay_atk, beta_atk: (B, L, H_atk) with H_atk the heads of the
            preconditioner (k is repeated to them). log_atk_scale: (H_atk,).
    Returns:
        :class:`DPLRCore` (HV heads), q scaled by K^−½ through ``scale``.
    """
    q, written, read, erase, channel_decay, _ = precond_rule_inputs(
        l2_normalised(q), l2_normalised(k), log_decay, beta, log_decay_atk, beta_atk, log_atk_scale.double(),
        mixer_squash(mixer), mixer.squash_eps)
    cast = lambda t: t.to(work_dtype)  # noqa: E731
    return DPLRCore(cast(q), cast(written), cast(read), cast(erase), channel_decay.double(),
                    scale=q.shape[-1] ** -0.5)


def mixer_squash(mixer) -> float:
    """The squash range x of the layer (``squash_x``; PrecondKDA keeps it as ``squash_x_val``)."""
    return float(getattr(mixer, "squash_x_val", getattr(mixer, "squash_x", 1.5)))


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator (a DPLR core: the gated delta rule with preconditioned written keys; module
    docstring) from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, h, (q, k, value_pre, act_pre, v) = delta_layer_input(call, formulation)
    core = _core(mixer, h, q, k, work_dtype)
    value_dim = mixer.head_v_dim
    gate, norm = output_gate(mixer, h, mixer.use_gate, value_dim)
    return delta_operator(call, formulation, components, work_dtype, mixer=mixer, core=core, value_pre=value_pre,
                          act_pre=act_pre, v=v, gate=gate, norm=norm, heads=mixer.num_v_heads, head_dim=value_dim,
                          core_output=dplr_output(core))


def _core(mixer, h, q, k, work_dtype) -> DPLRCore:
    """The detached core of the layer (:func:`precond_core`) from h (B, L, D) and q, k (B, L, H·K) after their
    convs."""
    batch, length, _ = h.shape
    with torch.no_grad():
        q, k = (x.double().reshape(batch, length, mixer.num_heads, mixer.head_k_dim) for x in (q, k))
        beta = write_strength(mixer, h)
        # fla computes both gates from float32 casts of the projections and of A_log (float32 in a float64 model)
        log_decay = head_log_decay(run(mixer.a_proj, h).float(), mixer.A_log.float(), mixer.dt_bias)
        log_decay_atk = head_log_decay(run(mixer.a_atk_proj, h).float(), mixer.A_log_atk.float(),
                                       mixer.dt_bias_atk)
        beta_atk = torch.sigmoid(run(mixer.b_atk_proj, h).double())
        return precond_core(mixer, q, k, beta, log_decay, log_decay_atk, beta_atk, mixer.log_atk_scale, work_dtype)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_delta_net.delta_lrp`: the core α (q, k, the
    preconditioned written keys, β, the decays) detached, the values' SiLU by the identity rule, ν detached, the gate
    by its rule). (B, L, D), float64."""
    with torch.no_grad():
        mixer, h, (q, k, *_) = delta_layer_input(call, "lrp")
        core = _core(mixer, h, q, k, work_dtype)
    return delta_lrp(call, work_dtype, core=core, gated=mixer.use_gate, heads=mixer.num_v_heads,
                     head_dim=mixer.head_v_dim)
