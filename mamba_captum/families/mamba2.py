"""Mamba-2 layout: Mamba2Mixer, BambaMixer, Zamba2MambaMixer, NemotronHMamba2Mixer, FalconH1Mixer,
GraniteMoeHybridMambaLayer.

Forward (transformers 5.23, e.g. ``Mamba2Mixer.forward``): ``z, xBC, dt = in_proj(h·m)`` (FalconH1: input ×
``ssm_in_multiplier``, projection × ``mup_vector``); ``xBC = silu(conv(xBC) + b)·m``; split into x (H heads × P),
B, C (G groups × N); ``Δ_h = clamp(softplus(dt + dt_bias), time_step_limit)``; ``A_h = -exp(A_log_h)``;
``y = SSD(x) + D·x``; ``out = out_proj(norm(y, z))`` with the gated RMS norm (gate first, then RMS over each of
the ``n_groups`` channel groups, × weight; FalconH1 without ``mamba_rms_norm``: ``y·silu(z)``). Only the mixer
input is taken from hooks; the rest is recomputed, so any kernel path gives the same operator.

hidden:  α_h[i,j] = (C_i · B_j)_{g(h)} exp(A_h Σ_{k=j+1..i} Δ_kh) Δ_jh                 over x after conv.
unified: H_c = diag(ν_c) diag(silu(z_c)) α_h diag(σ(c_c)·m) M_c  for channel c of head h    over x before conv,
         ν the norm scale weight / rms, computed from the real activations.

:func:`ssd_operator` (the operator from the projections) is shared with fla's Mamba-2 (:mod:`.fla_mamba2`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.scans import ssd_scan_reference
from ..operators import SSDOperator, masked_tokens
from ..rules import half_product, silu_rule
from .mamba import check_dtype
from .common import linear_readout, run

MIXER_CLASSES = ("Mamba2Mixer", "BambaMixer", "Zamba2MambaMixer", "NemotronHMamba2Mixer", "FalconH1Mixer",
                 "GraniteMoeHybridMambaLayer")


def _norm_scale(mixer, y, gate, unfused: bool):
    """ν (B, L, D_in): the per-token, per-channel scale of the gated RMS norm, or None when the layer has none."""
    norm = mixer.norm
    if isinstance(norm, nn.Identity) or not getattr(mixer, "mamba_rms_norm", True):
        return None
    d_inner = y.shape[-1]
    group_size = getattr(norm, "group_size", None) or d_inner // norm.n_groups
    # The fused training kernel always gates before the norm (HF passes norm_before_gate=False to it).
    gated_first = not (getattr(norm, "norm_before_gate", False) and unfused)
    normed = y * gate if gated_first else y
    grouped = normed.reshape(*normed.shape[:-1], d_inner // group_size, group_size)
    inv_rms = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight.to(y.dtype) * inv_rms.expand_as(grouped).reshape(normed.shape)


def _projected(call, why: str):
    """(mixer, in_proj's output over the masked input, with FalconH1's multipliers): what :func:`rebuild` and
    :func:`lrp` both start from; the mixer is refused unless its conv activation is SiLU."""
    mixer = call.located.module
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; {why}.")
    h = masked_tokens(call.hidden_states, call.attention_mask)
    if hasattr(mixer, "ssm_in_multiplier"):
        h = h * mixer.ssm_in_multiplier
    projected = run(mixer.in_proj, h)
    if hasattr(mixer, "mup_vector"):
        projected = projected * mixer.mup_vector
    return mixer, projected


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`SSDOperator` and the mixer output recomputed from it, (B, L, D_model).
    """
    mixer, projected = _projected(call, "the unified operator is defined for silu")
    z, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    return ssd_operator(call, formulation, components, work_dtype, z=z, xbc=xbc, dt=dt, conv=mixer.conv1d,
                        heads=mixer.num_heads, head_dim=mixer.head_dim, groups=mixer.n_groups,
                        state=mixer.ssm_state_size, time_step_limit=mixer.time_step_limit, A_log=mixer.A_log,
                        dt_bias=mixer.dt_bias, D=mixer.D[:, None],
                        norm_scale=lambda y, gate: _norm_scale(mixer, y, gate, call.unfused), out_proj=mixer.out_proj)


def ssd_operator(call, formulation: str, components: frozenset, work_dtype: torch.dtype, *, z, xbc, dt, conv,
                 heads: int, head_dim: int, groups: int, state: int, time_step_limit, A_log, dt_bias, D, norm_scale,
                 out_proj, tiled_groups: bool = False):
    """The operator of a Mamba-2 mixer from its projections, and the mixer output rebuilt from it: ``xBC = silu(conv(
    xBC) + b)`` (re-masked on the unfused path), ``y = SSD(x) + D·x``, ``out = out_proj(ν · silu(z) · y)`` (shared by
    the transformers and fla Mamba-2 adapters).

    Args:
        z: (B, L, H·P) the gate input; xbc: (B, L, H·P + 2·G·N) the conv input (as the mixer masks it); dt: (B, L, H)
            the time steps before ``dt_bias``; all in the model's dtype.
        conv: the depthwise ``nn.Conv1d`` over xBC; time_step_limit: (low, high) Δ's clamp; A_log, dt_bias: (H,);
            D: the skip, broadcastable to (H, P).
        norm_scale: ``(y, gate) -> ν`` (B, L, H·P), the gated norm's per-token scale of y (before the gate), or None
            for a mixer without a norm.
        tiled_groups: head h reads B, C of group h mod G (fla's torch path tiles the groups) instead of group
            h // (H/G) (mamba-ssm's kernels, transformers); the operator then holds one B, C per head.
    Returns:
        (the :class:`SSDOperator`, the rebuilt mixer output (B, L, D_model)).
    """
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, _ = hidden.shape
    d_inner = heads * head_dim
    kernel = conv.weight.shape[-1]
    pre = F.conv1d(xbc.transpose(1, 2).to(conv.weight.dtype), conv.weight, conv.bias, padding=kernel - 1,
                   groups=conv.weight.shape[0])[..., :length].transpose(1, 2)
    act = F.silu(pre).to(xbc.dtype)
    if call.unfused:  # the fused training kernel does not re-apply the pad mask after the conv
        act = masked_tokens(act, mask)
    x, B, C = act.split([d_inner, groups * state, groups * state], dim=-1)

    w = lambda t: t.to(work_dtype)
    low, high = time_step_limit
    delta = torch.clamp(F.softplus(w(dt) + w(dt_bias)), min=low, max=high)  # (B, L, H)
    A = -torch.exp(w(A_log))
    x, z, pre_x = w(x), w(z), w(pre[..., :d_inner])
    B, C = w(B).view(batch, length, groups, state), w(C).view(batch, length, groups, state)
    if tiled_groups and groups > 1:
        B, C = B.repeat(1, 1, heads // groups, 1), C.repeat(1, 1, heads // groups, 1)  # (B, L, H, N)

    x_heads = x.view(batch, length, heads, head_dim)
    # the part that comes from tokens, (B, L, H, P): scanned in the model's precision (float64 models in float64), as
    # Mamba-1's check scan; its exponents are float64 either way
    check = lambda t: t.to(check_dtype(hidden))  # noqa: E731
    ssd = w(ssd_scan_reference(check(x_heads), check(delta), check(A), check(B), check(C)))
    skip = w(D) * x_heads
    y = (ssd + skip).reshape(batch, length, d_inner)
    gate = F.silu(z)
    nu = norm_scale(y, gate)
    inner = y * gate if nu is None else nu * gate * y
    rebuilt = run(out_proj, inner.to(hidden.dtype))

    operator_mask = None if mask is None else w(mask)
    readout_proj = linear_readout(out_proj)
    gate64, skip64 = gate.double(), skip.double()
    if formulation == "hidden":  # the operator's output is the SSD scan; skip, gate and norm come after it
        def readout(out):
            full = (out + skip64).reshape(batch, length, d_inner)
            scale = norm_scale(full, gate64)
            return readout_proj(full * gate64 * (1.0 if scale is None else scale))

        return SSDOperator(delta, A, B, C, operator_mask, values=x_heads, output=ssd, readout=readout), rebuilt
    # unified: the operator's output is out_proj's input without the skip's share (ν fixed at its real value)
    token_scale = gate if nu is None else nu * gate
    skip_share = (skip.reshape(batch, length, d_inner) * token_scale).double()

    def readout(out):
        return readout_proj(out.reshape(batch, length, d_inner) + skip_share)

    def per_head(t):
        return None if t is None else t.reshape(batch, length, heads, head_dim)

    row = None
    if "gate" in components:
        row = gate
    if "norm" in components and nu is not None:
        row = nu if row is None else row * nu
    col = torch.sigmoid(pre_x) if "act" in components else None
    if operator_mask is not None:
        col = operator_mask[:, :, None].expand_as(x) if col is None else col * operator_mask[:, :, None]
    taps = w(conv.weight[:d_inner, 0, :]).reshape(heads, head_dim, kernel) if "conv" in components else None
    if row is None and col is None and taps is None:
        col = torch.ones_like(x)  # keep the per-channel layout of the unified operator
    operator = SSDOperator(delta, A, B, C, operator_mask, row_weight=per_head(row), col_weight=per_head(col),
                           conv_weight=taps, head_dim=head_dim, s6="s6" in components,
                           conv_bias=None if conv.bias is None else w(conv.bias[:d_inner]).view(heads, head_dim),
                           values=per_head(w(xbc[..., :d_inner])),
                           output=per_head(ssd.reshape(batch, length, d_inner) * token_scale), readout=readout)
    return operator, rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The mixer's output under MambaLRP's rules, a differentiable function of ``call.hidden_states``: the conv
    (linear, its bias a constant) and SiLU by the identity rule ``pre · σ(pre)̄`` on x, B and C alike; B, C and Δ
    (and the gated norm's normaliser ν) detached, so the SSD scan is linear in x; the D skip; the output gate
    ``y ⊙ silu(z)`` by the half rule (SiLU's identity rule on z), times ν̄. Linear in the mixer input; the conv bias
    and the projections' biases (if any) are its constant terms. (B, L, D_model), float64."""
    mixer, projected = _projected(call, "MambaLRP's rules are written for silu")
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, _ = hidden.shape
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    d_inner = mixer.intermediate_size
    w = lambda t: t.to(work_dtype)  # noqa: E731
    z, xbc, dt = w(projected).split([d_inner, mixer.conv_dim, heads], dim=-1)
    conv = mixer.conv1d
    pre = F.conv1d(xbc.transpose(1, 2), w(conv.weight), None if conv.bias is None else w(conv.bias),
                   padding=conv.weight.shape[-1] - 1, groups=mixer.conv_dim)[..., :length].transpose(1, 2)
    act = pre * torch.sigmoid(pre.detach())  # silu, the identity rule
    if call.unfused:
        act = masked_tokens(act, None if mask is None else w(mask))
    x, B, C = act.split([d_inner, groups * state, groups * state], dim=-1)
    low, high = mixer.time_step_limit
    with torch.no_grad():  # the selection parameters (and the weights they come from) take no relevance
        delta = torch.clamp(F.softplus(dt + w(mixer.dt_bias)), min=low, max=high)
        A = -torch.exp(w(mixer.A_log))
    B, C = B.detach().view(batch, length, groups, state), C.detach().view(batch, length, groups, state)
    x_heads = x.view(batch, length, heads, head_dim)
    y = (ssd_scan_reference(x_heads, delta, A, B, C) + w(mixer.D)[:, None] * x_heads).reshape(batch, length, d_inner)
    gated = half_product(y, silu_rule(z))
    nu = _norm_scale(mixer, y.detach(), F.silu(z.detach()), call.unfused)
    inner = gated if nu is None else gated * nu.detach()
    return linear_readout(mixer.out_proj)(inner.double())
