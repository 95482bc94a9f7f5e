"""Mamba-1 layout: MambaMixer, FalconMambaMixer (weightless RMS norms on dt, B, C), JambaMambaMixer (learned ones).

Forward (transformers 5.23, ``MambaMixer.forward``): ``x, z = in_proj(h·m)``; ``c = conv(x) + b`` (depthwise, causal);
``u = silu(c)·m``; ``dt, B, C = x_proj(u)`` (+ the family's norms); ``Δ = softplus(dt W_dtᵀ + b_dt)``; ``A = -exp(A_log)``;
``y = S6(u) + D·u``; ``out = out_proj(y · silu(z))``. Only the mixer input is taken from hooks: everything else is
recomputed from the weights, so the kernel path (torch, mamba-ssm, causal-conv1d, fused training kernels) does not
matter. The fused training kernel skips the mask after the conv; ``call.unfused`` says which path ran.

hidden  (Ali et al.):     α_c[i,j] = Σ_n C_i[n] exp(A_cn Σ_{k=j+1..i} Δ_kc) Δ_jc B_j[n]   over u.
unified (Zimerman et al.): H_c = diag(silu(z_c)) α_c diag(σ(c_c)·m) M_c                   over x (the conv input).

:func:`scan_pieces` and :func:`selective_operator` (one scan direction) are shared with the bidirectional Vim
mixer (:mod:`mamba_captum.families.vim`), and with :func:`pieces_operator` with fla's Mamba (:mod:`.fla_mamba`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.selective_scan import selective_scan
from ..kernels.scans import selective_scan_reference
from ..operators import SelectiveOperator, masked_tokens
from ..rules import half_product, silu_rule
from .common import linear_readout, run

MIXER_CLASSES = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")


@dataclass
class ScanPieces:
    """One selective scan of a Mamba-1 layout, rebuilt from its conv input: everything an operator needs.

    ``x`` (conv input), ``u`` (scan input), ``pre`` (conv pre-activation), ``delta``: (B, L, D); ``A``: (D, N);
    ``B``, ``C``: (B, L, N); ``scan``: the S6 output without D skip and gate (B, L, D); ``skip`` = D·u;
    ``gate`` = silu(z); ``taps``: (D, K) conv weights.

    ``x``, ``u``, ``pre`` and ``scan`` stay in the precision they were computed in (the model's; the check's scan):
    a float64 copy would hold the same values in twice the memory (long sequences). Formulas upcast them where they
    meet the float64 pieces (``delta``, ``A``, ``B``, ``C``, ``skip``, ``gate``, ``taps``: the work dtype).
    """

    x: torch.Tensor
    u: torch.Tensor
    pre: torch.Tensor
    delta: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    scan: torch.Tensor
    skip: torch.Tensor
    gate: torch.Tensor
    taps: torch.Tensor
    conv_bias: torch.Tensor | None = None  # (D,) the conv's bias, work dtype


def scan_pieces(x, z, mask, *, conv1d, x_proj, dt_proj, A_log, D, rank: int, state_size: int, norms=None,
                unfused: bool = True, work_dtype=torch.float64, check_dtype=torch.float32,
                with_scan: bool = True) -> ScanPieces:
    """Recompute one selective scan from its conv input ``x`` and gate input ``z`` (B, L, D_in), model dtype.

    Args:
        conv1d, x_proj, dt_proj: the direction's modules (run without their hooks); A_log (D_in, N), D (D_in,).
        rank, state_size: the time-step rank R and the state size N (x_proj gives R + 2N features).
        norms: (dt, B, C) RMS norm modules (FalconMamba, Jamba) or None.
        unfused: whether the model ran the unfused path (the fused training kernel skips the mask after the conv and
            normalises the D_in-wide projected dt instead of the rank-R one).
        check_dtype: the precision of the scan, which only serves the check (the operator does not depend on it).
        with_scan: False skips the scan (``scan`` is then None): MambaLRP reads only the selection parameters.
    """
    length = x.shape[1]
    taps = conv1d.weight[:, 0, :]  # (D_in, K)
    pre = F.conv1d(x.transpose(1, 2).to(taps.dtype), conv1d.weight, conv1d.bias, padding=taps.shape[-1] - 1,
                   groups=taps.shape[0])[..., :length].transpose(1, 2)
    u = F.silu(pre).to(x.dtype)
    if unfused:  # the fused training kernel does not re-apply the pad mask after the conv
        u = masked_tokens(u, mask)
    dt_low, B, C = torch.split(run(x_proj, u), [rank, state_size, state_size], dim=-1)
    norm_dt_after_projection = False
    if norms is not None:  # FalconMamba (weightless) and Jamba (learned) RMS norms
        dt_norm, b_norm, c_norm = norms
        B, C = run(b_norm, B), run(c_norm, C)
        # HF's torch path normalises the rank-R dt before dt_proj; mamba-ssm's fused kernel (training mode)
        # normalises the D_in-wide projection instead (the dummy weight has D_in entries). Follow what ran.
        norm_dt_after_projection = not unfused
        if not norm_dt_after_projection:
            dt_low = run(dt_norm, dt_low)

    w = lambda t: t.to(work_dtype)  # noqa: E731
    dt = w(F.linear(dt_low, dt_proj.weight))  # HF too: dt_proj.weight @ dt, the bias inside the scan
    if norm_dt_after_projection:
        dt = dt * torch.rsqrt(dt.pow(2).mean(-1, keepdim=True) + norms[0].eps) * w(norms[0].weight)
    delta = F.softplus(dt + w(dt_proj.bias))
    del dt
    A = -torch.exp(w(A_log))
    B, C = w(B), w(C)
    check = lambda t: t.to(check_dtype)  # noqa: E731
    scan = selective_scan_reference(check(u), check(delta), check(A), check(B), check(C)) if with_scan else None
    return ScanPieces(x.contiguous(), u, pre, delta, A, B, C, scan, w(D) * w(u), F.silu(w(z)), w(taps),
                      None if conv1d.bias is None else w(conv1d.bias))


def selective_operator(pieces: ScanPieces, formulation: str, components: frozenset, mask, readout=None,
                       row_scale: float = 1.0) -> SelectiveOperator:
    """The operator of one scan: hidden α over u (output: the scan), or unified
    ``diag(row_scale · silu z) α diag(σ(pre)·m) M`` over x (output: scan · gate · row_scale).

    ``mask``: (B, L) in the work dtype or None. ``row_scale`` multiplies the unified row weights (Vim's ½).
    """
    p = pieces
    w = lambda t: t.to(p.delta.dtype)  # noqa: E731
    if formulation == "hidden":
        return SelectiveOperator(p.delta, p.A, p.B, p.C, mask, values=p.u, output=w(p.scan), readout=readout)
    col = torch.sigmoid(w(p.pre)) if "act" in components else None
    if mask is not None:
        col = mask[:, :, None].expand_as(p.delta) if col is None else col * mask[:, :, None]
    row = p.gate if "gate" in components else None
    if row_scale != 1.0:
        row = row_scale * (torch.ones_like(p.delta) if row is None else row)
    output = p.gate * p.scan  # (float64: type promotion, no upcast copy of the scan)
    if row_scale != 1.0:
        output.mul_(row_scale)
    return SelectiveOperator(
        p.delta, p.A, p.B, p.C, mask, row_weight=row, col_weight=col,
        conv_weight=p.taps if "conv" in components else None, conv_bias=p.conv_bias, s6="s6" in components,
        values=p.x, output=output, readout=readout)


def check_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The scan that serves the check runs in the model's precision (float64 models in float64)."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`SelectiveOperator` and the mixer output recomputed from it, (B, L, D_model).
    """
    mixer = call.located.module
    hidden, mask = call.hidden_states, call.attention_mask
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; "
                                  "the unified operator is defined for silu.")
    x, z = run(mixer.in_proj, masked_tokens(hidden, mask)).chunk(2, dim=-1)  # (B, L, D_in) each, the model's dtype
    norms = (mixer.dt_layernorm, mixer.b_layernorm, mixer.c_layernorm) if hasattr(mixer, "dt_layernorm") else None
    p = scan_pieces(x, z, mask, conv1d=mixer.conv1d, x_proj=mixer.x_proj, dt_proj=mixer.dt_proj, A_log=mixer.A_log,
                    D=mixer.D, rank=mixer.time_step_rank, state_size=mixer.ssm_state_size, norms=norms,
                    unfused=call.unfused, work_dtype=work_dtype, check_dtype=check_dtype(hidden))
    del x, z  # the pieces hold what they need: the in_proj output goes (long sequences)
    return pieces_operator(p, mixer.out_proj, hidden, mask, formulation, components, work_dtype)


def pieces_operator(p: ScanPieces, out_proj_module, hidden: torch.Tensor, mask, formulation: str,
                    components: frozenset, work_dtype: torch.dtype):
    """The operator of a Mamba-1 mixer whose output is ``out_proj((scan + D·u) · silu(z))``, and that output rebuilt
    from the scan pieces ``p`` (shared by the transformers and fla Mamba adapters).

    Args:
        hidden: (B, L, D_model) the mixer input (its dtype is the rebuilt output's). mask: (B, L) or None.
    Returns:
        (the :class:`SelectiveOperator`, the rebuilt mixer output (B, L, D_model)).
    """
    rebuilt = run(out_proj_module, ((p.scan + p.skip) * p.gate).to(hidden.dtype))

    operator_mask = None if mask is None else mask.to(work_dtype)
    out_proj = linear_readout(out_proj_module)
    # the readouts hold only what they read, not the pieces (u, z, pre, scan: (B, L, D_in) each, long sequences)
    if formulation == "hidden":  # the operator's output is the scan; the D skip and the gate come after it
        skip, gate = p.skip.double(), p.gate.double()
        readout = lambda y: out_proj((y + skip) * gate)  # noqa: E731
    else:
        skip_gate = (p.skip * p.gate).double()
        p.skip = None  # folded into skip_gate: one (B, L, D_in) float64 fewer while the operator is built
        readout = lambda y: out_proj(y + skip_gate)  # noqa: E731 (out_proj, linear)
    return selective_operator(p, formulation, components, operator_mask, readout), rebuilt


def lrp_inner(pieces: ScanPieces, x, z, mask, *, conv1d, D, unfused: bool, work_dtype) -> torch.Tensor:
    """``out_proj``'s input under MambaLRP's rules, a differentiable function of the conv input ``x`` and the gate
    input ``z`` (B, L, D_in): the conv (linear, its bias a constant), SiLU by the identity rule ``pre · σ(pre)̄``, the
    scan with Δ, B, C (``pieces``, computed from the real activations) detached, so linear in u, the D skip, and the
    gate ``y ⊙ silu(z)`` by the half rule with SiLU's identity rule on z. Same value as the real layer's."""
    w = lambda t: t.to(work_dtype)  # noqa: E731
    length = x.shape[1]
    pre = F.conv1d(w(x).transpose(1, 2), w(conv1d.weight), None if conv1d.bias is None else w(conv1d.bias),
                   padding=conv1d.weight.shape[-1] - 1, groups=conv1d.weight.shape[0])[..., :length].transpose(1, 2)
    u = pre * torch.sigmoid(w(pieces.pre))  # silu(pre), the identity rule
    if unfused:
        u = masked_tokens(u, None if mask is None else w(mask))
    scan = selective_scan(u.transpose(1, 2), pieces.delta.transpose(1, 2), pieces.A, pieces.B.transpose(1, 2),
                          pieces.C.transpose(1, 2)).transpose(1, 2)
    y = scan + w(D) * u
    return half_product(y, silu_rule(w(z)))


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The mixer's output under MambaLRP's rules, as a differentiable function of ``call.hidden_states`` (which
    carries the graph): every factor that depends on the data other than through the values (Δ, B, C and their
    norms) detached, SiLU by the identity rule, the output gate by the half rule. Linear in the mixer input; the
    conv bias (and in_proj's / out_proj's biases, if any) are its constant terms. (B, L, D_model), float64."""
    mixer = call.located.module
    hidden, mask = call.hidden_states, call.attention_mask
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; "
                                  "MambaLRP's rules are written for silu.")
    x, z = run(mixer.in_proj, masked_tokens(hidden, mask)).chunk(2, dim=-1)
    norms = (mixer.dt_layernorm, mixer.b_layernorm, mixer.c_layernorm) if hasattr(mixer, "dt_layernorm") else None
    with torch.no_grad():
        pieces = scan_pieces(x.detach(), z.detach(), mask, conv1d=mixer.conv1d, x_proj=mixer.x_proj,
                             dt_proj=mixer.dt_proj, A_log=mixer.A_log, D=mixer.D, rank=mixer.time_step_rank,
                             state_size=mixer.ssm_state_size, norms=norms, unfused=call.unfused,
                             work_dtype=work_dtype, with_scan=False)
    inner = lrp_inner(pieces, x, z, mask, conv1d=mixer.conv1d, D=mixer.D, unfused=call.unfused,
                      work_dtype=work_dtype)
    return linear_readout(mixer.out_proj)(inner.double())
