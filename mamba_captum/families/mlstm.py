"""xLSTM's mLSTM: xLSTMLayer (xlstm, transformers' own copy) and ``xlstm.xlstm_large.model.mLSTMLayer`` (the
``xlstm`` package's layer, which transformers uses instead whenever that package is importable).

Forward (transformers 5.23, ``xLSTMLayer.forward``): q, k, v, o from linear maps of the mixer input (no conv);
``ĩ = cap(igate h)``, ``f̃ = cap(fgate h)`` (``cap = c·tanh(·/c)``); per head, with ``G_t = Σ_{r≤t} log σ(f̃_r)``, the
stabiliser ``m_t = max(G_t, max_{s≤t} G_t − G_s + ĩ_s)`` and scores ``S = q·k / √d``::

    h_t = Σ_{s≤t} α[t, s] v_s,   α[t, s] = S[t, s] e^{G_t − G_s + ĩ_s − m_t} / (max(|n_t|, e^{−m_t}) + eps),
    n_t = Σ_{s≤t} S[t, s] e^{G_t − G_s + ĩ_s − m_t}

(the normaliser does not depend on v); ``out = out_proj(σ(o) ⊙ (LN_head(h) · w + b))``, LN the per-head layer norm.
The layer ignores ``attention_mask`` (right padding only).

hidden:  α_h over v.
unified: H_c = diag(σ(o_c) · w_c · rstd_{t,h}) · α_h   over the head-centred values v − mean_head(v): the layer norm's
         mean subtraction commutes with α (``h − mean h = α (v − mean v)``), its scale rstd is fixed at its real value.
         The norm bias' share σ(o)·b comes from no token: the readout adds it back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import GatedScoresCore, HeadOperator, gate_norm_rows
from ..rules import sigmoid_gate
from .common import linear_readout, run

MIXER_CLASSES = ("xLSTMLayer", "mLSTMLayer")
IGNORES_ATTENTION_MASK = True


def _soft_cap(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def projections(layer, x):
    """q, k (B, L, H, d_qk), v (B, L, H, d_v), ĩ and f̃ (B, L, H), o (B, L, H·d_v), float64."""
    config = layer.config
    heads = config.num_heads
    x = x.double()
    lin = lambda module, t: F.linear(t, module.weight.double(), None if module.bias is None  # noqa: E731
                                     else module.bias.double())
    if config.weight_mode == "single":
        q, k, v = lin(layer.q, x), lin(layer.k, x), lin(layer.v, x)
        o_pre = lin(layer.ogate_preact, x)
        i_pre = _soft_cap(lin(layer.igate_preact, x), config.gate_soft_cap)
        f_pre = _soft_cap(lin(layer.fgate_preact, x), config.gate_soft_cap)
    else:  # "fused"
        q, k, v, o_pre = torch.tensor_split(lin(layer.qkv_opreact, x), (layer.qk_dim, 2 * layer.qk_dim,
                                                                         2 * layer.qk_dim + layer.v_dim), dim=-1)
        i_pre, f_pre = torch.tensor_split(_soft_cap(lin(layer.ifgate_preact, x), config.gate_soft_cap), (heads,), -1)
    split = lambda t: t.reshape(*t.shape[:2], heads, -1)  # noqa: E731
    return split(q), split(k), split(v), i_pre, f_pre, o_pre


def _eps(layer):
    config = layer.config
    return config.eps if hasattr(config, "eps") else config.mlstm_backend.eps  # transformers / the xlstm package


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed, (B, L, D).
    """
    layer = call.located.module
    hidden = call.hidden_states
    batch, length, _ = hidden.shape
    q, k, v, i_pre, f_pre, o_pre = projections(layer, hidden)
    heads, head_dim = v.shape[2], v.shape[3]
    cumulative = F.logsigmoid(f_pre).cumsum(1)  # G (B, L, H)
    stabiliser = cumulative + torch.cummax(i_pre - cumulative, dim=1).values.clamp(min=0.0)  # m_t
    q = q * q.shape[-1] ** -0.5
    unnormalised = GatedScoresCore(q, k, cumulative, log_col=i_pre, log_row=-stabiliser).full()  # (B, H, L, L)
    normaliser = unnormalised.sum(-1).transpose(1, 2)  # n_t (B, L, H)
    denominator = torch.maximum(normaliser.abs(), torch.exp(-stabiliser)) + _eps(layer)
    core = GatedScoresCore(q.to(work_dtype), k.to(work_dtype), cumulative, log_col=i_pre,
                           log_row=-stabiliser - denominator.log())
    output = torch.einsum("bhts,bshd->bthd", unnormalised / denominator.transpose(1, 2)[..., None], v)  # h
    norm = layer.multihead_norm
    weight = norm.weight.double().reshape(heads, head_dim)
    bias = None if getattr(norm, "bias", None) is None else norm.bias.double().reshape(heads, head_dim)
    gate = torch.sigmoid(o_pre).reshape(batch, length, heads, head_dim)

    def normed(h):  # the per-head layer norm with its weight (bias apart)
        centred = h - h.mean(-1, keepdim=True)
        return centred * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + norm.eps) * weight

    constant = torch.zeros_like(gate) if bias is None else gate * bias
    rebuilt = run(layer.out_proj, (gate * normed(output) + constant).reshape(batch, length, -1).to(hidden.dtype))
    out_proj = linear_readout(layer.out_proj)
    w = lambda t: t.to(work_dtype)  # noqa: E731
    common = dict(mask=None if call.attention_mask is None else w(call.attention_mask), heads=heads,
                  head_dim=head_dim)
    if formulation == "hidden":  # the operator's output is h; norm, gate and out_proj come after it
        return HeadOperator(core, **common, values=w(v), output=w(output),
                            readout=lambda out: out_proj((gate * normed(out) + constant).reshape(batch, length, -1))
                            ), rebuilt
    rstd = torch.rsqrt(output.var(-1, keepdim=True, unbiased=False) + norm.eps)  # fixed at its real value
    row = gate_norm_rows(components, gate, rstd * weight)
    centred = v - v.mean(-1, keepdim=True)
    operator = HeadOperator(core, **common, row_weight=None if row is None else w(row),
                            col_weight=None if row is not None else torch.ones_like(w(v)), s6="s6" in components,
                            values=w(centred), output=w(gate * normed(output)),
                            readout=lambda out: out_proj((out + constant).reshape(batch, length, -1)))
    return operator, rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP-style rules: the projections (linear), the core α (scores, gates and the
    normaliser, from the real activations) detached, so h is linear in v; the per-head layer norm with σ detached
    (centring linear, its bias a constant); the output gate ``σ(o) ⊙ ·`` by
    :func:`mamba_captum.rules.sigmoid_gate`. (B, L, D), float64."""
    layer = call.located.module
    hidden = call.hidden_states
    batch, length, _ = hidden.shape
    q, k, v, i_pre, f_pre, o_pre = projections(layer, hidden)
    heads, head_dim = v.shape[2], v.shape[3]
    with torch.no_grad():
        cumulative = F.logsigmoid(f_pre).cumsum(1)
        stabiliser = cumulative + torch.cummax(i_pre - cumulative, dim=1).values.clamp(min=0.0)
        scaled_q = q * q.shape[-1] ** -0.5
        unnormalised = GatedScoresCore(scaled_q, k, cumulative, log_col=i_pre, log_row=-stabiliser).full()
        denominator = torch.maximum(unnormalised.sum(-1).transpose(1, 2).abs(), torch.exp(-stabiliser)) + _eps(layer)
        alpha = unnormalised / denominator.transpose(1, 2)[..., None]
    output = torch.einsum("bhts,bshd->bthd", alpha, v)
    norm = layer.multihead_norm
    weight = norm.weight.double().reshape(heads, head_dim)
    bias = None if getattr(norm, "bias", None) is None else norm.bias.double().reshape(heads, head_dim)
    rstd = torch.rsqrt(output.detach().var(-1, keepdim=True, unbiased=False) + norm.eps)
    normed = (output - output.mean(-1, keepdim=True)) * rstd * weight
    if bias is not None:
        normed = normed + bias
    gated = sigmoid_gate(o_pre.reshape(batch, length, heads, head_dim), normed)
    return linear_readout(layer.out_proj)(gated.reshape(batch, length, -1))
