"""Zamba (v1) layout: ZambaMambaMixer, a Mamba-1 mixer whose channels are split into heads, each with its own x_proj
and dt_proj (so its own B, C, Δ).

Forward (transformers 5.23, ``ZambaMambaMixer.forward``): ``P = in_proj(h·m)``, **interleaved**: x = P[..., 0::2]
(the conv input), z = P[..., 1::2] (the gate); ``c = conv(x) + b`` (depthwise, causal); ``u = silu(c)·m``. Head h
owns the channels [h·P, (h+1)·P) of u and z (P = D_in / n_heads): ``dt, B_h, C_h = u_h W_x,hᵀ``;
``Δ_h = softplus(dt W_dt,hᵀ + b_dt,h)``; ``A_h = -exp(A_log[h])``; ``y_h = S6_h(u_h) + D_h·u_h``; the heads'
``y_h · silu(z_h)`` are concatenated and ``out = out_proj(·)``. There is no fused path: the mask after the conv is
always applied.

Per channel c of head h, exactly Mamba-1's operator with that head's B_h, C_h, Δ_h:

hidden  (Ali et al.):     α_c[i,j] = Σ_n C_h,i[n] exp(A_cn Σ_{k=j+1..i} Δ_kc) Δ_jc B_h,j[n]   over u.
unified (Zimerman et al.): H_c = diag(silu(z_c)) α_c diag(σ(c_c)·m) M_c                       over x.

One :class:`SelectiveOperator` per head (:func:`mamba.scan_pieces` on the head's channels), side by side in a
:class:`ChannelBlocksOperator`; the D skip and the conv bias (not attributed to tokens) go to the readout, as in
:mod:`mamba_captum.families.mamba`.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..operators import ChannelBlocksOperator, masked_tokens
from .mamba import check_dtype, lrp_inner, scan_pieces, selective_operator
from .common import linear_readout, run

MIXER_CLASSES = ("ZambaMambaMixer",)


def _head(mixer, head: int):
    """Mamba head ``head``'s slice of the layer: (its channels, its conv, its x_proj weight, its dt_proj)."""
    width = mixer.mamba_head_dim
    channels = slice(head * width, (head + 1) * width)
    bias = mixer.conv1d.bias
    conv = SimpleNamespace(weight=mixer.conv1d.weight[channels], bias=None if bias is None else bias[channels])
    dt_proj = SimpleNamespace(weight=mixer.dt_proj_weight[head], bias=mixer.dt_proj_bias[head])
    return channels, conv, mixer.x_proj_weight[head], dt_proj


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`ChannelBlocksOperator` (one :class:`SelectiveOperator` per head) and
        the mixer output recomputed from it, (B, L, D_model).
    """
    mixer = call.located.module
    hidden, mask = call.hidden_states, call.attention_mask
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; "
                                  "the unified operator is defined for silu.")
    projected = run(mixer.in_proj, masked_tokens(hidden, mask))  # (B, L, 2 D_in), x and z interleaved
    x, z = projected[..., 0::2], projected[..., 1::2]
    operator_mask = None if mask is None else mask.to(work_dtype)
    pieces, parts = [], []
    for head in range(mixer.n_mamba_heads):
        channels, conv, x_weight, dt_proj = _head(mixer, head)
        p = scan_pieces(x[..., channels], z[..., channels], mask, conv1d=conv,
                        x_proj=lambda u, w=x_weight: F.linear(u, w), dt_proj=dt_proj, A_log=mixer.A_log[head],
                        D=mixer.D[head], rank=mixer.time_step_rank, state_size=mixer.ssm_state_size,
                        unfused=True, work_dtype=work_dtype, check_dtype=check_dtype(hidden))
        pieces.append(p)
        parts.append(selective_operator(p, formulation, components, operator_mask))
    cat = lambda name: torch.cat([getattr(p, name) for p in pieces], dim=-1)  # noqa: E731
    scan, skip, gate = cat("scan"), cat("skip"), cat("gate")
    rebuilt = run(mixer.out_proj, ((scan + skip) * gate).to(hidden.dtype))

    out_proj = linear_readout(mixer.out_proj)
    if formulation == "hidden":  # the operator's output is the scan; the D skip and the gate come after it
        readout = lambda y: out_proj((y + skip.double()) * gate.double())  # noqa: E731
    else:
        readout = lambda y: out_proj(y + (skip * gate).double())  # noqa: E731 (out_proj, linear)
    return ChannelBlocksOperator(parts, readout), rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The mixer's output under MambaLRP's rules (:func:`.mamba.lrp_inner` per head, with the head's own Δ, B, C
    detached), a differentiable function of ``call.hidden_states``. (B, L, D_model), float64."""
    mixer = call.located.module
    hidden, mask = call.hidden_states, call.attention_mask
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; "
                                  "MambaLRP's rules are written for silu.")
    projected = run(mixer.in_proj, masked_tokens(hidden, mask))
    x, z = projected[..., 0::2], projected[..., 1::2]
    inner = []
    for head in range(mixer.n_mamba_heads):
        channels, conv, x_weight, dt_proj = _head(mixer, head)
        with torch.no_grad():
            pieces = scan_pieces(x[..., channels].detach(), z[..., channels].detach(), mask, conv1d=conv,
                                 x_proj=lambda u, w=x_weight: F.linear(u, w), dt_proj=dt_proj, A_log=mixer.A_log[head],
                                 D=mixer.D[head], rank=mixer.time_step_rank, state_size=mixer.ssm_state_size,
                                 unfused=True, work_dtype=work_dtype, with_scan=False)
        inner.append(lrp_inner(pieces, x[..., channels], z[..., channels], mask, conv1d=conv, D=mixer.D[head],
                               unfused=True, work_dtype=work_dtype))
    return linear_readout(mixer.out_proj)(torch.cat(inner, dim=-1).double())
