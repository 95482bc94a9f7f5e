"""LFM2 short convolutions: Lfm2ShortConv (lfm2, and the text model of lfm2_vl), Lfm2MoeShortConv (lfm2_moe),
Lfm3ShortConv (lfm3, lfm3_vl's text model); the attention layers of these hybrids are softmax layers (:mod:`.softmax`).

Forward (transformers 5.23, ``Lfm2ShortConv.forward``): ``B, C, x = in_proj(h·m)``; ``y = out_proj(C ⊙ conv(B ⊙ x))``
with a depthwise causal conv of K = ``conv_L_cache`` taps (bias when ``conv_bias``). No state beyond K − 1 tokens:
the operator is a band, per channel c::

    H_c[t, s] = C_{t,c} · w_{c, K−1−(t−s)} · B_{s,c}     for 0 ≤ t − s < K                     over x,

i.e. ``diag(C) · M · diag(B)``: the input gate B weighs the conv's input (``input_weight`` of the operator).

hidden and unified are the same operator (there is no core besides the conv). Components of the unified one:
"gate" the output gate C, "act" the input gate B, "conv" the taps (off: ``diag(C ⊙ B)``). Parts that come from no
real token are added back by the readout: the conv bias (C ⊙ b) and, with ``conv_bias`` (then in_proj has a bias
too), what left pads leave in the band (their x and B are in_proj's bias, not 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import HeadOperator, masked_tokens
from ..rules import half_product
from .common import linear_readout, run

MIXER_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")


def _band(values, taps):
    """The bias-free depthwise causal conv of values (B, L, D) with taps (D, K)."""
    length = values.shape[1]
    return F.conv1d(values.transpose(1, 2), taps[:, None, :], padding=taps.shape[-1] - 1,
                    groups=values.shape[-1])[..., :length].transpose(1, 2)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` (D channels, no core) and the mixer output
        recomputed, (B, L, D).
    """
    mixer = call.located.module
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, width = hidden.shape
    projected = run(mixer.in_proj, masked_tokens(hidden, mask)).to(work_dtype)
    in_gate, out_gate, x = projected.chunk(3, dim=-1)
    taps = mixer.conv.weight[:, 0, :].to(work_dtype)  # (D, K)
    bias = None if mixer.conv.bias is None else mixer.conv.bias.to(work_dtype)
    real_col = in_gate if mask is None else in_gate * mask[:, :, None].to(work_dtype)
    output = out_gate * _band(real_col * x, taps)  # what the real tokens give: H x
    constant = out_gate * _band(in_gate * x, taps) - output  # left pads' share (0 without an in_proj bias)
    if bias is not None:
        constant = constant + out_gate * bias
    rebuilt = run(mixer.out_proj, (output + constant).to(hidden.dtype))
    out_proj = linear_readout(mixer.out_proj)
    constant64 = constant.double()

    def readout(out):
        return out_proj(out.reshape(batch, length, width) + constant64)

    per_channel = lambda t: None if t is None else t[..., None]  # noqa: E731  (B, L, D, 1): D one-channel heads
    unified = formulation == "unified"
    row = out_gate if (not unified or "gate" in components) else None
    inputs = in_gate if (not unified or "act" in components) else None  # B acts before the conv
    if mask is not None:
        inputs = (torch.ones_like(in_gate) if inputs is None else inputs) * mask[:, :, None].to(work_dtype)
    conv = taps[:, None, :] if (not unified or "conv" in components) else None
    operator = HeadOperator(None, mask=None if mask is None else mask.to(work_dtype), heads=width, head_dim=1,
                            row_weight=per_channel(row), conv_weight=conv, input_weight=per_channel(inputs),
                            values=per_channel(x), output=per_channel(output), readout=readout)
    return operator, rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP-style rules: both gates of ``C ⊙ conv(B ⊙ x)`` by the half rule (B, C and x
    all come from the input), the conv linear (its bias a constant). (B, L, D), float64."""
    mixer = call.located.module
    hidden, mask = call.hidden_states, call.attention_mask
    projected = run(mixer.in_proj, masked_tokens(hidden, mask)).to(work_dtype)
    in_gate, out_gate, x = projected.chunk(3, dim=-1)
    conv_out = _band(half_product(in_gate, x), mixer.conv.weight[:, 0, :].to(work_dtype))
    if mixer.conv.bias is not None:
        conv_out = conv_out + mixer.conv.bias.to(work_dtype)
    return linear_readout(mixer.out_proj)(half_product(out_gate, conv_out).double())
