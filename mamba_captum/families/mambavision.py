"""MambaVision's token mixers (:mod:`mamba_captum.vision.modeling_mambavision`; only the official attribute names are
read): the windowed Mamba mixer ``MambaVisionMixer``, the windowed softmax ``MambaVisionAttention`` (levels 2 and 3,
each on its own residual branch of a ``Block``), and the residual conv blocks ``MambaVisionConvBlock`` (levels 0
and 1). Every operator is over the level's L = H·W tokens in row-major order (token r·W + c).

Windows. The two windowed mixers take ``norm1``'s output channel-last (B, H, W, C) and run on each ``window²`` window
(windows row-major, tokens row-major inside each: :func:`mamba_captum.kernels.windows.window_order`). Their operator
is :class:`mamba_captum.operators.windowed.WindowedOperator`, ``Pᵀ blockdiag(H^(w)) P``: zero between tokens of
different windows. At the released sizes one window covers the grid (P = I). A grid that MambaVisionLayer padded
to whole windows is refused (the padding tokens would be mixed with the real ones, outside the StagedLayout).

MambaVisionMixer, within one window (C' = C/2 channels per half; no bias anywhere in the released mixers)::

    [x̃ ; z̃] = in_proj(h);  x̂ = K_x x̃,  ẑ = K_z z̃   (depthwise width-3 'same' convs: bands inside the window)
    u = silu(x̂);  Δ = softplus(dt_proj(dt) + b_dt)   (b_dt twice: dt_proj's bias and the scan's delta_bias)
    y = S6(u) + D ⊙ u;  z = silu(ẑ);  out = out_proj([y ; z])   (z concatenated, not a gate)

- hidden: the scan half ``M_d = α_d + D_d I`` over u (α_d the S6 kernel, causal inside the window), the z half the
  identity over z; out_proj is the readout.
- unified: ``H_d = (α_d + D_d I) · diag(σ(x̂_d)) · K_x,d`` over x̃ and ``G_d = diag(σ(ẑ_d)) · K_z,d`` over z̃ (SiLU's
  gain σ fixed at its real value). Components: "s6" (α; off: the identity), "act" (σ), "conv" (K; off: I).
  The D skip is a token's own, so it is on the diagonal (not a readout constant).

MambaVisionAttention, per head within each window: ``P_h = softmax(q kᵀ / √d)`` rebuilt in float64 from ``qkv``
(and ``q_norm`` / ``k_norm``), acting on the values without their bias; the value bias (rows of P sum to 1) and
``proj``'s bias come from no token: the readout adds them.

MambaVisionConvBlock, ``x + γ · BN2(conv2(GELU(BN1(conv1(x)))))`` on (B, C, H, W) (full 3×3 convs, eval-mode
BatchNorm: ``BN(y) = s ⊙ y + t``). With ``u = BN1(conv1(x))`` and GELU's gain ``g = GELU(u)/u`` at its real value
(Φ-like, 1/2 at u = 0), the branch is ``H x + constant``::

    H = γ s2 ⊙ W2 ⋆ (g ⊙ (s1 ⊙ W1 ⋆ ·))          (a channel-mixing token operator reaching 2 tokens on each axis)
    constant = γ (s2 ⊙ W2 ⋆ (g ⊙ c1) + c2),   c_i = s_i · bias_i + t_i

(:class:`mamba_captum.operators.channel_conv.ChannelConvOperator`); the readout adds the constant and the block's
own residual x. Contributions are exact; maps are per output channel the sum over input channels of the C × C
block of each token pair (the per-channel maps of a diagonal operator). hidden: ``s1 ⊙ W1 ⋆ x`` (the first conv
alone), the rest of the branch in the readout. Components: "act" (g), "norm" (s1, s2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.grid_orders import grid_neighbours
from ..kernels.scans import selective_scan_reference
from ..kernels.windows import check_whole_windows, grid_to_windows, window_order
from ..operators import (ChannelBlocksOperator, ChannelConvOperator, SelectiveOperator, SoftmaxOperator,
                         WindowedOperator)
from ..operators.permuted import PermutedSumOperator
from .common import batch_norm_affine, linear_readout, run, same_conv_kernel

MIXER_CLASSES = ("MambaVisionMixer", "MambaVisionAttention", "MambaVisionConvBlock")
# why MambaLRP has no rules for this family (mamba_captum.families.lrp_plan.lrp_plan names it)
LRP_UNSUPPORTED = "MambaLRP explains token models; MambaVision's windowed image mixers and conv blocks are not covered"
NONCAUSAL = True  # the 'same' convs and attention read both sides of a token; the conv blocks its 5×5 neighbourhood


def _check_eval(module) -> None:
    if module.training:
        raise ValueError(f"mamba_captum: {type(module).__name__} is in train() mode (BatchNorm with batch statistics, "
                         "drop path): its operator is defined at eval-mode values. Call model.eval() first.")


def _grid_of(module, hidden: torch.Tensor):
    """(B, H, W, C) -> (rows, cols, window); a (B, N, C) sequence is one window of N tokens in a row.

    Raises:
        ValueError: the grid is a padded one (not the level's), or not whole windows."""
    name = type(module).__name__
    if hidden.dim() == 3:
        return 1, hidden.shape[1], None
    if hidden.dim() != 4:
        raise TypeError(f"mamba_captum: {name} takes (B, H, W, C) or (B, N, C); it received {tuple(hidden.shape)}.")
    rows, cols = hidden.shape[1:3]
    grid = getattr(module, "level_grid", None)
    if grid is not None and tuple(grid) != (rows, cols):
        raise ValueError(
            f"mamba_captum: {name} ran on a {rows}×{cols} grid padded from the level's {grid[0]}×{grid[1]} to whole "
            f"{module.window_size}×{module.window_size} windows; the padding tokens mix with the real ones, so its "
            "operator is not over the level's tokens. Use an image size whose level grids are whole windows (the "
            "released size of the model, e.g. 224 for windows 14 and 7).")
    window = module.window_size
    if window is not None:
        check_whole_windows(rows, cols, window)
    return rows, cols, window


def _windows(hidden: torch.Tensor, rows: int, cols: int, window):
    """(B, H, W, C) or (B, N, C) -> ((B · nW, T, C) windows, the window order (L,))."""
    if window is None:
        return hidden.reshape(hidden.shape[0], rows * cols, hidden.shape[-1]), \
            torch.arange(rows * cols, device=hidden.device)
    return grid_to_windows(hidden, window), window_order(rows, cols, window, hidden.device)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the mixer's operator from its recorded input ``call.hidden_states`` (MambaVisionMixer and
    MambaVisionAttention: (B, H, W, C) channel-last; MambaVisionConvBlock: (B, C, H, W)).

    Returns:
        (operator, rebuilt_output): a :class:`WindowedOperator` (the windowed mixers) or a
        :class:`ChannelConvOperator` (the conv blocks) over the H·W tokens, and the module's output recomputed from
        its pieces, in the module's shape and dtype.
    """
    if call.attention_mask is not None:
        raise ValueError("mamba_captum: an image has no padding: pass no attention_mask to a MambaVision.")
    module = call.located.module
    _check_eval(module)
    name = type(module).__name__
    build = {"MambaVisionMixer": _mixer, "MambaVisionAttention": _attention, "MambaVisionConvBlock": _conv_block}
    return build[name](module, call.hidden_states, formulation, components, work_dtype)


# -- the Mamba mixer -------------------------------------------------------------------------------------------------
def _same_conv(signal: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """The depthwise 'same' conv over each window's tokens, (N, T, C') -> (N, T, C'), in the signal's dtype."""
    weight = conv.weight.to(signal.dtype)
    bias = None if conv.bias is None else conv.bias.to(signal.dtype)
    return F.conv1d(signal.transpose(1, 2), weight, bias, padding="same", groups=conv.groups).transpose(1, 2)


def _check_mixer(mixer) -> None:
    for conv in (mixer.conv1d_x, mixer.conv1d_z):
        width = conv.kernel_size[0]
        if conv.bias is not None or width % 2 == 0 or conv.groups != conv.in_channels or conv.dilation != (1,):
            raise TypeError(f"mamba_captum: MambaVisionMixer's {conv} is not a bias-free depthwise conv of odd width "
                            "(the released mixers'); not supported.")
    for linear in (mixer.in_proj, mixer.out_proj):
        if linear.bias is not None and not bool((linear.bias == 0).all()):
            raise TypeError("mamba_captum: a MambaVisionMixer with projection biases (bias=True, no released model) "
                            "is not supported.")


def _mixer(mixer, hidden, formulation, components, work_dtype):
    _check_mixer(mixer)
    rows, cols, window = _grid_of(mixer, hidden)
    windows, order = _windows(hidden, rows, cols, window)  # (N, T, C)
    tokens = windows.shape[1]
    w = lambda t: t.to(work_dtype)  # noqa: E731
    check = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    projected = w(run(mixer.in_proj, windows))
    x_in, z_in = projected.chunk(2, dim=-1)  # x̃, z̃ (N, T, C')
    pre_x, pre_z = _same_conv(x_in, mixer.conv1d_x), _same_conv(z_in, mixer.conv1d_z)
    u, z = F.silu(pre_x), F.silu(pre_z)
    dt, B, C = torch.split(F.linear(u, w(mixer.x_proj.weight)), [mixer.dt_rank, mixer.d_state, mixer.d_state], -1)
    bias = w(mixer.dt_proj.bias)
    delta = F.softplus(F.linear(dt, w(mixer.dt_proj.weight), bias) + bias)  # the bias twice, as the official code
    A = -torch.exp(w(mixer.A_log))
    scan = w(selective_scan_reference(u.to(check), delta.to(check), A.to(check), B.to(check), C.to(check)))
    skip = w(mixer.D).expand_as(u)  # D on the diagonal of each channel's operator
    y = scan + skip * u
    out_proj = linear_readout(mixer.out_proj)
    rebuilt = run(mixer.out_proj, torch.cat([y, z], -1).to(hidden.dtype))  # (N, T, C)

    straight = torch.arange(tokens, device=hidden.device)  # the scan runs in each window's own order
    if formulation == "hidden":  # M over u, the identity over z
        scan_half = PermutedSumOperator(
            [(straight, SelectiveOperator(delta, A, B, C, None, values=u, output=scan)),
             (straight, SelectiveOperator(delta, A, B, C, None, row_weight=skip, s6=False, values=u,
                                          output=skip * u))],
            values=u, output=y)
        z_half = PermutedSumOperator([(straight, SelectiveOperator(delta, A, B, C, None, s6=False, values=z,
                                                                   output=z))], values=z, output=z)
    else:
        neighbours = grid_neighbours(1, tokens, (1, mixer.d_conv), hidden.device)  # taps t−1, t, t+1 in the window
        with_conv = "conv" in components
        taps = lambda conv: w(conv.weight.detach()[:, 0]) if with_conv else None  # noqa: E731
        gain_x = torch.sigmoid(pre_x) if "act" in components else None
        gain_z = torch.sigmoid(pre_z) if "act" in components else None
        scan_half = PermutedSumOperator(
            [(straight, SelectiveOperator(delta, A, B, C, None, col_weight=gain_x, s6="s6" in components,
                                          values=x_in, output=scan)),
             (straight, SelectiveOperator(delta, A, B, C, None, row_weight=skip, col_weight=gain_x, s6=False,
                                          values=x_in, output=skip * u))],
            values=x_in, output=y, conv_weight=taps(mixer.conv1d_x), neighbours=neighbours if with_conv else None)
        z_half = PermutedSumOperator(
            [(straight, SelectiveOperator(delta, A, B, C, None, col_weight=gain_z, s6=False, values=z_in,
                                          output=z))],
            values=z_in, output=z, conv_weight=taps(mixer.conv1d_z), neighbours=neighbours if with_conv else None)
    inner = ChannelBlocksOperator([scan_half, z_half])
    operator = WindowedOperator(inner, order)
    operator.output = operator.from_windows(inner.output)  # (B, L, 2C') grid order
    shape = hidden.shape

    operator.readout = lambda out: out_proj(out).reshape(shape)  # out_proj acts token by token
    return operator, operator.from_windows(rebuilt).reshape(shape)


# -- the attention ---------------------------------------------------------------------------------------------------
def _attention(attention, hidden, formulation, components, work_dtype):
    rows, cols, window = _grid_of(attention, hidden)
    windows, order = _windows(hidden, rows, cols, window)
    count, tokens, dim = windows.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    qkv = run(attention.qkv, windows).reshape(count, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    q, k = run(attention.q_norm, qkv[0]), run(attention.k_norm, qkv[1])  # (N, h, T, d), the model's dtype
    q, k, v = q.to(torch.float64), k.to(torch.float64), qkv[2].to(torch.float64)
    value_bias = torch.zeros(heads, head_dim, dtype=torch.float64, device=hidden.device)
    if attention.qkv.bias is not None:
        value_bias = attention.qkv.bias.detach()[2 * dim:].to(torch.float64).reshape(heads, head_dim)
    values = v - value_bias[None, :, None, :]  # what the tokens give; the bias comes from none
    probs = torch.softmax(q @ k.transpose(-1, -2) * attention.scale, dim=-1)
    mixed = (probs @ values).transpose(1, 2)  # (N, T, h, d)
    inner = SoftmaxOperator(probs.to(work_dtype), None, values=values.to(work_dtype), output=mixed.to(work_dtype),
                            readout=lambda out: out)
    operator = WindowedOperator(inner, order)
    operator.output = operator.from_windows(inner.output)  # (B, L, h, d) grid order
    proj, shape, flat_bias = linear_readout(attention.proj), hidden.shape, value_bias.reshape(-1)
    operator.readout = lambda out: proj(out.flatten(2) + flat_bias).reshape(shape)
    rebuilt = run(attention.proj, (mixed.flatten(2) + flat_bias).to(hidden.dtype))
    return operator, operator.from_windows(rebuilt).reshape(shape)


# -- the conv blocks -------------------------------------------------------------------------------------------------
def _check_conv_block(block) -> None:
    for conv in (block.conv1, block.conv2):
        same_conv_kernel(conv, f"MambaVisionConvBlock's {conv}", depthwise=False, square=True)


def _gelu_gain(u: torch.Tensor, act) -> torch.Tensor:
    """GELU(u) / u, with its limit 1/2 at u = 0."""
    value = run(act, u)
    return torch.where(u == 0, torch.full_like(u, 0.5), value / torch.where(u == 0, torch.ones_like(u), u))


def _conv_block(block, hidden, formulation, components, work_dtype):
    if hidden.dim() != 4:
        raise TypeError(f"mamba_captum: MambaVisionConvBlock takes (B, C, H, W); it received {tuple(hidden.shape)}.")
    _check_conv_block(block)
    batch, channels, rows, cols = hidden.shape
    x = hidden.detach().double()
    s1, t1 = batch_norm_affine(block.norm1, "MambaVisionConvBlock")
    s2, t2 = batch_norm_affine(block.norm2, "MambaVisionConvBlock")
    bias = lambda conv: torch.zeros(channels, dtype=torch.float64, device=x.device) \
        if conv.bias is None else conv.bias.double()  # noqa: E731
    c1, c2 = s1 * bias(block.conv1) + t1, s2 * bias(block.conv2) + t2
    gamma = block.gamma.double() if getattr(block, "layer_scale", False) else torch.ones_like(s2)
    w1, w2 = block.conv1.weight.double(), block.conv2.weight.double()
    per = lambda v: v[:, None, None, None]  # noqa: E731
    col = lambda v: v[None, :, None, None]  # noqa: E731
    linear1 = F.conv2d(x, per(s1) * w1, padding=w1.shape[-1] // 2)  # s1 ⊙ W1 ⋆ x
    pre = linear1 + col(c1)  # u = BN1(conv1(x)), GELU's input
    gain = _gelu_gain(pre, block.act1)
    first, second = per(s1) * w1, per(gamma * s2) * w2
    real = ChannelConvOperator(first, gain, second, x.flatten(2).transpose(1, 2), rows, cols)
    constant = gamma[None, :, None, None] * (F.conv2d(gain * col(c1), per(s2) * w2, padding=w2.shape[-1] // 2)
                                             + col(c2))  # (B, C, H, W): from no token
    shortcut = x
    to_grid = lambda out: out.transpose(1, 2).reshape(batch, -1, rows, cols)  # noqa: E731

    if formulation == "hidden":  # the first conv alone; BN1's shift, GELU, conv2, BN2, γ and x in the readout
        operator = ChannelConvOperator(first, None, None, real.values, rows, cols,
                                       output=linear1.flatten(2).transpose(1, 2))
        act = block.act1

        def readout(out):
            u = to_grid(out) + col(c1)
            branch = F.conv2d(run(act, u), per(s2) * w2, padding=w2.shape[-1] // 2) + col(c2)
            return shortcut + gamma[None, :, None, None] * branch
    else:
        output = real.apply(x).flatten(2).transpose(1, 2)  # H x, (B, L, C)
        norm = "norm" in components
        operator = ChannelConvOperator(first if norm else w1, gain if "act" in components else None,
                                       second if norm else per(gamma) * w2, real.values, rows, cols, output=output)

        def readout(out):
            return shortcut + to_grid(out) + constant

    operator.readout = readout
    rebuilt = readout(operator.output).to(hidden.dtype)
    return operator if work_dtype == torch.float64 else operator.to(work_dtype), rebuilt
