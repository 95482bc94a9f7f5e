"""Gated delta-net: Qwen3NextGatedDeltaNet (qwen3_next), Qwen3_5GatedDeltaNet / Qwen3_5MoeGatedDeltaNet (qwen3_5,
qwen3_5_moe), Qwen4ExpTextGatedDeltaNet (qwen4_exp), OlmoHybridGatedDeltaNet (olmo_hybrid), LaraMiniGatedDeltaNet
(lara_mini, transformers ≥ 5.24); the softmax layers of these hybrids are softmax layers (:mod:`.softmax`). The pieces
shared with KDA (:mod:`.kda`) live here.

Forward (transformers 5.23, ``Qwen3NextGatedDeltaNet.forward``): ``h·m`` (pads zeroed); q, k, v, z, b, a from the
input projections (Qwen3-Next: one interleaved ``in_proj_qkvz`` / ``in_proj_ba``; Qwen3.5 and Qwen4-exp:
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; OLMo-hybrid: ``q/k/v/g/b/a_proj``, ``o_proj``); ``silu(conv(q ‖ k ‖ v))`` (depthwise, causal, no bias); q, k L2-normalised (eps 1e-6), q scaled
by d_k^−½, key heads repeated for the value heads; ``β = σ(b)`` (×2 where ``allow_neg_eigval``),
``g = −exp(A_log)·softplus(a + dt_bias)``; ``o = delta_rule(q, k, v, g, β)``; ``out = out_proj(ν·act(z)·o)``
with ν the gated RMS norm's scale (weight / rms over the head's value channels, before the gate) and act its gate
activation (silu; Qwen4-exp's ``output_gate_type`` may make it sigmoid). LaraMini's mixer is Qwen3.5's (same
projections, conv, gates and kernel call); only its gated norm differs, applying its weight in float32 (Qwen3.5: in the
input dtype), the same ν to rounding. Its published checkpoints fuse the four input projections into one ``in_proj``,
which transformers splits on loading: the loaded module has Qwen3.5's names.

hidden:  α_h[t, s] = q_tᵀ (I − β_t k_t k_tᵀ) D_t ⋯ (I − β_{s+1} k_{s+1}k_{s+1}ᵀ) D_{s+1} β_s k_s   over v (after conv).
unified: H_c = diag(ν_c · act(z_c)) · α_h · diag(σ(pre_c)·m) · M_c   for value channel c of head h,  over v before
         the conv (pre: the conv output, ν computed from the real activations).
q and k come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from transformers.activations import ACT2FN

from ..kernels.delta_rule import delta_rule_output_chunked
from ..operators import DeltaRuleCore, HeadOperator, gate_norm_rows, masked_tokens
from ..rules import half_product, sigmoid_gate, silu_rule
from .common import linear_readout, run

MIXER_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                 "Qwen4ExpTextGatedDeltaNet", "OlmoHybridGatedDeltaNet", "LaraMiniGatedDeltaNet")


def silu_mixer(call, why: str):
    """The recorded mixer, refused unless its conv activation is SiLU (``why``: what assumes it)."""
    mixer = call.located.module
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; {why}.")
    return mixer


def conv_inputs(call, why: str, conv_dtype: torch.dtype | None = None):
    """What :func:`rebuild` and :func:`lrp` both start from: (mixer, masked input h, the projections
    (q, k, v, z, b, a), the conv's pre-activation over cat(q, k, v), in ``conv_dtype``: see :func:`causal_conv`)."""
    mixer = silu_mixer(call, why)
    h = masked_tokens(call.hidden_states, call.attention_mask)
    pieces = projections(mixer, h)
    return mixer, h, pieces, causal_conv(torch.cat(pieces[:3], dim=-1), mixer.conv1d, conv_dtype)


def projections(mixer, h):
    """q, k (B, L, H_k·K), v and the output gate's input z (B, L, H_v·P), b and a (B, L, H_v)."""
    flat = lambda t: t.reshape(t.shape[0], t.shape[1], -1)  # noqa: E731
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head
        query, key, value, z, b, a = mixer.fix_query_key_value_ordering(run(mixer.in_proj_qkvz, h),
                                                                        run(mixer.in_proj_ba, h))
        return flat(query), flat(key), flat(value), flat(z), b, a
    if hasattr(mixer, "in_proj_qkv"):  # Qwen3.5, Qwen4-exp: contiguous, head-major
        query, key, value = run(mixer.in_proj_qkv, h).split([mixer.key_dim, mixer.key_dim, mixer.value_dim], -1)
        return query, key, value, run(mixer.in_proj_z, h), run(mixer.in_proj_b, h), run(mixer.in_proj_a, h)
    return (run(mixer.q_proj, h), run(mixer.k_proj, h), run(mixer.v_proj, h), run(mixer.g_proj, h),
            run(mixer.b_proj, h), run(mixer.a_proj, h))  # OLMo-hybrid


def output_modules(mixer):
    """(gated norm, output projection): ``norm`` / ``out_proj``, or OLMo's and KDA's ``o_norm`` / ``o_proj``."""
    norm = mixer.norm if hasattr(mixer, "norm") else mixer.o_norm
    return norm, (mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj)


def gate_activation(norm, gate_input):
    """The gated norm's gate, float64: ``ACT2FN[norm.activation]`` (silu or sigmoid)."""
    return ACT2FN[getattr(norm, "activation", "silu")](gate_input.double())


def gated_rms_scale(mixer_norm, output):
    """ν (B, L, H, P): the gated RMS norm's per-token scale, weight / rms over each head's value channels."""
    inv_rms = torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + mixer_norm.variance_epsilon)
    return mixer_norm.weight.to(output.dtype) * inv_rms


def causal_conv(x, conv, dtype: torch.dtype | None = None):
    """The depthwise causal conv's pre-activation (B, L, C), x (B, L, C), in ``dtype``, by default the conv's (as
    HF runs it: the maps reproduce that). MambaLRP's rules pass their work dtype: a conv kept in float32 inside a
    float64 model (transformers ≥ 5.24 keeps BailingHybrid's ``conv1d`` in float32) would otherwise round the
    relevance path, and the relevance would no longer sum to the modified forward's value."""
    dtype = conv.weight.dtype if dtype is None else dtype
    kernel = conv.weight.shape[-1]
    length = x.shape[1]
    bias = None if conv.bias is None else conv.bias.to(dtype)
    return F.conv1d(x.transpose(1, 2).to(dtype), conv.weight.to(dtype), bias, padding=kernel - 1,
                    groups=x.shape[-1])[..., :length].transpose(1, 2)


def delta_rule_inputs(query, key, beta, log_decay, value_heads, key_dim, work_dtype):
    """q, k as the kernel uses them: L2-normalised (eps 1e-6, FLA's convention), q scaled by K^−½, key heads repeated
    for the value heads. query, key: (B, L, H_k·K) after the conv. Returns the :class:`DeltaRuleCore`."""
    batch, length, _ = query.shape
    q = query.to(work_dtype).reshape(batch, length, -1, key_dim)
    k = key.to(work_dtype).reshape(batch, length, -1, key_dim)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * key_dim ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = value_heads // q.shape[2]
    q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    return DeltaRuleCore(q, k, beta.to(work_dtype), log_decay.to(torch.float64))


def operator_from_pieces(call, formulation, components, work_dtype, *, core, value_pre, conv_pre, taps, gate,
                         norm, out_proj, value_heads, head_dim):
    """The hidden or unified operator of a delta-rule layer from its rebuilt pieces (shared by the delta-rule
    families).

    Args:
        core: the :class:`DeltaRuleCore`. value_pre, conv_pre: (B, L, H_v·P) the values before the conv and the
            conv's pre-activation (the values are silu(conv_pre)). taps: (H_v·P, K) the value channels' conv taps.
        gate: (B, L, H_v·P) the output gate (silu(z) or σ(g)). norm: the gated RMS norm module.
        out_proj: the output projection module.
    Returns:
        (operator, rebuilt_output).
    """
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, _ = hidden.shape
    per_head = lambda t: t.reshape(batch, length, value_heads, head_dim)  # noqa: E731
    w = lambda t: t.to(work_dtype)  # noqa: E731
    values = per_head(w(F.silu(conv_pre)))
    output = delta_rule_output_chunked(core.q, core.k, core.beta, core.log_decay, values)  # (B, L, H, P)
    gate = per_head(w(gate))
    nu = gated_rms_scale(norm, output)
    inner = (nu * gate * output).reshape(batch, length, -1)
    rebuilt = run(out_proj, inner.to(hidden.dtype))
    readout_proj = linear_readout(out_proj)
    operator_mask = None if mask is None else w(mask)
    common = dict(mask=operator_mask, heads=value_heads, head_dim=head_dim)
    if formulation == "hidden":  # the operator's output is the delta rule's; the norm and gate come after it
        gate64 = gate.double()

        def readout(out):
            return readout_proj((gated_rms_scale(norm, out) * gate64 * out).reshape(batch, length, -1))

        return HeadOperator(core, **common, values=values, output=output, readout=readout), rebuilt
    row = gate_norm_rows(components, gate, nu)
    col = per_head(torch.sigmoid(w(conv_pre))) if "act" in components else None
    if operator_mask is not None:
        mask_col = operator_mask[:, :, None, None].expand(batch, length, value_heads, head_dim)
        col = mask_col if col is None else col * mask_col
    conv = w(taps).reshape(value_heads, head_dim, -1) if "conv" in components else None
    if row is None and col is None and conv is None:
        col = torch.ones_like(values)  # keep the per-channel layout of the unified operator
    operator = HeadOperator(core, **common, row_weight=row, col_weight=col, conv_weight=conv, s6="s6" in components,
                            values=per_head(w(value_pre)), output=(nu * gate * output),
                            readout=lambda out: readout_proj(out.reshape(batch, length, -1)))
    return operator, rebuilt


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, h, (query, key, value, z, b, a), conv_pre = conv_inputs(call, "the unified operator is defined for silu")
    key_dim = mixer.key_dim
    mixed = F.silu(conv_pre)
    query, key = mixed[..., :key_dim], mixed[..., key_dim:2 * key_dim]
    beta = torch.sigmoid(b.double())
    if getattr(mixer, "allow_neg_eigval", False):
        beta = beta * 2.0
    log_decay = -torch.exp(mixer.A_log.double()) * F.softplus(a.double() + mixer.dt_bias.double())
    core = delta_rule_inputs(query, key, beta, log_decay, mixer.num_v_heads, mixer.head_k_dim, work_dtype)
    norm, out_proj = output_modules(mixer)
    return operator_from_pieces(call, formulation, components, work_dtype, core=core, value_pre=value,
                                conv_pre=conv_pre[..., 2 * key_dim:], taps=mixer.conv1d.weight[2 * key_dim:, 0, :],
                                gate=gate_activation(norm, z), norm=norm, out_proj=out_proj,
                                value_heads=mixer.num_v_heads, head_dim=mixer.head_v_dim)


def core_output(core, values):
    """``Σ_s α_h[t, s] v_s`` (B, L, H, P) with the core α (B, H, L, L) detached: linear in the values."""
    return torch.einsum("bhts,bshp->bthp", core.full().detach().to(values.dtype), values)


def output_gate(norm, gate_input, output):
    """The gated norm's gate ``act(z) ⊙ o`` under the rules: SiLU by the identity rule and the half rule, a sigmoid
    by :func:`mamba_captum.rules.sigmoid_gate`."""
    activation = getattr(norm, "activation", "silu")
    if activation in ("silu", "swish"):
        return half_product(output, silu_rule(gate_input))
    if activation == "sigmoid":
        return sigmoid_gate(gate_input, output)
    raise NotImplementedError(f"mamba_captum: MambaLRP has no rule for the output gate activation {activation!r}.")


def delta_rule_lrp(core, value_pre, gate_input, norm, out_proj, heads, head_dim, work_dtype):
    """A delta-rule layer's output under MambaLRP-style rules (shared with KDA): the values' SiLU by the identity
    rule, the core α (q, k, β and the decays) detached, the gated norm's normaliser ν detached, the output gate by
    :func:`output_gate`. value_pre, gate_input: (B, L, H·P), differentiable. (B, L, D), float64."""
    batch, length, _ = value_pre.shape
    per_head = lambda t: t.reshape(batch, length, heads, head_dim)  # noqa: E731
    values = per_head(silu_rule(value_pre.to(work_dtype)))
    output = core_output(core, values)
    nu = gated_rms_scale(norm, output.detach())
    gated = output_gate(norm, per_head(gate_input.to(work_dtype)), output)
    return linear_readout(out_proj)((nu * gated).reshape(batch, length, -1).double())


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP-style rules, a differentiable function of ``call.hidden_states``: the
    projections and the conv (linear), the values' SiLU by the identity rule, the delta rule's core α (q, k, β and
    the decay g: the layer's selection) detached, so the output is linear in the values; the gated RMS norm's
    normaliser detached and its gate by :func:`output_gate`. (B, L, D), float64."""
    mixer, h, (query, key, value, z, b, a), conv_pre = conv_inputs(call, "MambaLRP's rules are written for silu",
                                                                   work_dtype)
    key_dim = mixer.key_dim
    with torch.no_grad():
        mixed = F.silu(conv_pre)
        beta = torch.sigmoid(b.double())
        if getattr(mixer, "allow_neg_eigval", False):
            beta = beta * 2.0
        log_decay = -torch.exp(mixer.A_log.double()) * F.softplus(a.double() + mixer.dt_bias.double())
        core = delta_rule_inputs(mixed[..., :key_dim], mixed[..., key_dim:2 * key_dim], beta, log_decay,
                                 mixer.num_v_heads, mixer.head_k_dim, work_dtype)
    norm, out_proj = output_modules(mixer)
    return delta_rule_lrp(core, conv_pre[..., 2 * key_dim:], z, norm, out_proj, mixer.num_v_heads, mixer.head_v_dim,
                          work_dtype)
