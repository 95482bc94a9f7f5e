"""flash-linear-attention's RWKV-6: ``RWKV6Attention`` (model type ``rwkv6``).

Forward (fla 0.6.0, ``fla/layers/rwkv6.py``), h the layer input with pads zeroed: ``δ = token_shift(h)``
(h_{t−1} − h_t, zero before the first token); the data-dependent interpolation (ddlerp)
``μ_∗ = W_2,∗ tanh(x_proj[0](h + δ ⊙ μ_x)) + x_bias_∗`` for ∗ ∈ r, w, k, v, g; ``r = r_proj(h + δ ⊙ μ_r)``, likewise
w (a LoRA with tanh), k, v, g; pads of v zeroed; ``w ← −exp(w)`` (the log decays) and the bonus u (H, K); the core
``o_t = r_tᵀ (S_{t−1} + diag(u) k_t v_tᵀ)``, ``S_t = diag(e^{w_t}) S_{t−1} + k_t v_tᵀ`` (fla's ``chunk_rwkv6`` /
``fused_recurrent_rwkv6``, scale 1); then ``g_norm``, a LayerNorm over each head's value channels (mean μ_t, inverse
deviation s_t, weight w_c, bias b_c); ``o_proj(g_norm(o) ⊙ act(g))`` (act: swish by default).

hidden:  α_h[t, s] = Σ_K r_t k_s e^{Σ_{s<τ<t} w_τ} (s < t),  α_h[t, t] = Σ_K r_t u k_t  over v (pads zeroed);
         the norm and the gate are the readout.
unified: H_c = diag(act(g_c) · w_c s_t) · α_h · diag(m)  over the same values.

The norm is an affine map per token with its statistics μ_t, s_t held fixed (as for RWKV-7, :mod:`.fla_rwkv7`): its
linear part ``w_c s_t`` is a row weight; ``act(g) ⊙ (b − w s μ)`` comes from no value of the operator's input (the
mean is a sum over a head's channels of the same token) and is added by the readout: ``operator.output`` is
``H x``, ``operator.readout(output)`` the layer's output. The bonus is inside the core op, so α_h holds it and the
core stays per head. components: "gate" (act(g)), "norm" (w s), "s6" (the core; without it α = I).
The token shift and the ddlerp act on the layer input before the projections and are not folded into H.

Pads: RWKV-6 zeroes the pad inputs and values itself (no unpadding), so the state is zero before the first real
token and left padding is exact; the rebuild follows it, pad rows included. Packed sequences (``cu_seqlens``) are
refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.gated_linear import gated_linear_chunked
from ..operators import GatedLinearCore, HeadOperator
from .common import linear_readout, run
from .fla_rwkv7 import group_norm, norm_statistics, shifted_input

MIXER_CLASSES = ("RWKV6Attention",)
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's RWKV-6 has none yet (its "
                   "group norm and data-dependent token shift need their own)")


def gate_activation(mixer):
    """The output gate's activation as a float64 function: fla's ACT2FN entry the layer holds (swish or sigmoid)."""
    function = getattr(mixer.gate_fn, "__mamba_captum_original__", mixer.gate_fn)
    owner = getattr(function, "__self__", None)
    name = getattr(owner, "__name__", None) or getattr(function, "__name__", "")
    if name in ("SwishFunction", "swish", "silu") or function is F.silu:
        return F.silu
    if name in ("SigmoidFunction", "sigmoid") or function is torch.sigmoid:
        return torch.sigmoid
    raise NotImplementedError(f"mamba_captum: RWKV6Attention's gate_fn {mixer.gate_fn!r} is not a known activation.")


def layer_inputs(mixer, call):
    """What RWKV6Attention computes before its core, from the recorded call: r, w (log decays), k (B, L, H, K),
    v (B, L, H, P) pads zeroed, and the gate act(g) (B, L, H, P), all float64."""
    mask = call.attention_mask
    h, delta = shifted_input(mixer, call)
    batch, length, width = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    lerp, activation, project = mixer.x_proj
    low = run(activation, run(lerp.linear, h + delta * lerp.mu)).view(batch, length, -1, mixer.proj_low_rank_dim)
    mixes = torch.einsum("btnr,hnr->btnh", low, project.weight.view(width, 5, -1)) + mixer.x_bias
    projected = [run(module.linear, h + delta * mu).double()
                 for module, mu in zip((mixer.r_proj, mixer.w_proj, mixer.k_proj, mixer.v_proj, mixer.g_proj),
                                       mixes.unbind(-2))]
    r, w, k, v, g = projected
    if mask is not None:
        v = v * mask.to(v.dtype)[:, :, None]
    per_head = lambda t, d: t.reshape(batch, length, heads, d)  # noqa: E731
    return dict(r=per_head(r, key_dim), w=-per_head(w, key_dim).exp(), k=per_head(k, key_dim),
                v=per_head(v, value_dim), gate=per_head(gate_activation(mixer)(g), value_dim))


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (module docstring).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed, (B, L, D).
    """
    mixer = call.located.module
    x = layer_inputs(mixer, call)
    r, k, log_decay, v, gate = x["r"], x["k"], x["w"], x["v"], x["gate"]
    batch, length, heads, value_dim = v.shape
    bonus = mixer.bonus.double()
    o, _ = gated_linear_chunked(r, k, v, log_decay, scale=1.0, bonus=bonus)  # (B, L, H, P) float64
    norm = mixer.g_norm
    out_proj = linear_readout(mixer.o_proj)
    flat = lambda t: t.reshape(batch, length, -1)  # noqa: E731
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    rebuilt = run(mixer.o_proj, flat(group_norm(norm, o) * gate).to(call.hidden_states.dtype))
    mask = None if call.attention_mask is None else w(call.attention_mask)
    with torch.no_grad():
        core = GatedLinearCore(w(r.detach()), w(k.detach()), log_decay.detach(), 1.0, bonus=w(bonus.detach()))
    common = dict(mask=mask, heads=heads, head_dim=value_dim, values=w(v))
    if formulation == "hidden":
        return HeadOperator(core, **common, output=w(o),
                            readout=lambda out: out_proj(flat(group_norm(norm, out) * gate))), rebuilt

    mean, inverse, weight, norm_bias = norm_statistics(norm, o)
    scale = (inverse if weight is None else weight * inverse).expand(batch, length, heads, value_dim)
    offset = gate * (-scale * mean if norm_bias is None else norm_bias - scale * mean)  # from no value
    kept = [factor for name, factor in (("gate", gate), ("norm", scale)) if name in components]
    row = None if not kept else kept[0] if len(kept) == 1 else kept[0] * kept[1]
    col = torch.ones_like(v) if mask is None else mask[:, :, None, None].to(v.dtype).expand_as(v)
    operator = HeadOperator(core, **common, row_weight=w(row), col_weight=w(col), s6="s6" in components,
                            output=w(gate * scale * o), readout=lambda out: out_proj(flat(out) + flat(offset)))
    return operator, rebuilt
