"""flash-linear-attention's HGRN-2: ``HGRN2Attention`` (model type ``hgrn2``); also the pieces the adapters of fla's
HGRN, LightNet and RetNet share with it: a projection through its optional short conv (:func:`projected`) and the
layer's input after the refusals of packed sequences and of a value conv bias (:func:`checked_input`). The operator
of a layer whose RMS norm spans all of its heads is :func:`.fla_heads.head_operator` with ``norm_over_width``.

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
from ..operators import GatedLinearCore, masked_tokens
from .common import run
from .fla_heads import head_lrp, head_operator, rule_values, short_conv

MIXER_CLASSES = ("HGRN2Attention",)
INNER_MIXERS = {"HGRN2Attention": ("q_conv1d", "f_conv1d", "i_conv1d")}  # the short convs: part of H
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


def refuse_norm_bias(norm, family: str) -> None:
    """An output norm with a bias (a LayerNorm) is no per-token scale of o: the operator could not factor it."""
    if getattr(norm, "bias", None) is not None:
        raise NotImplementedError(f"mamba_captum: {family}'s output norm with a bias is not an RMS scale.")


def checked_input(call, formulation: str, family: str, value_conv: str):
    """The layer's input h (B, L, D) with the pads zeroed (:func:`mamba_captum.operators.masked_tokens`), after
    refusing packed sequences and (unified) a bias on the value conv ``value_conv``."""
    refuse_packed(call, family)
    refuse_conv_bias(call.located.module, value_conv, formulation, family)
    return masked_tokens(call.hidden_states, call.attention_mask)


def gated_linear_output(q, k, log_decay, v, scale: float, work_dtype: torch.dtype):
    """(core, values, o) of a gated linear layer (HGRN-2, LightNet, RetNet): the detached :class:`GatedLinearCore` of
    q, k (B, L, H, K) and the log decays (B, L, H, K) or (B, L, H); the values v (B, L, H, P) in ``work_dtype``; and
    o = α v (B, L, H, P) float64 by the chunked kernel."""
    with torch.no_grad():
        core = GatedLinearCore(q.detach().to(work_dtype), k.detach().to(work_dtype), log_decay.detach(), scale)
    values = v.to(work_dtype)
    output, _ = gated_linear_chunked(core.q.double(), core.k.double(), values.double(), log_decay, scale=scale)
    return core, values, output


def lower_bounded(log_forget: torch.Tensor, call) -> torch.Tensor:
    """HGRN's and HGRN-2's forget gate raised by the model's lower bound λ of this layer (not the first layer's):
    log(λ + (1 − λ)·e^g), float64."""
    bound = call.options.get("lower_bound")
    if bound is None or not call.located.module.layer_idx > 0:
        return log_forget
    bound = bound.double()
    return torch.logaddexp(bound.log(), torch.log1p(-bound) + log_forget)


def _core_inputs(call, h: torch.Tensor):
    """(q, k, g) (B, L, H, K) float64 of the layer's GLA op from h (B, L, D): q = swish(q), the lower-bounded forget
    gate g, k = 1 − e^g (zero at the pads: fla drops them; a conv bias would give them keys)."""
    mixer, mask = call.located.module, call.attention_mask
    batch, length, _ = h.shape
    q = F.silu(projected(mixer, h, "q_proj", "q_conv1d")[2].double())
    log_forget = lower_bounded(F.logsigmoid(projected(mixer, h, "f_proj", "f_conv1d")[2].double()), call)
    key = masked_tokens(1 - log_forget.exp(), mask)
    split = lambda t: t.reshape(batch, length, mixer.num_heads, mixer.head_f_dim)  # noqa: E731
    return split(q), split(key), split(log_forget)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_heads.head_lrp`), a differentiable function of
    ``call.hidden_states``: i_proj and its conv linear (a bias a constant), the core α (q, k, the lower-bounded forget
    gates) detached, the layer-wide norm's ν detached. (B, L, D), float64."""
    mixer, mask = call.located.module, call.attention_mask
    h = checked_input(call, "lrp", "HGRN-2", "i_conv1d")
    batch, length, _ = h.shape
    with torch.no_grad():
        q, key, log_forget = _core_inputs(call, h)
        core = GatedLinearCore(q.to(work_dtype), key.to(work_dtype), log_forget, mixer.head_f_dim ** -0.5)
    values = rule_values(mixer, h, mask, work_dtype, "i_proj", "i_conv1d")
    return head_lrp(call, work_dtype, core=core, values=values.reshape(batch, length, mixer.num_heads, -1),
                    gate_input=None, gate_activation=None, norm=mixer.g_norm, out_proj=mixer.o_proj,
                    heads=mixer.num_heads, head_dim=mixer.head_i_dim, norm_over_width=True,
                    norm_eps=RMS_NORM_LINEAR_EPS)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, mask = call.located.module, call.attention_mask
    h = checked_input(call, formulation, "HGRN-2", "i_conv1d")
    refuse_norm_bias(mixer.g_norm, "HGRN-2")
    if mixer.mode == "fused_chunk" and h.shape[1] > 64 and mask is not None and not bool(mask.all()):
        # fla 0.6 calls fused_chunk_gla without cu_seqlens: its padded batches run as one sequence
        raise NotImplementedError("mamba_captum: fla's HGRN-2 in mode 'fused_chunk' mixes the sequences of a padded "
                                  "batch longer than 64 tokens; explain one sequence at a time, or use mode 'chunk'.")
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_f_dim, mixer.head_i_dim
    q, key, log_forget = _core_inputs(call, h)
    value_pre, _, v = projected(mixer, h, "i_proj", "i_conv1d")
    if mask is not None:  # pads write nothing (fla drops them; a conv bias would give them values)
        v = v * mask[:, :, None].to(v.dtype)
    v = v.reshape(batch, length, heads, value_dim)
    scale = key_dim ** -0.5
    core, values, output = gated_linear_output(q, key, log_forget, v, scale, work_dtype)
    taps = mixer.i_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                         values=values, output=output, gate=None, norm=mixer.g_norm, out_proj=mixer.o_proj,
                         value_pre=value_pre if mixer.use_short_conv else None, taps=taps, norm_over_width=True,
                         norm_eps=RMS_NORM_LINEAR_EPS)
