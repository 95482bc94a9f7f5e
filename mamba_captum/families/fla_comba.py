"""flash-linear-attention's Comba: ``Comba`` (model type ``comba``).

Forward (fla 0.6.0, ``fla/layers/comba.py``), h the layer input (pads: :mod:`.fla_delta_net`): q, k, v =
silu(short conv(projection of h)) each (without convs silu(projection)); q, k with H heads of K channels, v with HV
value heads of P channels (HV a multiple of H); the read key p = σ(decay_h) · k with ``use_inner_decay`` (else k);
q ← q − D_h · p with ``use_output_correction``; β = σ(b_proj h); g = −exp(A_log)·softplus(a_proj h + dt_bias), one
per value head and token (from float32 casts of a_proj h and A_log); ``chunk_comba`` / ``fused_recurrent_comba``
with q, k and p L2-normalised in the kernel::

    S_t = exp(g_t) S_{t−1} + β_t k_t (v_t − S_{t−1}ᵀ p_t)ᵀ = (e^{g_t} I − β_t k_t p_tᵀ) S_{t−1} + β_t k_t v_tᵀ,
    o_t = K^−½ S_tᵀ q_t

(the read with p uses the state before the decay, as fla's kernels and ``naive_chunk_comba``); then ``o_norm``: with
``use_output_gate`` fla's σ-gated RMS norm (gate σ(g_proj h)), else its RMS norm; ``o_proj``. The rule is the
diagonal-plus-low-rank rule of :mod:`mamba_captum.kernels.dplr` with D_t = e^{g_t} I, a = p, b = −β k and the written
key β k (as fla_on_cpu's ``chunk_comba`` runs it, :mod:`mamba_captum.fla_cpu.ops_delta_family`).

hidden:  α_h[t, s] = K^−½ q_tᵀ (e^{g_t} I − β_t k_t p_tᵀ) ⋯ (e^{g_{s+1}} I − β_{s+1} k_{s+1} p_{s+1}ᵀ) β_s k_s  (h a
         value head; q, k, p those of its key head as the kernel uses them), over v after its conv.
unified: H_c = diag(ν_c · σ(gate_c)) · α_h · diag(σ(pre_c) · m) · M_c   over v_proj's output before the conv
         (c = (h, p); pre the conv's output, M_c its taps; without a conv diag(σ(v_proj_c) · m)); ν the norm's
         per-token scale, the gate factor 1 without ``use_output_gate``.
q, k, p, β and g come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch

from ..kernels.dplr import l2_normalised
from ..operators import DPLRCore
from .common import run
from .fla_delta_net import delta_layer_input, delta_lrp, delta_operator, dplr_output, output_gate
from .fla_gated_deltanet import head_log_decay

MIXER_CLASSES = ("Comba",)
INNER_MIXERS = {"Comba": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator (a DPLR core: the delta rule with Comba's read-out correction; module docstring)
    from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, h, (q, k, value_pre, act_pre, v) = delta_layer_input(call, formulation)
    core = _core(mixer, h, q, k, work_dtype)
    value_dim = mixer.head_v_dim
    gate, norm = output_gate(mixer, h, mixer.use_output_gate, value_dim)
    return delta_operator(call, formulation, components, work_dtype, mixer=mixer, core=core, value_pre=value_pre,
                          act_pre=act_pre, v=v, gate=gate, norm=norm, heads=mixer.num_v_heads, head_dim=value_dim,
                          core_output=dplr_output(core))


def _core(mixer, h, q, k, work_dtype) -> DPLRCore:
    """The detached :class:`DPLRCore` of the layer from h (B, L, D) and q, k (B, L, H·K) after their convs."""
    batch, length, _ = h.shape
    heads, value_heads, key_dim = mixer.num_heads, mixer.num_v_heads, mixer.head_k_dim
    with torch.no_grad():
        q, k = (x.double().reshape(batch, length, heads, key_dim) for x in (q, k))
        p = k * torch.sigmoid(mixer.decay.double())[:, None] if mixer.use_inner_decay else k
        if mixer.use_output_correction:
            q = q - mixer.D.double()[:, None] * p
        beta = torch.sigmoid(run(mixer.b_proj, h).double())
        # fla computes g from float32 casts of a_proj's output and A_log (float32 even in a float64 model)
        log_decay = head_log_decay(run(mixer.a_proj, h).float(), mixer.A_log.float(), mixer.dt_bias)
        # the kernel's L2 norm (eps inside the root), key heads repeated for the value heads
        q, k, p = (l2_normalised(x) for x in (q, k, p))
        q, k, p = (x.repeat_interleave(value_heads // heads, dim=2) for x in (q, k, p))
        written = beta[..., None] * k  # β k: written with the value; −β k: erases what p reads
        channel_decay = log_decay[..., None].expand(batch, length, value_heads, key_dim)
        cast = lambda t: t.to(work_dtype)  # noqa: E731
        return DPLRCore(cast(q), cast(written), cast(p), cast(-written), channel_decay, scale=key_dim ** -0.5)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_delta_net.delta_lrp`: the DPLR core α (q with its
    read-out correction, k, p, β, the decays) detached, the values' SiLU by the identity rule, ν detached, the gate by
    its rule). (B, L, D), float64."""
    with torch.no_grad():
        mixer, h, (q, k, *_) = delta_layer_input(call, "lrp")
        core = _core(mixer, h, q, k, work_dtype)
    return delta_lrp(call, work_dtype, core=core, gated=mixer.use_output_gate, heads=mixer.num_v_heads,
                     head_dim=mixer.head_v_dim)
