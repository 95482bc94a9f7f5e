"""flash-linear-attention's Cyclic Flow Attention: ``CyclicFlowAttention`` (model type ``cyclic_flow_attention``).

Forward (fla 0.6.0, ``fla/layers/cyfa.py``, ops ``fla/ops/cyfa``), h the layer input (fla packs the real tokens; see
Pads): q, k, v = the projections of h, each through its short conv (no activation) or none; log decay
g = −e^{A_log} softplus(a_proj h + dt_bias), one per head; β = σ(b_proj h), the clock steps δ = σ(d_proj h); q and k
through their RMS norms; with M slots, C = M − 1 readout rows, λ_t = Σ_{s≤t} δ_s and the write w_t = β_t a(λ_t)::

    Hk_t = e^{g_t} Hk_{t−1} + k_t w_tᵀ,    Hv_t = e^{g_t} Hv_{t−1} + w_t v_tᵀ
    u_t = R_{−λ_t}(Tᵀ softmax(T R_{+λ_t}(K^−½ Hk_tᵀ q_t))),    o_t = Hv_tᵀ u_t

(T = readout · F, R_{±λ} the slot-pair rotations: :mod:`mamba_captum.kernels.cyclic_flow`); then the gated RMS norm of
C · o per head with gate σ(g_proj h) (``o_norm``, activation sigmoid), ``o_proj``.

hidden:  α_h[t, s] = u_tᵀ w_s e^{Γ_t − Γ_s}  (s ≤ t; Γ the cumulative g)  over v after its conv: gated linear attention
         with query u (which reads q, k, g, β, δ and the readout, never v), key w and one decay per head
         (:class:`GatedLinearCore`, :mod:`mamba_captum.kernels.gated_linear`).
unified: H_c = diag(ν_c · σ(g_c)) · α_h · diag(m) · M_c  over v_proj's output before the conv (M_c the conv's taps, the
         identity without a conv), ν the norm's per-token scale: fla normalises C · o with eps, which is o normalised
         with eps / C².
u and w come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.

Pads: fla unpads the batch (each sequence from zero memories and clock 0). The rebuild runs the padded batch with the
pads' inputs zeroed (:func:`mamba_captum.operators.masked_tokens`) and β and δ zeroed at the pads (their projections
have biases): a pad then writes nothing and does not move the clock (a constant clock offset cancels between the
write and the readout rotations anyway), so the real tokens' outputs are fla's, for left and right padding. A value conv with a bias makes the unified operator affine (refused there); packed sequences and a
cached prefix are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.cyclic_flow import readout_table, value_memory_inputs
from ..kernels.gated_linear import gated_linear_chunked
from ..operators import GatedLinearCore, masked_tokens
from .common import run
from .fla_heads import head_operator, refuse_packed_or_cached, short_conv

MIXER_CLASSES = ("CyclicFlowAttention",)
INNER_MIXERS = {"CyclicFlowAttention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's CyclicFlowAttention has none yet "
                   "(its slot-softmax readout and gated norm need their own)")


def _checked_input(call, formulation: str) -> torch.Tensor:
    """The layer's input h (B, L, D) with the pads zeroed, after refusing packed sequences, a cached prefix and (for
    the unified operator) a value conv with a bias."""
    mixer = call.located.module
    refuse_packed_or_cached(call)
    if formulation == "unified" and mixer.use_short_conv and mixer.v_conv1d.bias is not None:
        raise NotImplementedError("mamba_captum: the unified operator of fla's CyclicFlowAttention whose value conv "
                                  "has a bias is not linear in the values; use formulation='hidden'.")
    return masked_tokens(call.hidden_states, call.attention_mask)


def _projected(mixer, h, name, conv_name):
    """(the projection's output, after its conv (no activation) when the layer has convs)."""
    x = run(getattr(mixer, name), h)
    return x, (short_conv(getattr(mixer, conv_name), x)[1] if mixer.use_short_conv else x)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    h = _checked_input(call, formulation)
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    per_head = lambda t, d: t.reshape(batch, length, heads, d).double()  # noqa: E731
    _, q = _projected(mixer, h, "q_proj", "q_conv1d")
    _, k = _projected(mixer, h, "k_proj", "k_conv1d")
    value_pre, v = _projected(mixer, h, "v_proj", "v_conv1d")
    keep = torch.ones(batch, length, 1, dtype=torch.float64, device=h.device)
    if call.attention_mask is not None:  # the pads' β and δ are σ(bias): zero them (fla drops the pads)
        keep = call.attention_mask.to(torch.float64)[:, :, None]
    # β, δ and g as the layer computes them, in float32 whatever the model's dtype (then exact in float64)
    beta = run(mixer.b_proj, h).float().sigmoid().double() * keep
    delta = run(mixer.d_proj, h).float().sigmoid().double() * keep
    decay = F.softplus(run(mixer.a_proj, h).float() + mixer.dt_bias.float())
    log_decay = (-mixer.A_log.float().exp() * decay).double()
    with torch.no_grad():
        query, write, _, _ = value_memory_inputs(
            per_head(q, key_dim), per_head(k, key_dim), log_decay, delta, beta,
            readout_table(mixer.readout, torch.float64), mixer.q_norm.weight, mixer.k_norm.weight, mixer.q_norm.eps,
            mixer.k_norm.eps, key_dim ** -0.5)
        core = GatedLinearCore(query.to(work_dtype), write.to(work_dtype), log_decay, 1.0)
    values = per_head(v, value_dim).to(work_dtype)
    output, _ = gated_linear_chunked(core.q.double(), core.k.double(), values.double(), log_decay, scale=1.0)
    gate = torch.sigmoid(run(mixer.g_proj[1], run(mixer.g_proj[0], h)).double()).reshape(batch, length, heads,
                                                                                        value_dim)
    if getattr(mixer.o_norm, "activation", None) != "sigmoid":
        raise NotImplementedError(f"mamba_captum: CyclicFlowAttention's gated norm with activation "
                                  f"{getattr(mixer.o_norm, 'activation', None)!r} (fla's layer uses sigmoid).")
    taps = mixer.v_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                         values=values, output=output, gate=gate, norm=mixer.o_norm, out_proj=mixer.o_proj,
                         value_pre=value_pre if mixer.use_short_conv else None, taps=taps,
                         norm_eps=mixer.o_norm.eps / mixer.num_readout_slots ** 2)
