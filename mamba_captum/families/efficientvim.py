"""EfficientViM's token mixers (timm's ``efficientvim_m*`` and :mod:`mamba_captum.vision.modeling_efficientvim`, the
same class and attribute names): the HSM-SSD mixer ``HSMSSD`` and the depthwise 3×3 ``ConvLayer2d`` residual
convolutions of each block (``dwconv1``, ``dwconv2``). Both take and give (B, C, H, W); the operators are over the
L = H·W tokens of the grid, row-major.

HSMSSD, on x (B, C, L), gates fixed at their real values (b, c, dt come from x through BCdt_proj and the depthwise
``dw`` conv: they are the mixer's data-controlled pieces, so ``dw`` is part of this operator, not a mixer of its own)::

    w = softmax_L(dt + A) ⊙ b                  (B, N, L): the write weight of token j into state n
    h₀ = x wᵀ,  [h₁; z] = W_hz h₀,  s = silu(z) + D,  h = W_o (h₁ ⊙ s),  y = h c

so that, per state n (a "head" of rank one over the tokens)::

    y[:, i] = Σ_n c[n, i] · W_o diag(s[:, n]) W_h · Σ_j w[n, j] x[:, j]

- hidden: the SSD core alone, α_n[i, j] = c[n, i] · w[n, j], one head per state over x itself (P = C channels);
  the channel map ``W_o diag(s_n) W_h`` of each state is the readout. Maps: ``mean_n α_n``.
- unified: with the gate, ``H_(n,e) = diag(s[e, n]) · α_n`` over the values ``v = W_h x`` (e one of the C_in hidden
  channels; s is constant over the tokens, z being fixed at its real value like every gate); the readout is
  ``W_o Σ_n``. Components: "gate" (s; off: α_n alone), "s6" (the core; off: α_n = I).

The head of an EfficientViM also reads each stage's last hidden state h (not only y): a gradient method sees that
path through the residual stream's gradients, not through the gradient at y (docs: the EfficientViM section).

ConvLayer2d (depthwise, k × k 'same', stride 1, no activation; BatchNorm2d in eval mode, an affine per channel):
per channel c a 2-D band over the grid, tap (a, b) reading token (row + a − k//2, col + b − k//2) (zero padding)::

    y_c = scale_c · (w_c ⋆ x_c) + shift_c,   scale = γ / sqrt(var + ε),  shift = β − mean · scale

- hidden: the conv's taps alone; the scale and the shift are the readout.
- unified: ``diag(scale_c) · M_c`` ("norm": the BatchNorm scale; "conv": the taps, off: the identity). The shift
  comes from no token: added by the readout.

1×1 ConvLayer2d (the FFN's) mix no tokens and are not claimed; a ConvLayer2d whose BatchNorm uses batch statistics
(train mode) or that timm has reparameterised (``fuse()``: no norm, a bias, the residual folded into the taps) is
refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import PackedPatches
from ..operators import DenseCore, HeadOperator, sparse_conv
from .common import batch_norm_affine, run, same_conv_kernel

MIXER_CLASSES = ("HSMSSD", "ConvLayer2d")
INNER_MIXERS = {"HSMSSD": ("dw",)}  # the gates' depthwise conv is part of HSMSSD's operator
# why MambaLRP has no rules for this family (mamba_captum.families.lrp_plan.lrp_plan names it)
LRP_UNSUPPORTED = "MambaLRP explains token models; EfficientViM's image mixers are not covered"
NONCAUSAL = True  # every token sees every other (HSMSSD) or its neighbours on both sides (the convs)


def claims(module) -> bool:
    """Whether a ConvLayer2d mixes tokens: a depthwise conv with a kernel larger than 1×1 and stride 1 (the blocks'
    ``dwconv1`` / ``dwconv2``). The FFN's and PatchMerging's 1×1 convs, the stem's and the stride-2 convs are not
    token mixers of a block. Every HSMSSD is claimed."""
    if type(module).__name__ != "ConvLayer2d":
        return True
    conv = getattr(module, "conv", None)
    if not isinstance(conv, torch.nn.Conv2d):
        return False
    return conv.groups == conv.in_channels == conv.out_channels and conv.groups > 1 \
        and max(conv.kernel_size) > 1 and tuple(conv.stride) == (1, 1)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the mixer's operator from its recorded input (B, C, H, W).

    Returns:
        (operator, rebuilt_output): a :class:`HeadOperator` over the L = H·W tokens and the mixer's output y
        recomputed from it, (B, C, H, W) like the module's (HSMSSD's first output).
    """
    if call.attention_mask is not None:
        raise ValueError("mamba_captum: an image has no padding: pass no attention_mask to an EfficientViM.")
    hidden = call.hidden_states
    if hidden.dim() != 4:
        raise TypeError(f"mamba_captum: {type(call.located.module).__name__} expects a (B, C, H, W) map; it received "
                        f"{tuple(hidden.shape)}.")
    build = _hsmssd if type(call.located.module).__name__ == "HSMSSD" else _depthwise
    with torch.no_grad():  # the operator's pieces are constants (the readouts are differentiated in their input)
        return build(call.located.module, hidden, formulation, components, work_dtype)


# ---------------------------------------------------------------------------------------------------------------
# HSMSSD


def _pointwise_weight(layer, name: str) -> torch.Tensor:
    """The (out, in) float64 matrix of a ConvLayer1d that is a bias-free 1×1 conv without norm or activation.

    Raises:
        TypeError: naming what differs from timm's HSMSSD (the operator would not describe it)."""
    conv = layer.conv
    if layer.norm is not None or layer.act is not None or conv.bias is not None or tuple(conv.kernel_size) != (1,) \
            or conv.groups != 1:
        raise TypeError(f"mamba_captum: HSMSSD.{name} is not a plain 1×1 projection (a norm, an activation, a bias "
                        "or a kernel > 1); this variant is not supported.")
    return conv.weight[:, :, 0].double()


def _hsmssd(mixer, hidden, formulation, components, work_dtype):
    if mixer.dw.norm is not None or mixer.dw.act is not None:
        raise TypeError("mamba_captum: HSMSSD.dw has a norm or an activation; this variant is not supported.")
    batch, width, height, columns = hidden.shape
    length, states, inner = height * columns, mixer.state_dim, mixer.d_inner
    flat = hidden.flatten(2)  # (B, C, L)
    # the gates as the module computes them (its own dtype), then float64
    gates = run(mixer.dw, run(mixer.BCdt_proj, flat).reshape(batch, -1, height, columns)).flatten(2).double()
    b, c, dt = gates.split(states, dim=1)  # (B, N, L)
    write = (dt + mixer.A.double().view(1, -1, 1)).softmax(-1) * b  # (B, N, L): w = a ⊙ b
    x = flat.double()
    w_hz = _pointwise_weight(mixer.hz_proj, "hz_proj")
    w_h, w_z = w_hz[:inner], w_hz[inner:]  # (C_in, C) each
    w_o = _pointwise_weight(mixer.out_proj, "out_proj")  # (C, C_in)
    state = x @ write.transpose(1, 2)  # (B, C, N): h₀
    scale = F.silu(w_z @ state) + mixer.D.double()  # (B, C_in, N): s, fixed
    mixed = (w_h @ state) * scale  # (B, C_in, N)
    y = (w_o @ mixed) @ c  # (B, C, L)
    rebuilt = y.reshape(batch, width, height, columns).to(hidden.dtype)

    core = DenseCore(torch.einsum("bni,bnj->bnij", c, write).to(work_dtype))  # α_n[i, j] = c[n, i] w[n, j]
    to_map = lambda out: out.transpose(1, 2).reshape(batch, width, height, columns)  # noqa: E731 (B, L, C) -> grid
    c_rows = c.to(work_dtype)
    if formulation == "hidden":  # over x itself (P = C); each state's channel map W_o diag(s_n) W_h is the readout
        values = x.transpose(1, 2)[:, :, None, :].expand(batch, length, states, width).to(work_dtype)
        output = torch.einsum("bni,bpn->binp", c_rows, state.to(work_dtype))  # c[n, i] h₀[p, n]
        row = None
        scale_t = scale.transpose(1, 2)[:, None]  # (B, 1, N, C_in)

        def readout(out):
            return to_map(((out.to(torch.float64) @ w_h.T) * scale_t).sum(2) @ w_o.T)
    else:  # over v = W_h x, one channel per (state, hidden channel), the gate s a constant row weight
        values = (x.transpose(1, 2) @ w_h.T)[:, :, None, :].expand(batch, length, states, inner).to(work_dtype)
        output = torch.einsum("bni,ben->bine", c_rows, mixed.to(work_dtype))  # c[n, i] (h₁ ⊙ s)[e, n]
        row = scale.transpose(1, 2)[:, None].expand(batch, length, states, inner).to(work_dtype) \
            if "gate" in components else None  # (the output is the whole operator's: the maps drop the gate)

        def readout(out):
            return to_map(out.to(torch.float64).sum(2) @ w_o.T)
    operator = HeadOperator(core, mask=None, heads=states, head_dim=values.shape[-1], row_weight=row,
                            s6="s6" in components or formulation == "hidden", values=values, output=output,
                            readout=readout)
    return operator, rebuilt


# ---------------------------------------------------------------------------------------------------------------
# the depthwise residual convolutions


def _batch_norm_affine(norm, channels: int):
    """(scale, shift) float64 (C,) of an eval-mode BatchNorm2d, or of none: 1, 0."""
    if norm is None:
        ones = torch.ones(channels, dtype=torch.float64)
        return ones, torch.zeros_like(ones)
    return batch_norm_affine(norm, "an EfficientViM ConvLayer2d")


def _check_depthwise(module) -> tuple[int, int]:
    """The (kh, kw) of a depthwise, stride-1, dilation-1, 'same' zero-padded conv with odd kernels, no activation,
    not reparameterised.

    Raises:
        TypeError: naming what differs."""
    conv = module.conv
    if module.norm is None and conv.bias is not None:
        raise TypeError("mamba_captum: this EfficientViM is reparameterised (timm's fuse(): the BatchNorm and the "
                        "residual folded into the depthwise convs, so the block's residual is inside the conv); "
                        "explain the model before timm.models.reparameterize_model.")
    if module.act is not None:
        raise TypeError(f"mamba_captum: a depthwise ConvLayer2d with an activation ({type(module.act).__name__}); "
                        "not supported.")
    kh, kw = same_conv_kernel(conv, "a depthwise ConvLayer2d")
    return kh, kw


def _depthwise(module, hidden, formulation, components, work_dtype):
    kernel = _check_depthwise(module)
    conv = module.conv
    batch, width, height, columns = hidden.shape
    length = height * columns
    neighbours = PackedPatches.from_grid([[1, height, columns]], 1).neighbours(kernel, hidden.device)  # (K², L)
    taps = conv.weight[:, 0].reshape(width, -1).double()  # (C, K²), the neighbours' tap order
    scale, shift = (t.to(hidden.device) for t in _batch_norm_affine(module.norm, width))
    bias = shift if conv.bias is None else shift + scale * conv.bias.double()
    x = hidden.flatten(2).transpose(1, 2).double()  # (B, L, C)
    conved = sparse_conv(x, taps, neighbours)  # w ⋆ x
    to_map = lambda out: out.transpose(1, 2).reshape(batch, width, height, columns)  # noqa: E731
    rebuilt = to_map(conved * scale + bias).to(hidden.dtype)

    per_channel = lambda t: None if t is None else t[..., None].to(work_dtype)  # noqa: E731 (B, L, C, 1)
    if formulation == "hidden":  # the taps alone; the BatchNorm affine is the readout
        row, conv_taps, result = None, taps, conved

        def readout(out):
            return to_map(out.to(torch.float64).reshape(batch, length, width) * scale + bias)
    else:
        row = scale.expand(batch, length, width) if "norm" in components else None
        conv_taps = taps if "conv" in components else None
        result = conved * scale

        def readout(out):
            return to_map(out.to(torch.float64).reshape(batch, length, width) + bias)
    operator = HeadOperator(None, mask=None, heads=width, head_dim=1, row_weight=per_channel(row),
                            conv_weight=None if conv_taps is None else conv_taps[:, None, :].to(work_dtype),
                            neighbours=neighbours, values=per_channel(x), output=per_channel(result),
                            readout=readout)
    return operator, rebuilt
