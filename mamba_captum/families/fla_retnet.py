"""flash-linear-attention's RetNet: ``MultiScaleRetention`` (model type ``retnet``).

Forward (fla 0.6.0, ``fla/layers/multiscale_retention.py``): q, k, v = the projections of h (each through a SiLU short
conv when ``use_short_conv``); an optional feature map on q and k; rotary embeddings on q and k (positions restarting
at each sequence's first real token: fla unpads a masked batch); key / value heads repeated for ``num_kv_heads``;
``o = retention(q, k, v)``: per head h a fixed decay γ_h = 1 − 2^{−5−h}, S_t = γ_h S_{t−1} + k_t v_tᵀ,
o_t = K^−½ S_tᵀ q_t; then the RMS norm over each head's value channels and the output gate (``swish(g_proj h)``
fused with the norm, or ``gate_fn(g_proj h)`` after it; none without ``use_output_gate``), ``o_proj``.

hidden:  α_h[t, s] = K^−½ (q_t · k_s) γ_h^{t−s}  (s ≤ t)  over v (after its conv).
unified: H_c = diag(ν_c · gate_c) · α_h · diag(σ(pre_c) · m) · M_c  over v before its conv (without a conv:
         diag(ν_c · gate_c) · α_h · diag(m)); ν_c the norm's weight / rms of the head's o, from the real activations.
q and k come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import GatedLinearCore
from .common import run
from .fla_gla import gate_function
from .fla_heads import head_lrp, head_operator, rule_values
from .fla_hgrn2 import checked_input, gated_linear_output, projected

MIXER_CLASSES = ("MultiScaleRetention",)
INNER_MIXERS = {"MultiScaleRetention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def retention_log_decays(heads: int, device=None) -> torch.Tensor:
    """log γ_h = log(1 − 2^{−5−h}) per head (H,), computed in float32 as fla's retention ops do, returned float64."""
    exponents = -5.0 - torch.arange(heads, dtype=torch.float32, device=device)
    return (1 - 2.0 ** exponents).log().double()


def sequence_positions(mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """(B, L) long: each token's position in its own sequence (fla unpads a masked batch, so a left-padded row starts
    at its first real token); pads get the position of their neighbour (their rows and columns are masked)."""
    if mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    return (mask.long().cumsum(1) - 1).clamp_min(0)


def rotary(module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """fla's ``RotaryEmbedding`` of x (B, L, H, K) at ``positions`` (B, L), float64: the angles as fla computes them
    (float32 positions and frequencies, cos / sin rounded to x's dtype), the rotation of the first 2R channels as
    two halves (GPT-NeoX) or interleaved pairs (GPT-J)."""
    if module.scale_base is not None:
        raise NotImplementedError("mamba_captum: fla's rotary embedding with scale_base (XPos) has no rebuild yet.")
    dim = module.dim
    if module.pos_idx_in_fp32:
        inv_freq = 1.0 / (module.base ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
        freqs = positions.to(torch.float32)[..., None] * inv_freq
    else:
        inv_freq = module.inv_freq
        freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq
    cos = torch.cos(freqs).to(x.dtype).double()[:, :, None]  # (B, L, 1, R)
    sin = torch.sin(freqs).to(x.dtype).double()[:, :, None]
    half = cos.shape[-1]
    head, rest = x[..., :2 * half].double(), x[..., 2 * half:].double()
    if module.interleaved:
        even, odd = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    else:
        first, second = head.chunk(2, dim=-1)
        rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return torch.cat([rotated, rest], dim=-1)


def queries_keys(mixer, h: torch.Tensor, mask: torch.Tensor | None):
    """(q, k) (B, L, H, K) float64 as the retention op gets them from h (B, L, D): the projections through their
    convs, the feature map, the rotary embedding at each sequence's positions, the pads' keys zeroed (fla drops pads;
    a conv bias would give them keys), the key heads repeated for the query heads."""
    batch, length, _ = h.shape
    key_dim = mixer.head_k_dim
    q = projected(mixer, h, "q_proj", "q_conv1d")[2].reshape(batch, length, -1, key_dim)
    k = projected(mixer, h, "k_proj", "k_conv1d")[2].reshape(batch, length, -1, key_dim)
    if mixer.feature_map_fn is not None:
        q, k = run(mixer.feature_map_fn, q), run(mixer.feature_map_fn, k)
    positions = sequence_positions(mask, batch, length, h.device)
    q, k = rotary(mixer.rotary, q, positions), rotary(mixer.rotary, k, positions)
    if mask is not None:
        k = k * mask[:, :, None, None].to(k.dtype)
    return q, k.repeat_interleave(mixer.num_kv_groups, dim=2)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, mask = call.located.module, call.attention_mask
    h = checked_input(call, formulation, "RetNet", "v_conv1d")
    batch, length, _ = h.shape
    heads, key_dim, value_dim, groups = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim, mixer.num_kv_groups
    if groups > 1 and formulation == "unified" and mixer.use_short_conv:
        raise NotImplementedError("mamba_captum: the unified operator of a RetNet layer with num_kv_heads < num_heads "
                                  "and a value conv; use formulation='hidden'.")
    q, k = queries_keys(mixer, h, mask)
    value_pre, conv_pre, v = projected(mixer, h, "v_proj", "v_conv1d")
    if mask is not None:  # pads write nothing (fla drops them; a conv bias would give them values)
        v = v * mask[:, :, None].to(v.dtype)
    v = v.reshape(batch, length, -1, value_dim).repeat_interleave(groups, dim=2)
    log_decay = retention_log_decays(heads, h.device).expand(batch, length, heads)
    scale = key_dim ** -0.5
    core, values, output = gated_linear_output(q, k, log_decay, v, scale, work_dtype)
    if mixer.fuse_norm_and_gate:
        gate, norm = F.silu(run(mixer.g_proj, h).double()), mixer.g_norm_swish_gate
    else:
        norm = mixer.g_norm
        gate = run(mixer.gate_fn, run(mixer.g_proj, h).double()) if mixer.use_output_gate else None
    if gate is not None:
        gate = gate.reshape(batch, length, heads, value_dim)
    taps = mixer.v_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                         values=values, output=output, gate=gate, norm=norm, out_proj=mixer.o_proj,
                         value_pre=value_pre if mixer.use_short_conv else None, conv_pre=conv_pre, taps=taps)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_heads.head_lrp`), a differentiable function of
    ``call.hidden_states``: v_proj and the value conv linear (its bias a constant; the pads' values zeroed before the
    conv, as fla's packed conv sees them), the conv's SiLU by the identity rule, the core α (q, k after their rotary
    embedding, the fixed decays) detached, the norm's ν detached, the output gate act(g_proj h) (fused with the norm
    or after it) by the identity and half rules (swish) or :func:`mamba_captum.rules.sigmoid_gate`. (B, L, D),
    float64."""
    mixer, mask = call.located.module, call.attention_mask
    h = checked_input(call, "lrp", "RetNet", "v_conv1d")
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    with torch.no_grad():
        q, k = queries_keys(mixer, h, mask)
        log_decay = retention_log_decays(heads, h.device).expand(batch, length, heads)
        core = GatedLinearCore(q.to(work_dtype), k.to(work_dtype), log_decay, key_dim ** -0.5)
    values = rule_values(mixer, h, mask, work_dtype, "v_proj", "v_conv1d").reshape(batch, length, -1, value_dim)
    values = values.repeat_interleave(mixer.num_kv_groups, dim=2)
    gate_input, activation = None, None
    if mixer.use_output_gate:
        gate_input = run(mixer.g_proj, h)
        activation = "swish" if gate_function(mixer) is F.silu else "sigmoid"
    norm = mixer.g_norm_swish_gate if mixer.fuse_norm_and_gate else mixer.g_norm
    return head_lrp(call, work_dtype, core=core, values=values, gate_input=gate_input, gate_activation=activation,
                    norm=norm, out_proj=mixer.o_proj, heads=heads, head_dim=value_dim)
