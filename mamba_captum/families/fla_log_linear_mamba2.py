"""flash-linear-attention's log-linear Mamba-2: ``LogLinearMamba2`` (model type ``log_linear_mamba2``).

Forward (fla 0.6.0, ``fla/layers/log_linear_mamba2.py``; fla runs it on CUDA only, :func:`mamba_captum.fla_on_cpu`
runs the same code on a CPU): ``z, xBC, dt, dl = in_proj(h·m)``; ``xBC = silu(conv(xBC·m) + b)·m``; split into
x (H heads × P), B, C (G groups × N); ``Δ_h = softplus(dt + dt_bias)``; ``A_h = -exp(A_log_h)`` (rounded to float32:
``A_log.float()``); the level scales ``λ_{t,h}[ℓ] = softplus(L_{h,ℓ} · dl_{t,h,ℓ})``;
``y = chunk_log_linear_attn(q=C, k=B, v=x·Δ, g=A·Δ, λ) + D·x`` (head h reads group h // (H/G); D per head, or per
channel with ``D_has_hdim``); ``out = out_proj(norm(y, z))`` with fla's ``RMSNormGated`` (the gate silu(z) before the
norm, or after it with ``norm_before_gate``), or ``y·silu(z)`` without ``rmsnorm``. The levels ℓ(t, s) = bit length of
(t XOR s) are those of absolute positions: fla does not unpad, so a left-padded row is mixed at other levels than the
same tokens unpadded (the maps follow the layer; right padding changes nothing).

hidden:  α_h[t,s] = (C_t · B_s)_{g(h)} exp(A_h Σ_{k=s+1..t} Δ_kh) Δ_sh λ_{t,h}[ℓ(t,s)]      over x after the conv
         (Mamba-2's α, :mod:`.fla_mamba2`, times the level weight; :mod:`mamba_captum.kernels.log_linear`).
unified: H_c = diag(ν_c) diag(silu(z_c)) α_h diag(σ(c_c)·m) M_c  for channel c of head h    over x before the conv,
         ν the norm's scale weight / rms from the real activations (absent without ``rmsnorm``); the D skip's and the
         conv bias's shares come from no token (constants of the readout), as for Mamba-2.
α is held whole (a :class:`DenseCore`, (B, H, L, L), the size of the maps themselves).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.log_linear import log_linear_alpha
from ..operators import DenseCore, HeadOperator, gate_norm_rows, masked_tokens
from .common import linear_readout, run
from .fla_mamba import fla_mixer
from .fla_mamba2 import norm_scale

MIXER_CLASSES = ("LogLinearMamba2",)
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's log-linear Mamba-2 (its fused "
                   "norm and level weights) has none yet")


def log_linear_mamba2_alpha(C, B, delta, A, level_scales, heads: int) -> torch.Tensor:
    """α (b, H, L, L) over x after the conv: log-linear attention's α with q = C, k = B and the decays A·Δ, times Δ_s
    (the layer feeds the op x·Δ). C, B: (b, L, G, N); delta: (b, L, H); A: (H,); level_scales: (b, L, H, n)."""
    groups = B.shape[2]
    q, k = (t.repeat_interleave(heads // groups, dim=2) for t in (C, B))  # head h reads group h // (H/G)
    rows = torch.arange(C.shape[1], device=C.device)
    alpha = log_linear_alpha(q, k, (A * delta).cumsum(1), level_scales, rows)
    return alpha * delta.transpose(1, 2)[:, :, None, :]


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` over a :class:`DenseCore` and the mixer output
        recomputed from it, (B, L, D).
    """
    mixer = fla_mixer(call, "LogLinearMamba2")
    if mixer.norm is not None and type(mixer.norm).__name__ != "RMSNormGated":
        raise NotImplementedError(f"mamba_captum: {call.located.name}'s output norm {type(mixer.norm).__name__} is "
                                  "not fla's RMSNormGated.")
    if tuple(mixer.dt_limit) != (0.0, float("inf")):  # fla refuses it when built; a changed attribute is not honoured
        raise NotImplementedError(f"mamba_captum: {call.located.name} has dt_limit={mixer.dt_limit!r}, which fla's "
                                  "log-linear Mamba-2 does not implement.")
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, _ = hidden.shape
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    d_inner, n_levels = mixer.intermediate_size, mixer.num_lambda_dims
    projected = run(mixer.in_proj, masked_tokens(hidden, mask))
    extra = projected.shape[-1] - d_inner - mixer.conv_dim - heads * (n_levels + 1)
    if extra:
        raise NotImplementedError(f"mamba_captum: {call.located.name}'s in_proj gives {extra} channels beyond "
                                  "z, xBC, dt and the level scales, which the operator does not describe.")
    z, xbc, dt, dl = projected.split([d_inner, mixer.conv_dim, heads, heads * n_levels], dim=-1)
    xbc = masked_tokens(xbc, mask)  # fla zeroes the pads' conv input (in_proj's bias too) and its output
    conv = mixer.conv1d
    kernel = conv.weight.shape[-1]
    pre = F.conv1d(xbc.transpose(1, 2), conv.weight, conv.bias, padding=kernel - 1,
                   groups=conv.weight.shape[0])[..., :length].transpose(1, 2)
    act = masked_tokens(F.silu(pre), mask)
    x, B, C = act.split([d_inner, groups * state, groups * state], dim=-1)

    w = lambda t: t.to(work_dtype)  # noqa: E731
    delta = F.softplus(w(dt) + w(mixer.dt_bias))  # (b, L, H)
    A = w(-torch.exp(mixer.A_log.float()))  # fla's float32 A, whatever the model's dtype
    level_scales = F.softplus(w(mixer.L)[None, None] * w(dl).view(batch, length, heads, n_levels))
    alpha = log_linear_mamba2_alpha(w(C).view(batch, length, groups, state), w(B).view(batch, length, groups, state),
                                    delta, A, level_scales, heads)
    x_heads = w(x).view(batch, length, heads, head_dim)
    core_out = torch.einsum("bhts,bshp->bthp", alpha, x_heads)  # (b, L, H, P)
    D = w(mixer.D).view(heads, head_dim) if mixer.D_has_hdim else w(mixer.D)[:, None]
    skip = D * x_heads
    y = (core_out + skip).reshape(batch, length, d_inner)
    gate = F.silu(w(z))
    nu = norm_scale(mixer, y, gate)
    token_scale = gate if nu is None else nu * gate
    rebuilt = run(mixer.out_proj, (y * token_scale).to(hidden.dtype))

    readout_proj = linear_readout(mixer.out_proj)
    operator_mask = None if mask is None else w(mask)
    common = dict(mask=operator_mask, heads=heads, head_dim=head_dim)
    per_head = lambda t: t.reshape(batch, length, heads, head_dim)  # noqa: E731
    if formulation == "hidden":  # the core's output; the skip, the gate and the norm come after it
        skip64, gate64 = skip.double(), gate.double()

        def readout(out):
            full = (out + skip64).reshape(batch, length, d_inner)
            scale = norm_scale(mixer, full, gate64)
            return readout_proj(full * gate64 * (1.0 if scale is None else scale))

        return HeadOperator(DenseCore(alpha), **common, values=x_heads, output=core_out, readout=readout), rebuilt
    # unified: over x before the conv; the conv bias's and the skip's shares are constants of the readout
    pre_x = w(pre[..., :d_inner])
    bias = None if conv.bias is None else w(conv.bias[:d_inner])
    column = torch.sigmoid(pre_x) * (1.0 if operator_mask is None else operator_mask[:, :, None])
    convolved = pre_x if bias is None else pre_x - bias  # M x: the conv without its bias
    through = lambda t: torch.einsum("bhts,bshp->bthp", alpha, per_head(t))  # noqa: E731
    output = per_head(token_scale) * through(column * convolved)
    constants = (per_head(token_scale) * (skip if bias is None else skip + through(column * bias))).double()

    row = gate_norm_rows(components, gate, nu)
    col = torch.sigmoid(pre_x) if "act" in components else None
    if operator_mask is not None:
        mask_col = operator_mask[:, :, None].expand(batch, length, d_inner)
        col = mask_col if col is None else col * mask_col
    taps = w(conv.weight[:d_inner, 0, :]).reshape(heads, head_dim, kernel) if "conv" in components else None
    if row is None and col is None and taps is None:
        col = torch.ones(batch, length, d_inner, dtype=work_dtype, device=hidden.device)
    operator = HeadOperator(DenseCore(alpha), **common, row_weight=None if row is None else per_head(row),
                            col_weight=None if col is None else per_head(col), conv_weight=taps,
                            s6="s6" in components, values=per_head(w(xbc[..., :d_inner])), output=output,
                            readout=lambda out: readout_proj((out + constants).reshape(batch, length, d_inner)))
    return operator, rebuilt
