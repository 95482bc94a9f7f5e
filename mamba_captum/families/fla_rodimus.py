"""flash-linear-attention's Rodimus: ``RodimusAttention`` (model type ``rodimus``, ``block_type='rodimus'``).

Forward (fla 0.6.0, ``fla/layers/rodimus.py``), one head of C = d_inner value channels and K = ``expand_ratio`` key
channels: x = up_proj h, z = gate_proj h; ``sx = silu(conv(x) + b)`` (a SiLU short conv with a bias, fla's block always
builds it; ``sx = x`` without ``use_short_conv``); q = q_proj sx, k = k_proj sx; the values ``v = σ(i(x)) ⊙ x`` (i the
low-rank input gate); ``g = softplus(g_gate sx)``, ``τ = σ(tau_gate sx)``; ``k ← normalize(k) · g^τ``, log decay
``−g·τ`` per key channel; ``o = gla(q, k, v)`` (S_t = diag(e^{−g_t τ_t}) S_{t−1} + k_t v_tᵀ, o_t = K^−½ S_tᵀ q_t);
then the parallel path ``o + r ⊙ sx`` (r = residual_weight; sx cast to float32 first with ``residual_in_fp32``);
``u = RMSNormGated(o + r ⊙ sx, z)`` = ν ⊙ silu(z) ⊙ (o + r ⊙ sx), the gate applied before the norm
(``norm_before_gate=False``: ν = weight / rms((o + r ⊙ sx) ⊙ silu(z)) over the C channels); ``down_proj u``.

hidden:  α[t, s] = K^−½ Σ_k q_t,k k_s,k exp(Γ_t,k − Γ_s,k)  (s ≤ t; Γ the cumulative log decay), over v; the
         parallel path r ⊙ sx does not pass through the core: the readout adds it (as Mamba's hidden adds its D skip).
unified: H_c = diag(ν_c · silu(z_c)) · (α · diag(σ(i_c) · m) + diag(r_c · σ(pre_c)) · M_c · diag(m))  over x
         (pre = conv(x) + b, M_c the conv's causal band; without a conv: σ(pre) = 1, M_c = I): one core per channel,
         :class:`mamba_captum.operators.ParallelBandCore`. The conv's bias gives ``ν silu(z) r σ(pre) b``, a share of
         the output that comes from no token: the readout adds it (as Mamba's unified leaves its conv bias's share out
         of the maps), so ``u = H x + ν silu(z) r σ(pre) b``.
q, k, the decays, σ(i) and σ(pre) come from the same tokens but, as B and C of the SSMs, enter H (detached), not the
attribution. The block type ``rodimus_plus`` (fla's default) adds ``SlidingWindowSharedKeyAttention``, a softmax
attention whose forward needs flash-attn (no CPU path): refused by name (:mod:`.catalogue`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.bands import band_entries
from ..kernels.gated_linear import gated_linear_chunked
from ..operators import GatedLinearCore, HeadOperator, ParallelBandCore, gate_norm_rows, masked_tokens
from .common import linear_readout, run
from .fla_heads import refuse_packed_or_cached, rms_scale, short_conv

MIXER_CLASSES = ("RodimusAttention",)
INNER_MIXERS = {"RodimusAttention": ("short_conv",)}  # the SiLU short conv: part of H
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's Rodimus has none yet (its "
                   "input gate, gated norm and parallel path need their own)")


def _checked(call):
    mixer = call.located.module
    refuse_packed_or_cached(call)
    norm = mixer.activation_norm
    if norm.norm_before_gate or norm.group_size not in (None, mixer.d_inner):
        raise NotImplementedError("mamba_captum: fla's RodimusAttention with an activation_norm other than fla's "
                                  "(norm_before_gate=False, one group): norm_before_gate / group_size.")
    if mixer.use_short_conv and mixer.short_conv.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: fla's RodimusAttention with short_conv activation "
                                  f"{mixer.short_conv.activation!r} (fla's layer uses silu).")


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    _checked(call)
    mixer, mask = call.located.module, call.attention_mask
    h = masked_tokens(call.hidden_states, mask)
    batch, length, _ = h.shape
    channels, key_dim = mixer.d_inner, mixer.mem_size
    x, z = run(mixer.up_proj, h), run(mixer.gate_proj, h)
    pre, sx = short_conv(mixer.short_conv, x) if mixer.use_short_conv else (None, x)
    q = run(mixer.q_proj, sx).double()
    low_rank, expand, _ = mixer.i_gate_proj
    input_gate = torch.sigmoid(run(expand, run(low_rank, x)).double())  # (B, L, C)
    v = input_gate * x.double()
    sx64 = sx.double()
    # as fla: the gates' biases and the normalised keys in float32 (a float64 model's too)
    gate_logits = lambda proj: F.linear(sx64, proj.weight.double()) + proj.bias.float().double()  # noqa: E731
    g, tau = F.softplus(gate_logits(mixer.g_gate_proj)), torch.sigmoid(gate_logits(mixer.tau_gate_proj))
    k = F.normalize(run(mixer.k_proj, sx).float(), dim=-1, eps=mixer.k_norm_eps).double() * g ** tau
    log_decay = -g * tau
    if mask is not None:  # fla drops the pads; a conv bias would give them keys: zero them
        k = k * mask.to(k.dtype)[:, :, None]
    one_head = lambda t: t.reshape(batch, length, 1, -1)  # noqa: E731
    q, k, log_decay, v = map(one_head, (q, k, log_decay, v))
    scale = key_dim ** -0.5
    with torch.no_grad():
        core = GatedLinearCore(q.detach().to(work_dtype), k.detach().to(work_dtype), log_decay.detach(), scale)
    core_out, _ = gated_linear_chunked(core.q.double(), core.k.double(), v, log_decay, scale=scale)  # (B, L, 1, C)
    weight = mixer.residual_weight.double()
    parallel = (sx.float() if mixer.residual_in_fp32 else sx).double() * weight  # as fla: sx in float32 first
    total = core_out.reshape(batch, length, channels) + parallel
    gate = F.silu(z.double())
    nu = lambda o: rms_scale(mixer.activation_norm, (o * gate)[:, :, None]).squeeze(2)  # noqa: E731 (B, L, C)
    rebuilt = run(mixer.down_proj, (nu(total) * gate * total).to(h.dtype))
    if mask is not None:
        rebuilt = rebuilt * mask.to(rebuilt.dtype)[:, :, None]
    down = linear_readout(mixer.down_proj)
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    operator_mask = None if mask is None else w(mask)
    if formulation == "hidden":  # the core's output; the parallel path, the gate and the norm come after it

        def readout(out):
            o = out.reshape(batch, length, channels) + parallel
            return down(nu(o) * gate * o)

        return HeadOperator(core, mask=operator_mask, heads=1, head_dim=channels, values=w(v), output=w(core_out),
                            readout=readout), rebuilt
    scale_nu = nu(total)
    # the SiLU gain σ(pre) of the parallel path, and its taps; the bias's share (ν silu(z) r σ(pre) b) from no token
    gain = torch.ones_like(total) if pre is None else torch.sigmoid(pre.double())
    kept_gain = gain if "act" in components else torch.ones_like(gain)
    taps = mixer.short_conv.weight[:, 0, :].double() if mixer.use_short_conv and "conv" in components else None
    band = band_entries(weight * kept_gain, torch.ones_like(gain), taps)  # (B, L, C, T)
    bias = mixer.short_conv.bias if mixer.use_short_conv else None
    from_no_token = 0.0 if bias is None else scale_nu * gate * weight * gain * bias.double()
    channel_core = ParallelBandCore(core if "s6" in components else None, w(input_gate), w(band))
    rows = gate_norm_rows(components, w(gate), w(scale_nu))
    per_channel = lambda t: None if t is None else t.reshape(batch, length, channels, 1)  # noqa: E731
    col = (operator_mask[:, :, None, None].expand(batch, length, channels, 1) if operator_mask is not None
           else torch.ones(batch, length, channels, 1, dtype=work_dtype, device=h.device))
    # H x, what the tokens give: in float64 (fla rounds sx to float32 on the parallel path with residual_in_fp32)
    tokens_share = scale_nu * gate * (core_out.reshape(batch, length, channels) + sx64 * weight) - from_no_token
    operator = HeadOperator(channel_core, mask=operator_mask, heads=channels, head_dim=1,
                            row_weight=per_channel(rows), col_weight=col, values=per_channel(w(x)),
                            output=per_channel(w(tokens_share)),
                            readout=lambda out: down(out.reshape(batch, length, channels) + from_no_token))
    return operator, rebuilt
