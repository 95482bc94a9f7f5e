"""Mamba-1 layout: MambaMixer, FalconMambaMixer (weightless RMS norms on dt, B, C), JambaMambaMixer (learned ones).

Forward (transformers 5.23, ``MambaMixer.forward``): ``x, z = in_proj(h·m)``; ``c = conv(x) + b`` (depthwise, causal);
``u = silu(c)·m``; ``dt, B, C = x_proj(u)`` (+ the family's norms); ``Δ = softplus(dt W_dtᵀ + b_dt)``; ``A = -exp(A_log)``;
``y = S6(u) + D·u``; ``out = out_proj(y · silu(z))``. Only the mixer input is taken from hooks: everything else is
recomputed from the weights, so the kernel path (torch, mamba-ssm, causal-conv1d, fused training kernels) does not
matter. The fused training kernel skips the mask after the conv; ``call.unfused`` says which path ran.

hidden  (Ali et al.):     α_c[i,j] = Σ_n C_i[n] exp(A_cn Σ_{k=j+1..i} Δ_kc) Δ_jc B_j[n]   over u.
unified (Zimerman et al.): H_c = diag(silu(z_c)) α_c diag(σ(c_c)·m) M_c                   over x (the conv input).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.scans import selective_scan_reference
from ..operators import SelectiveOperator
from .unhooked import linear_readout, run

MIXER_CLASSES = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")


def _masked(tensor, mask):
    return tensor if mask is None else (tensor * mask[:, :, None]).to(tensor.dtype)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`SelectiveOperator` and the mixer output recomputed from it, (B, L, D_model).
    """
    mixer = call.located.module
    hidden, mask = call.hidden_states, call.attention_mask
    length = hidden.shape[1]
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; "
                                  "the unified operator is defined for silu.")
    projected = run(mixer.in_proj, _masked(hidden, mask))
    x, z = projected.chunk(2, dim=-1)  # (B, L, D_in) each, the model's dtype
    taps = mixer.conv1d.weight[:, 0, :]  # (D_in, K)
    pre = F.conv1d(x.transpose(1, 2).to(taps.dtype), mixer.conv1d.weight, mixer.conv1d.bias,
                   padding=taps.shape[-1] - 1, groups=taps.shape[0])[..., :length].transpose(1, 2)
    u = F.silu(pre).to(x.dtype)
    if call.unfused:  # the fused training kernel does not re-apply the pad mask after the conv
        u = _masked(u, mask)
    dt_low, B, C = torch.split(run(mixer.x_proj, u), [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size],
                               dim=-1)
    norm_dt_after_projection = False
    if hasattr(mixer, "dt_layernorm"):  # FalconMamba (weightless) and Jamba (learned) RMS norms
        B, C = run(mixer.b_layernorm, B), run(mixer.c_layernorm, C)
        # HF's torch path normalises the rank-R dt before dt_proj; mamba-ssm's fused kernel (training mode)
        # normalises the D_in-wide projection instead (the dummy weight has D_in entries). Follow what ran.
        norm_dt_after_projection = not call.unfused
        if not norm_dt_after_projection:
            dt_low = run(mixer.dt_layernorm, dt_low)

    w = lambda t: t.to(work_dtype)
    dt = w(F.linear(dt_low, mixer.dt_proj.weight))  # HF too: dt_proj.weight @ dt, the bias inside the scan
    if norm_dt_after_projection:
        norm = mixer.dt_layernorm
        dt = dt * torch.rsqrt(dt.pow(2).mean(-1, keepdim=True) + norm.eps) * w(norm.weight)
    delta = F.softplus(dt + w(mixer.dt_proj.bias))
    A = -torch.exp(w(mixer.A_log))
    u, z, pre, B, C = w(u), w(z), w(pre), w(B), w(C)

    # The scan only serves the check (the operator does not depend on it): run it in the model's precision.
    check = lambda t: t.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    scan = selective_scan_reference(check(u), check(delta), check(A), check(B), check(C)).to(work_dtype)
    skip, gate = w(mixer.D) * u, F.silu(z)
    rebuilt = run(mixer.out_proj, ((scan + skip) * gate).to(hidden.dtype))

    operator_mask = None if mask is None else w(mask)
    out_proj = linear_readout(mixer.out_proj)
    if formulation == "hidden":  # the operator's output is the scan; the D skip and the gate come after it
        readout = lambda y: out_proj((y + skip.double()) * gate.double())  # noqa: E731
        return SelectiveOperator(delta, A, B, C, operator_mask, values=u, output=scan, readout=readout), rebuilt
    readout = lambda y: out_proj(y + (skip * gate).double())  # noqa: E731 (out_proj, linear)
    col = torch.sigmoid(pre) if "act" in components else None
    if operator_mask is not None:
        col = operator_mask[:, :, None].expand_as(u) if col is None else col * operator_mask[:, :, None]
    operator = SelectiveOperator(
        delta, A, B, C, operator_mask,
        row_weight=F.silu(z) if "gate" in components else None,
        col_weight=col,
        conv_weight=w(taps) if "conv" in components else None,
        s6="s6" in components,
        values=w(x), output=scan * gate, readout=readout,
    )
    return operator, rebuilt
