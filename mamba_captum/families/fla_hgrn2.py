"""flash-linear-attention's HGRN-2: ``HGRN2Attention`` (model type ``hgrn2``); also the pieces the adapters of fla's
HGRN, LightNet and RetNet share with it: a projection through its optional short conv (:func:`projected`) and the
operator of a layer whose RMS norm spans all of its heads (:func:`width_norm_operator`).

Forward (fla 0.6.0, ``fla/layers/hgrn2.py``): q, f, i = the projections of h (each through a short conv without
activation when ``use_short_conv``); q ← swish(q); g = logsigmoid(f), raised by the model's per-layer lower bound λ
(layers after the first: g ← log(λ + (1 − λ)·e^g)); k = 1 − e^g; per head (K = ``expand_ratio`` key channels, P value
channels) ``o = gla(q, k, i, g)``: S_t = diag(e^{g_t}) S_{t−1} + k_t i_tᵀ, o_t = K^−½ S_tᵀ q_t; then
``o_proj(rms_norm(o))`` with ONE RMS norm over all H·P channels of a token (fla's ``rms_norm_linear``, its default
eps 1e-5: the layer does not pass ``g_norm.eps``).

hidden:  α_h[t, s] = K^−½ Σ_k q_t,k k_s,k e^{Γ_t,k − Γ_s,k}  (s ≤ t; Γ the cumulative g)  over i (after its conv).
unified: H_c = diag(ν_c) · α_h · diag(m) · M_c  over i before its conv (M_c the conv's band; without a conv
         H_c = diag(ν_c) · α_h · diag(m)); ν_c = weight_c / rms of the token's whole o, from the real activations.
q, k and the decays come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.gated_linear import gated_linear_chunked
from ..operators import GatedLinearCore, HeadOperator, gate_norm_rows, masked_tokens
from .common import linear_readout, run
from .fla_heads import short_conv

MIXER_CLASSES = ("HGRN2Attention",)
INNER_MIXERS = {"HGRN2Attention": ("q_conv1d", "f_conv1d", "i_conv1d")}  # the short convs: part of H
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's HGRN-2 has none yet (its "
                   "lower-bounded forget gate and layer-wide norm need their own)")
RMS_NORM_LINEAR_EPS = 1e-5  # fla.modules.norm.layernorm.rms_norm_linear's default, which HGRN-2 relies on


def projected(mixer, h, name: str, conv_name: str):
    """(before the conv, the conv's pre-activation or None, after the conv) of projection ``name`` of h (B, L, D)
    through the layer's short conv ``conv_name`` (when ``mixer.use_short_conv``)."""
    x = run(getattr(mixer, name), h)
    if not mixer.use_short_conv:
        return x, None, x
    pre, out = short_conv(getattr(mixer, conv_name), x)
    return x, pre, out


def refuse_packed(call, family: str) -> None:
    """fla's layers take packed sequences through ``cu_seqlens``; the rebuilds read one sequence per batch row."""
    if call.options.get("cu_seqlens") is not None:
        raise NotImplementedError(f"mamba_captum: {family} called with cu_seqlens (packed sequences); pass a padded "
                                  "batch with an attention_mask instead.")


def refuse_conv_bias(mixer, conv_name: str, formulation: str, family: str) -> None:
    """A conv bias comes from no token: the unified operator over the values before the conv would not be linear."""
    if formulation == "unified" and mixer.use_short_conv and getattr(mixer, conv_name).bias is not None:
        raise NotImplementedError(f"mamba_captum: the unified operator of a {family} layer whose value conv has a bias "
                                  "is not linear in the values; use formulation='hidden'.")


def width_norm_operator(call, formulation, components, work_dtype, *, core, heads: int, head_dim: int, values,
                        output, gate, norm_weight, eps: float, out_proj, value_pre=None, act_pre=None, taps=None,
                        zero_pads: bool = True):
    """The hidden or unified :class:`HeadOperator` of a layer whose output is ``out_proj(ν(o) ⊙ gate ⊙ o)`` with
    ``o = α v`` per head and ν ONE RMS scale over all H·P channels of a token (fla's HGRN, HGRN-2, LightNet; the
    per-head norm is :func:`.fla_heads.head_operator`).

    Args:
        core: the core α (of :mod:`mamba_captum.operators.heads`) for this formulation.
        values: (B, L, H, P) what the core mixes (hidden). output: (B, L, H, P) ``o``, float64.
        gate: (B, L, H, P) the output gate act(z), or None. norm_weight: (H·P,) the norm's weight, or None; eps: its
            epsilon.
        value_pre: (B, L, H·P) the values before the conv and activation (unified x); None: ``values``.
        act_pre: (B, L, H·P) the pre-activation of a SiLU on the values (after the conv), or None.
        taps: (H·P, W) a bias-free linear causal conv on the values, or None.
        zero_pads: zero the pads' rebuilt outputs (fla repads an unpadded batch with zeros); False for a layer that
            runs its pads (HGRN).
    Returns:
        (operator, the mixer's rebuilt output (B, L, D)).
    """
    hidden_states, mask = call.hidden_states, call.attention_mask
    batch, length = hidden_states.shape[:2]
    per_head = lambda t: t.reshape(batch, length, heads, head_dim)  # noqa: E731
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    gate = None if gate is None else gate.double()
    weight = None if norm_weight is None else norm_weight.double()

    def nu(out):  # the RMS scale over the token's H·P channels, (B, L, H, P), float64
        flat = out.reshape(batch, length, heads * head_dim)
        scale = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
        return per_head(scale.expand_as(flat) if weight is None else scale * weight)

    def scaled(out):  # ν(out) ⊙ gate ⊙ out, float64
        return nu(out) * (out if gate is None else gate * out)

    inner = scaled(output.double())
    rebuilt = run(out_proj, inner.reshape(batch, length, -1).to(hidden_states.dtype))
    if mask is not None and zero_pads:
        rebuilt = rebuilt * mask.to(rebuilt.dtype)[:, :, None]
    readout_proj = linear_readout(out_proj)
    operator_mask = None if mask is None else w(mask)
    common = dict(mask=operator_mask, heads=heads, head_dim=head_dim)
    if formulation == "hidden":  # the core's output; the norm and the gate come after it
        return HeadOperator(core, **common, values=w(values), output=w(output),
                            readout=lambda out: readout_proj(scaled(out).reshape(batch, length, -1))), rebuilt
    row = gate_norm_rows(components, w(gate), w(nu(output.double())))
    col = per_head(torch.sigmoid(w(act_pre))) if act_pre is not None and "act" in components else None
    if operator_mask is not None:
        mask_col = operator_mask[:, :, None, None].expand(batch, length, heads, head_dim)
        col = mask_col if col is None else col * mask_col
    conv = w(taps).reshape(heads, head_dim, -1) if taps is not None and "conv" in components else None
    if row is None and col is None and conv is None:
        col = torch.ones(batch, length, heads, head_dim, dtype=work_dtype, device=hidden_states.device)
    operator = HeadOperator(core, **common, row_weight=row, col_weight=col, conv_weight=conv, s6="s6" in components,
                            values=per_head(w(value_pre)) if value_pre is not None else w(values),
                            output=w(inner), readout=lambda out: readout_proj(out.reshape(batch, length, -1)))
    return operator, rebuilt


def lower_bounded(log_forget: torch.Tensor, call) -> torch.Tensor:
    """HGRN's and HGRN-2's forget gate raised by the model's lower bound λ of this layer (not the first layer's):
    log(λ + (1 − λ)·e^g), float64."""
    bound = call.options.get("lower_bound")
    if bound is None or not call.located.module.layer_idx > 0:
        return log_forget
    bound = bound.double()
    return torch.logaddexp(bound.log(), torch.log1p(-bound) + log_forget)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    refuse_packed(call, "HGRN-2")
    refuse_conv_bias(mixer, "i_conv1d", formulation, "HGRN-2")
    if getattr(mixer.g_norm, "bias", None) is not None:
        raise NotImplementedError("mamba_captum: HGRN-2's output norm with a bias is not an RMS scale.")
    mask = call.attention_mask
    if mixer.mode == "fused_chunk" and call.hidden_states.shape[1] > 64 and mask is not None and not bool(mask.all()):
        # fla 0.6 calls fused_chunk_gla without cu_seqlens: its padded batches run as one sequence
        raise NotImplementedError("mamba_captum: fla's HGRN-2 in mode 'fused_chunk' mixes the sequences of a padded "
                                  "batch longer than 64 tokens; explain one sequence at a time, or use mode 'chunk'.")
    h = masked_tokens(call.hidden_states, mask)
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_f_dim, mixer.head_i_dim
    q = F.silu(projected(mixer, h, "q_proj", "q_conv1d")[2].double())
    log_forget = lower_bounded(F.logsigmoid(projected(mixer, h, "f_proj", "f_conv1d")[2].double()), call)
    key = 1 - log_forget.exp()
    value_pre, _, v = projected(mixer, h, "i_proj", "i_conv1d")
    if mask is not None:  # pads write nothing (fla drops them; a conv bias would give them keys and values)
        key = key * mask[:, :, None].to(key.dtype)
        v = v * mask[:, :, None].to(v.dtype)
    split = lambda t, d: t.reshape(batch, length, heads, d)  # noqa: E731
    q, key, log_forget = split(q, key_dim), split(key, key_dim), split(log_forget, key_dim)
    v = split(v, value_dim)
    scale = key_dim ** -0.5
    with torch.no_grad():
        core = GatedLinearCore(q.detach().to(work_dtype), key.detach().to(work_dtype), log_forget.detach(), scale)
    values = v.to(work_dtype)
    output, _ = gated_linear_chunked(core.q.double(), core.k.double(), values.double(), log_forget, scale=scale)
    taps = mixer.i_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return width_norm_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                               values=values, output=output, gate=None, norm_weight=mixer.g_norm.weight,
                               eps=RMS_NORM_LINEAR_EPS, out_proj=mixer.o_proj,
                               value_pre=value_pre if mixer.use_short_conv else None, taps=taps)
