"""flash-linear-attention's RWKV-7: ``RWKV7Attention`` (model type ``rwkv7``).

Forward (fla 0.6.0, ``fla/layers/rwkv7.py``), h the layer input with pads zeroed: ``δ = token_shift(h)``
(h_{t−1} − h_t, zero before the first token); ``x_∗ = h + δ ⊙ μ_∗`` for ∗ ∈ r, w, k, v, a, g; ``r = r_proj x_r``,
``w = −e^{−½} σ(w_lora x_w)`` (the log decays, in (−0.607, 0)), ``k = k_proj x_k``, ``v = v_proj x_v``; in layers
after the first the value residual ``v ← v + λ ⊙ (v_first − v)``, ``λ = σ(v_lora x_v)``, v_first being layer 0's
values (layer 0 hands its own on); ``a = σ(a_lora x_a)``, ``g = g_lora x_g`` (the output gate, a LoRA with a sigmoid
inside); ``kk = l2norm(k ⊙ k_k)`` per head; ``k ← k ⊙ (1 + (a − 1) ⊙ k_a)``; pads of v zeroed; the generalized delta
rule ``S_t = (diag(e^{w_t}) − (kk_t ⊙ a_t) kk_tᵀ) S_{t−1} + k_t v_tᵀ``, ``o_t = S_tᵀ r_t`` (fla's ``chunk_rwkv7``
/ ``fused_mul_recurrent_rwkv7``: q = r, a = −kk, b = kk ⊙ a, gk = w, scale 1); then ``g_norm``, a LayerNorm over
each head's value channels (mean μ_t, inverse deviation s_t, weight w_c, bias b_c); then the bonus of the current
token ``β_t = Σ_K r_t ⊙ k_t ⊙ r_k`` per head; ``o_proj(g ⊙ (g_norm(o) + β v))``.

hidden:  α_h[t, s] = r_tᵀ (D_t − (kk_t ⊙ a_t) kk_tᵀ) ⋯ (D_{s+1} − (kk_{s+1} ⊙ a_{s+1}) kk_{s+1}ᵀ) k_s  (s ≤ t),
         exactly the core op's impulse response, over the values as the core sees them (after the value residual);
         the norm, the bonus and the gate are the readout.
unified: H_c = diag(g_c) · (diag(w_c s_t) · α_h + diag(β_t)) · diag(m)  over the same values (c = (h, p)).

What the unified operator acts on: the values after the value residual, i.e. what the core and the bonus read. Its
input x = (1 − λ) v_own + λ v_first thus holds layer 0's values too, and the maps explain all of the layer's
token-driven output; over the layer's own projection alone (λ a column weight) layer 0's share would have to be a
constant, and the output it carries would be in no map.

The norm is an affine map per token: its statistics μ_t, s_t are those of this input, held fixed (as the RMS scale of
the other fla layers), so that ``g_norm(o) = w s (o − μ) + b``. Its linear part is the row weight ``w_c s_t``; the
rest, ``g ⊙ (b − w s μ)``, comes from no value of the operator's input x (the mean is a sum over a head's channels
of the same token, which no per-channel map can hold) and is added by the readout, as the biases of other layers
are: ``operator.output`` is ``H x``, ``operator.readout(output)`` the layer's output. The norm weight w_c differs
per channel while the bonus does not pass through it, so the ratio of the recurrence to the bonus differs per
channel: with the norm kept, the operator has one core per value channel (:class:`DPLRCore` with
``channel_scale``; H·P heads of one channel); without it (``components`` without "norm"), one per head.
components: "gate" (g), "norm" (w s), "s6" (the core; without it α = I: H_c = diag(g_c (w_c s_t + β_t) m)).

Pads: RWKV-7 zeroes the pad inputs and values itself (no unpadding), so the state is zero before the first real
token and left padding is exact; the rebuild follows it, pad rows included. Packed sequences (``cu_seqlens``) and a
cached prefix are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.dplr.chunked import dplr_chunked
from ..operators import DPLRCore, HeadOperator, masked_tokens
from .common import linear_readout, run

MIXER_CLASSES = ("RWKV7Attention",)
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's RWKV-7 has none yet (its "
                   "group norm, value residual and bonus need their own)")

LOG_DECAY_SCALE = -0.6065306597126334  # fla: w = −e^{−½} σ(w_lora x_w)


def _l2norm(x: torch.Tensor, fused: bool) -> torch.Tensor:
    """fla's kk normalisation: its l2norm (ε inside the root) with ``fuse_norm``, else ``F.normalize``."""
    if fused:
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)
    return F.normalize(x, dim=-1, p=2.0)


def norm_statistics(norm, o: torch.Tensor):
    """(μ, s, w, b) of RWKV-7's ``g_norm`` (fla's GroupNorm or ``nn.GroupNorm``, one group per head) on o (B, L, H,
    P), float64: mean and inverse deviation (B, L, H, 1) (μ = 0 for fla's RMS variant); weight and bias (H, P) or
    None."""
    o = o.double()
    rms = getattr(norm, "is_rms_norm", False)
    mean = torch.zeros_like(o[..., :1]) if rms else o.mean(-1, keepdim=True)
    inverse = torch.rsqrt((o - mean).square().mean(-1, keepdim=True) + norm.eps)
    shape = o.shape[-2:]
    weight = None if norm.weight is None else norm.weight.double().reshape(shape)
    bias = None if norm.bias is None else norm.bias.double().reshape(shape)
    return mean, inverse, weight, bias


def group_norm(norm, o: torch.Tensor) -> torch.Tensor:
    """RWKV-7's ``g_norm`` on o (B, L, H, P), float64."""
    mean, inverse, weight, bias = norm_statistics(norm, o)
    out = (o.double() - mean) * inverse
    out = out if weight is None else out * weight
    return out if bias is None else out + bias


def shifted_input(mixer, call):
    """(h, δ) of an RWKV layer's recorded call: its input h (B, L, D) with the pads zeroed and the token shift
    δ_t = h_{t−1} − h_t (zero before the first token), after refusing packed sequences."""
    if call.options.get("cu_seqlens") is not None:
        raise NotImplementedError(f"mamba_captum: {type(mixer).__name__} with packed sequences (cu_seqlens); pass a "
                                  "padded batch with attention_mask instead.")
    h = masked_tokens(call.hidden_states, call.attention_mask)
    return h, F.pad(h, (0, 0, 1, -1)) - h


def layer_inputs(mixer, call):
    """What RWKV7Attention computes before its core, from the recorded call: a dict of r, w (log decays), k (updated),
    v (after the value residual, pads zeroed), kk, a (B, L, H, K / P) float64, g (B, L, H, P) float64, and ``bonus``
    β (B, L, H) float64."""
    options, mask = call.options, call.attention_mask
    h, delta = shifted_input(mixer, call)
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_dim, mixer.head_v_dim
    mixed = {name: torch.addcmul(h, delta, getattr(mixer, f"x_{name}")) for name in "rwkvag"}
    r = run(mixer.r_proj, mixed["r"]).double()
    w = LOG_DECAY_SCALE * torch.sigmoid(run(mixer.w_lora, mixed["w"]).double())
    k = run(mixer.k_proj, mixed["k"]).double()
    v = run(mixer.v_proj, mixed["v"]).double()
    if mixer.layer_idx != 0:
        v_first = options.get("v_first")
        if v_first is None:
            raise NotImplementedError("mamba_captum: RWKV7Attention after the first layer was called without "
                                      "v_first (layer 0's values); call it inside its model.")
        share = torch.sigmoid(run(mixer.v_lora, mixed["v"]).double())
        v = torch.lerp(v, v_first.double(), share)
    a = torch.sigmoid(run(mixer.a_lora, mixed["a"]).double())
    g = run(mixer.g_lora, mixed["g"]).double()
    per_head = lambda t, d: t.reshape(batch, length, heads, d)  # noqa: E731
    kk = _l2norm(per_head(k * mixer.k_k.double(), key_dim), mixer.fuse_norm)
    k = k.addcmul(k * (a - 1), mixer.k_a.double())
    if mask is not None:
        v = v * mask.to(v.dtype)[:, :, None]
    r, w, k, a = (per_head(t, key_dim) for t in (r, w, k, a))
    bonus = (r * k * mixer.r_k.double()).sum(-1)  # (B, L, H)
    return dict(r=r, w=w, k=k, v=per_head(v, value_dim), kk=kk, a=a, g=per_head(g, value_dim), bonus=bonus)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (module docstring).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed, (B, L, D).
    """
    mixer = call.located.module
    x = layer_inputs(mixer, call)
    batch, length, heads, value_dim = x["v"].shape
    r, k, log_decay = x["r"], x["k"], x["w"]
    read, write = -x["kk"], x["kk"] * x["a"]
    v, g, bonus = x["v"], x["g"], x["bonus"][..., None]
    o, _ = dplr_chunked(r, k, v, read, write, log_decay, scale=1.0)  # (B, L, H, P) float64
    norm = mixer.g_norm
    out_proj = linear_readout(mixer.o_proj)
    flat = lambda t: t.reshape(batch, length, -1)  # noqa: E731
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    rebuilt = run(mixer.o_proj, flat(g * (group_norm(norm, o) + bonus * v)).to(call.hidden_states.dtype))
    mask = None if call.attention_mask is None else w(call.attention_mask)
    with torch.no_grad():
        core_inputs = [w(t.detach()) for t in (r, k, read, write)]
    if formulation == "hidden":
        core = DPLRCore(*core_inputs, log_decay.detach(), scale=1.0)
        operator = HeadOperator(core, mask=mask, heads=heads, head_dim=value_dim, values=w(v), output=w(o),
                                readout=lambda out: out_proj(flat(g * (group_norm(norm, out) + bonus * v))))
        return operator, rebuilt

    mean, inverse, weight, bias = norm_statistics(norm, o)
    scale = inverse if weight is None else weight * inverse  # w_c s_t: (B, L, H, P)
    scale = scale.expand(batch, length, heads, value_dim)
    offset = -scale * mean if bias is None else bias - scale * mean
    offset = g * offset  # what comes from no value: (B, L, H, P)
    output = g * (scale * o + bonus * v)
    channel_factor = scale if "norm" in components else torch.ones_like(scale)
    gate = g if "gate" in components else None
    per_channel = "norm" in components and "s6" in components
    if per_channel:  # one core per channel: H·P heads of one channel
        units, unit_dim = heads * value_dim, 1
        core = DPLRCore(*core_inputs, log_decay.detach(), scale=1.0, diagonal=w(x["bonus"]),
                        channel_scale=w(channel_factor))
    else:
        units, unit_dim = heads, value_dim
        core = DPLRCore(*core_inputs, log_decay.detach(), scale=1.0, diagonal=w(x["bonus"]))
    layout = lambda t: None if t is None else w(t).reshape(batch, length, units, unit_dim)  # noqa: E731
    row = gate
    if "s6" not in components:  # α = I: the band diag(g (w s + β))
        row = (torch.ones_like(g) if gate is None else gate) * (channel_factor + bonus)
    col = torch.ones_like(v) if mask is None else mask[:, :, None, None].to(v.dtype).expand_as(v)
    operator = HeadOperator(core, mask=mask, heads=units, head_dim=unit_dim, row_weight=layout(row),
                            col_weight=layout(col), s6="s6" in components, values=layout(v), output=layout(output),
                            readout=lambda out: out_proj(flat(out) + flat(offset)))
    return operator, rebuilt
