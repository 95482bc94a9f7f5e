"""flash-linear-attention's gated slot attention: ``GatedSlotAttention`` (model type ``gsa``).

Forward (fla 0.6.0, ``fla/layers/gsa.py``): q, k, v = the projections of h (each through a SiLU short conv with
``use_short_conv``); f = ``f_proj h``, M = ``num_slots`` per head; q, k through the feature map (swish, relu or t2r);
v ← silu(v) (so with a conv the values pass two SiLUs); f ← logsigmoid(f) / ``gate_logit_normalizer``; the slot
write weights s = 1 − e^f; keys, values, f and s repeated for ``num_kv_heads``; then fla's gated slot attention
(``fused_recurrent_gsa`` / ``chunk_gsa``, :mod:`mamba_captum.fla_cpu.ops_gsa`), per head two gated linear passes with
a softmax over the slots between them:

    Hk_t = Hk_{t−1} diag(e^{f_t}) + k_t s_tᵀ,  p_t = softmax(scale · Hk_tᵀ q_t)                  (M slot weights)
    Hv_t = diag(e^{f_t}) Hv_{t−1} + s_t v_tᵀ,  o_t = Hv_tᵀ p_t

then ``o_proj(rms_norm(silu(o)))`` with ONE RMS norm over all H·P channels of a token (fla's ``rms_norm_linear`` at
its default eps 1e-5: the layer passes neither ``norm_eps`` nor ``use_norm`` / ``use_output_gate``).

hidden:  α_h[t, s] = Σ_m p_t,m s_s,m e^{F_t,m − F_s,m}  (s ≤ t; F the cumulative f): the second pass, GLA with
         queries p, keys s and per-slot decays (:class:`GatedLinearCore`, scale 1), over the values the op reads
         (silu(v)). p comes from q, k, s, f alone (pass 1, :func:`mamba_captum.kernels.gated_linear.slot_scores`),
         never from the values: o is linear in v given p, and p enters α (detached) as B and C of the SSMs do.
unified: H_c = diag(ν_c · σ(o_c)) · α_h · diag(σ(v_c) · m)  over ``v_proj``'s output v (the SiLU on the values
         and the one on o as their gains σ; ν the norm's scale weight / rms(silu(o)) over the token's width, from the
         real activations); with a value conv H_c = diag(ν_c · σ(o_c)) · α_h · diag(σ(u_c) · σ(pre_c) · m) · M_c over
         v before the conv (pre the conv's pre-activation, u = silu(pre)). ``components``: ``act`` the three gains σ,
         ``norm`` ν, ``conv`` M_c, ``s6`` α.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.gated_linear import gated_linear_chunked, slot_read_weights
from ..operators import GatedLinearCore, HeadOperator
from .common import linear_readout, run
from .fla_heads import rms_scale, short_conv
from .fla_hgrn2 import RMS_NORM_LINEAR_EPS, checked_input, refuse_norm_bias

MIXER_CLASSES = ("GatedSlotAttention",)
INNER_MIXERS = {"GatedSlotAttention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's GSA has none yet (its softmax "
                   "over the slots and its width-wide norm need their own)")


def _projected(mixer, h, name: str, conv_name: str):
    """(before the conv, the conv's pre-activation or None, after the conv) of projection ``name`` of h (B, L, D)."""
    x = run(getattr(mixer, name), h)
    if not mixer.use_short_conv:
        return x, None, x
    pre, out = short_conv(getattr(mixer, conv_name), x)
    return x, pre, out


def slot_inputs(mixer, h, mask):
    """What fla's GSA op reads, from the layer's input h (B, L, D) with its pads zeroed: (q (B, L, H, K),
    k (B, L, H, K), the values silu(v) (B, L, H, P), s (B, L, H, M), f (B, L, H, M) float64, and the values' path
    (v_proj's output, the conv's pre-activation or None, the conv's output), each (B, L, H·P) with the key / value
    heads repeated for ``num_kv_heads``). A pad's keys and values are zeroed (a conv bias would give it some): it
    writes nothing into either state."""
    batch, length, _ = h.shape
    groups = mixer.num_kv_groups
    q = _projected(mixer, h, "q_proj", "q_conv1d")[2]
    k = _projected(mixer, h, "k_proj", "k_conv1d")[2]
    value_pre, conv_pre, conv_out = _projected(mixer, h, "v_proj", "v_conv1d")
    f = F.logsigmoid(run(mixer.f_proj, h).double()) / mixer.gate_logit_normalizer
    heads = lambda t, d: t.reshape(batch, length, -1, d)  # noqa: E731
    repeated = lambda t, d: heads(t, d).repeat_interleave(groups, dim=2)  # noqa: E731
    q, k = heads(q, mixer.head_k_dim), heads(k, mixer.head_k_dim)
    q, k = mixer.feature_map(q), mixer.feature_map(k)
    values = F.silu(conv_out)
    if mask is not None:
        keep = mask.to(k.dtype)[:, :, None, None]
        k, values = k * keep, values * keep[..., 0]
    f = repeated(f, mixer.num_slots)
    s = 1 - f.exp()
    value_path = tuple(None if t is None else repeated(t, mixer.head_v_dim).flatten(2)
                       for t in (value_pre, conv_pre, conv_out))
    return (q, k.repeat_interleave(groups, dim=2), repeated(values, mixer.head_v_dim), s, f, value_path)


def slot_attention(q, k, values, s, f, scale: float, work_dtype: torch.dtype):
    """(core, values, o) of a gated slot attention layer (GSA, Raven): the slot weights p = softmax(pass 1) from
    q, k (B, L, H, K), s and the log decays f (B, L, H, M) (:func:`mamba_captum.kernels.gated_linear.
    slot_read_weights`, float64), the detached :class:`GatedLinearCore` over (p, s) with the decays f (scale 1), the
    values (B, L, H, P) in ``work_dtype`` and o = α v (B, L, H, P) float64 by the chunked kernel."""
    f = f.double()
    with torch.no_grad():
        probs = slot_read_weights(q.double(), k.double(), s.double(), f, scale)
        core = GatedLinearCore(probs.to(work_dtype), s.detach().to(work_dtype), f.detach(), 1.0)
    values = values.to(work_dtype)
    output, _ = gated_linear_chunked(core.q.double(), core.k.double(), values.double(), f, scale=1.0)
    return core, values, output


def slot_operator(call, formulation: str, components: frozenset, work_dtype: torch.dtype, *, core, values, output,
                  after_core, rows, cols, value_pre, conv, heads: int, head_dim: int, out_proj):
    """The hidden or unified :class:`HeadOperator` of a slot attention layer whose output is
    ``out_proj(after_core(o))`` with o = α v per head, and the rebuilt output (pads zeroed: fla repads with zeros).

    Args:
        values: (B, L, H, P) what the core mixes; output: o (B, L, H, P) float64; after_core: o (float64) -> the
            out_proj input (B, L, H, P), the layer's real function of o (the hidden readout).
        rows, cols: unified only: (component, factor (B, L, H, P) or None) pairs, the diagonal factors on the left
            (the activation's gain on o, the norm's scale, an output gate) and on the right (the values' activation
            gains), each kept when its component is; the pad mask is added to the right.
        value_pre: (B, L, H, P) the unified input (v_proj's output, each head's copy); conv: (H, P, K) taps or None.
    """
    hidden_states, mask = call.hidden_states, call.attention_mask
    batch, length = hidden_states.shape[:2]
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    inner = after_core(output)
    rebuilt = run(out_proj, inner.reshape(batch, length, -1).to(hidden_states.dtype))
    if mask is not None:  # fla repads the pads' outputs with zeros
        rebuilt = rebuilt * mask.to(rebuilt.dtype)[:, :, None]
    readout_proj = linear_readout(out_proj)
    operator_mask = w(mask)
    common = dict(mask=operator_mask, heads=heads, head_dim=head_dim)
    if formulation == "hidden":  # the core's output; the activation, norm and gate come after it
        return HeadOperator(core, **common, values=w(values), output=w(output),
                            readout=lambda out: readout_proj(after_core(out).reshape(batch, length, -1))), rebuilt

    def product(factors):
        kept = [w(factor) for name, factor in factors if factor is not None and name in components]
        return None if not kept else torch.stack(kept).prod(0)

    row, col = product(rows), product(cols)
    if operator_mask is not None:
        mask_col = operator_mask[:, :, None, None].expand(batch, length, heads, head_dim)
        col = mask_col if col is None else col * mask_col
    conv = None if conv is None or "conv" not in components else w(conv)
    if row is None and col is None and conv is None:
        col = torch.ones(batch, length, heads, head_dim, dtype=work_dtype, device=hidden_states.device)
    operator = HeadOperator(core, **common, row_weight=row, col_weight=col, conv_weight=conv, s6="s6" in components,
                            values=w(value_pre), output=w(inner),
                            readout=lambda out: readout_proj(out.reshape(batch, length, -1)))
    return operator, rebuilt


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    h = checked_input(call, formulation, "GSA", "v_conv1d")
    refuse_norm_bias(mixer.g_norm, "GSA")
    batch, length, _ = h.shape
    heads, value_dim = mixer.num_heads, mixer.head_v_dim
    q, k, values, s, f, (value_pre, conv_pre, conv_out) = slot_inputs(mixer, h, call.attention_mask)
    scale = mixer.head_k_dim ** -0.5 if mixer.scale is None else mixer.scale
    core, values, output = slot_attention(q, k, values, s, f, scale, work_dtype)

    def after_core(out):  # ν(silu(out)) ⊙ silu(out), float64: the norm's input is the SiLU of the core's output
        activated = F.silu(out)
        return rms_scale(mixer.g_norm, activated, over_width=True, eps=RMS_NORM_LINEAR_EPS) * activated

    per_head = lambda t: None if t is None else t.reshape(batch, length, heads, value_dim)  # noqa: E731
    rows = [("act", torch.sigmoid(output)),
            ("norm", rms_scale(mixer.g_norm, F.silu(output), over_width=True, eps=RMS_NORM_LINEAR_EPS))]
    # the values' SiLU gain σ(u) (u = v_proj's output without a conv), and the conv's own σ(pre)
    cols = [("act", per_head(torch.sigmoid(conv_out))), ("act", per_head(None if conv_pre is None else
                                                                         torch.sigmoid(conv_pre)))]
    conv = None
    if conv_pre is not None:
        taps = mixer.v_conv1d.weight[:, 0, :].reshape(-1, value_dim, mixer.v_conv1d.weight.shape[-1])
        conv = taps.repeat_interleave(mixer.num_kv_groups, dim=0)  # (H, P, K): each head its key-value head's
    return slot_operator(call, formulation, components, work_dtype, core=core, values=values, output=output,
                         after_core=after_core, rows=rows, cols=cols, value_pre=per_head(value_pre), conv=conv,
                         heads=heads, head_dim=value_dim, out_proj=mixer.o_proj)
