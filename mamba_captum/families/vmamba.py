"""VMamba's 2-D selective scan mixer, SS2D (:class:`mamba_captum.vision.modeling_vmamba.SS2D`): four Mamba-1 scans over
the grid's tokens in four orders, summed.

Forward: ``x (, z) = in_proj(h)``; ``pre = conv2d(x)`` (3×3 depthwise, 'same' zero padding), ``u = silu(pre)``; per scan
order k (P_k: row-major, column-major, both reversed) ``y_k = P_kᵀ S6_k(P_k u)`` with its own Δ_k, A_k, B_k, C_k; then
``y = Σ_k (y_k + D_k·u)``, ``out = out_proj(g ⊙ LN(y))`` with LN = ``out_norm`` over the channels and
g = silu(z) (1 in the "_noz" variants of the released v2 models).

hidden:  ``Σ_k P_kᵀ α_{k,c} P_k``                                                      over u (the scans' input).
unified: ``H_c = diag(g_c ν_c) [Σ_k P_kᵀ α_{k,c} P_k] diag(σ(pre_c)) M_c``              over x (the conv's input).

α_{k,c} is the S6 kernel of scan k (Ali et al.), M_c the depthwise conv as a 2-D band over the grid (each token reads
its 3×3 neighbourhood, :func:`mamba_captum.kernels.grid_orders.grid_neighbours`), σ(pre) SiLU's gain (Zimerman et
al.), and LN taken at its real statistics as a per-token affine map (the library's way with norms, as Mamba-2's gated
RMS norm): ``LN(y)_c = ν_c y_c + s_c`` with ``ν_c = w_c / σ_i`` and ``s_c = b_c − w_c μ_i / σ_i`` (μ_i, σ_i the mean and
deviation over token i's channels, both held at their real values as Mamba-2's 1/rms is). The shift s, the D skips
and the conv bias are the readout's constants: the share of the channel mean μ_i (which tokens make) is thereby
attributed to no token, as a bias. Components: "s6" α, "gate" g, "norm" ν, "act" σ(pre), "conv" M.

The operator is :class:`mamba_captum.operators.permuted.PermutedSumOperator` over the L = H·W tokens in row-major
order (token r·W + c), whatever the mixer's own layout ((B, C, H, W) channel-first, or (B, H, W, C)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.scans import selective_scan_reference
from ..operators import SelectiveOperator
from ..kernels.grid_orders import cross_scan_orders, grid_neighbours
from ..operators.permuted import PermutedSumOperator
from .common import linear_readout, run

MIXER_CLASSES = ("SS2D",)
# why MambaLRP has no rules for this family (mamba_captum.families.lrp_plan.lrp_plan names it)
LRP_UNSUPPORTED = "MambaLRP explains token models; VMamba's 2-D scans (SS2D) are not covered yet"
NONCAUSAL = True  # the four scans together read every token of the grid from every other


def _check_mixer(mixer) -> None:
    conv = mixer.conv2d
    kh, kw = conv.kernel_size
    same = (tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1) and conv.padding_mode == "zeros"
            and tuple(conv.padding) == (kh // 2, kw // 2) and kh % 2 == 1 and kw % 2 == 1
            and conv.groups == conv.in_channels == conv.out_channels)
    if not same:
        raise TypeError(f"mamba_captum: SS2D's conv2d is not a depthwise, stride-1, 'same' zero-padded conv with an "
                        f"odd kernel (kernel {conv.kernel_size}, padding {conv.padding}); not supported.")
    if not hasattr(mixer.out_norm, "normalized_shape"):
        raise TypeError(f"mamba_captum: SS2D's out_norm is {type(mixer.out_norm).__name__}; only the LayerNorm of "
                        "the released models is supported.")


def _to_tokens(t: torch.Tensor, channel_first: bool) -> torch.Tensor:
    """(B, C, H, W) or (B, H, W, C) -> (B, H·W, C), row-major."""
    return t.flatten(2).transpose(1, 2) if channel_first else t.flatten(1, 2)


def _from_tokens(t: torch.Tensor, channel_first: bool, rows: int, cols: int) -> torch.Tensor:
    """(B, H·W, C) -> the mixer's layout."""
    grid = t.reshape(t.shape[0], rows, cols, t.shape[-1])
    return grid.permute(0, 3, 1, 2) if channel_first else grid


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the mixer's operator from its recorded input ``call.hidden_states`` ((B, C, H, W) channel-first or
    (B, H, W, C), as the mixer received it).

    Returns:
        (operator, rebuilt_output): the :class:`PermutedSumOperator` over the H·W tokens (row-major) and the mixer
        output recomputed from its pieces, in the mixer's layout and dtype.
    """
    mixer = call.located.module
    hidden = call.hidden_states
    if call.attention_mask is not None:
        raise ValueError("mamba_captum: VMamba mixes every token of the grid with every other and has no padding: "
                         "pass no attention_mask.")
    _check_mixer(mixer)
    first = mixer.channel_first
    rows, cols = hidden.shape[-2:] if first else hidden.shape[1:3]
    w = lambda t: t.to(work_dtype)  # noqa: E731
    check = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    projected = run(mixer.in_proj, hidden)
    if mixer.gated:
        x, z = projected.chunk(2, dim=1 if first else -1)
        gate = F.silu(w(_to_tokens(z, first)))  # (B, L, D)
    else:
        x, gate = projected, None
    grid_x = x if first else x.permute(0, 3, 1, 2)  # (B, D, H, W)
    conv = mixer.conv2d
    pre = F.conv2d(grid_x, conv.weight, conv.bias, padding=conv.padding, groups=conv.groups)
    u = F.silu(pre).to(x.dtype)
    x_tok, pre_tok, u_tok = (t.flatten(2).transpose(1, 2) for t in (grid_x, pre, u))  # (B, L, D), model dtype
    u64 = w(u_tok)

    K, D, R, N = mixer.k_group, mixer.d_inner, mixer.dt_rank, mixer.d_state
    orders = cross_scan_orders(rows, cols, hidden.device)
    A_all = -torch.exp(w(mixer.A_logs)).view(K, D, N)
    scans = []  # per k: (order, delta, A, B, C, scan output in scan order)
    for k in range(K):
        seq = u_tok[:, orders[k]]
        dt_low, B, C = torch.split(F.linear(seq, mixer.x_proj_weight[k].to(seq.dtype)), [R, N, N], dim=-1)
        delta = F.softplus(F.linear(w(dt_low), w(mixer.dt_projs_weight[k])) + w(mixer.dt_projs_bias[k]))
        B, C = w(B), w(C)
        scan = selective_scan_reference(seq.to(check), delta.to(check), A_all[k].to(check), B.to(check),
                                        C.to(check))
        scans.append((orders[k], delta, A_all[k], B, C, w(scan)))
    positions = [torch.argsort(order) for order, *_ in scans]
    scan_sum = sum(scan[:, position] for (*_, scan), position in zip(scans, positions))  # token order
    skip = w(mixer.Ds).view(K, D).sum(0) * u64  # Σ_k D_k · u
    y = scan_sum + skip
    norm = mixer.out_norm
    mean = y.mean(-1, keepdim=True)
    inv_std = torch.rsqrt(y.var(-1, unbiased=False, keepdim=True) + norm.eps)
    nu = w(norm.weight) * inv_std  # (B, L, D)
    shift = w(norm.bias) - nu * mean
    gate_or_one = torch.ones_like(nu) if gate is None else gate
    out_proj = linear_readout(mixer.out_proj)
    layout = lambda t: _from_tokens(t, first, rows, cols)  # noqa: E731
    rebuilt = run(mixer.out_proj, layout((gate_or_one * (nu * y + shift)).to(hidden.dtype)))

    if formulation == "hidden":  # the S6 parts over u; the skips, the real LayerNorm and the gate after them
        skip64, gate64 = skip.double(), gate_or_one.double()

        def readout(out):
            full = out + skip64
            normed = F.layer_norm(full, norm.normalized_shape, norm.weight.double(), norm.bias.double(), norm.eps)
            return out_proj(layout(gate64 * normed))

        parts = [(order, SelectiveOperator(delta, A, B, C, None, values=u64[:, order], output=scan))
                 for order, delta, A, B, C, scan in scans]
        return PermutedSumOperator(parts, values=u64, output=scan_sum, readout=readout), rebuilt

    token_scale = gate_or_one * nu
    row = None
    if "gate" in components and gate is not None:
        row = gate
    if "norm" in components:
        row = nu if row is None else row * nu
    col = torch.sigmoid(w(pre_tok)) if "act" in components else None
    with_conv = "conv" in components
    taps = w(conv.weight.detach()[:, 0]).reshape(D, -1) if with_conv else None
    constant = (gate_or_one * (nu * skip + shift)).double()

    def readout(out):
        return out_proj(layout(out + constant))

    parts = [(order, SelectiveOperator(delta, A, B, C, None,
                                       row_weight=None if row is None else row[:, order],
                                       col_weight=None if col is None else col[:, order],
                                       s6="s6" in components, values=w(x_tok)[:, order],
                                       output=token_scale[:, order] * scan))
             for order, delta, A, B, C, scan in scans]
    operator = PermutedSumOperator(
        parts, values=w(x_tok), output=token_scale * scan_sum, conv_weight=taps,
        neighbours=grid_neighbours(rows, cols, conv.kernel_size, hidden.device) if with_conv else None,
        conv_bias=None if conv.bias is None or not with_conv else w(conv.bias.detach()), readout=readout)
    return operator, rebuilt
