"""LFM3-VL's vision short convolution: ``Lfm3VlVisionShortConv`` (the conv layers of ``Lfm3VlVisionModel``, model
type lfm3_vl_vision); the tower's attention layers are softmax layers (:mod:`.packed_attention`).

Forward (transformers 5.23): on the packed patches h (N, D) of all items, ``B, C, x = in_proj(h)``; ``u = B ⊙ x``;
each frame's patches (merge-block order) are laid on their grid, ``spatial_conv`` (depthwise Conv2d, K × K taps,
zero 'same' padding, no bias) runs over it and the result goes back to merge-block order; ``y = out_proj(C ⊙
conv(u))``. No token of another frame or item is read, so per channel c the conv is a sparse N × N matrix M_c with
at most K² entries per row, zero across frames and items::

    M_c[i, j] = w_c[a, b]   where patch j is patch i moved by (a − K//2, b − K//2) on the same frame's grid,

(rows and columns in the packed, merge-block token order; :meth:`mamba_captum.vision.PackedPatches.neighbours`).

- hidden: M_c alone, over u = B ⊙ x (the conv's input); the output gate C and out_proj come after it (readout).
- unified: ``H_c = diag(C_c) · M_c · diag(B_c)`` over x (like LFM2's short conv). Components: "gate" C, "act" B,
  "conv" the taps (off: ``diag(C ⊙ B)``).

A conv bias (none in transformers' class) would come from no token: added back by the readout.
"""
from __future__ import annotations

import torch

from ..operators import HeadOperator, sparse_conv
from ..layout import PackedPatches
from .common import linear_readout, run, same_conv_kernel

MIXER_CLASSES = ("Lfm3VlVisionShortConv",)
# why MambaLRP has no rules for this family (mamba_captum.families.lrp_plan.lrp_plan names it)
LRP_UNSUPPORTED = "MambaLRP explains token models; the vision towers over packed patches are not covered"
NONCAUSAL = True  # the conv reads both sides of each patch on the grid


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` (D one-channel heads, no core, a 2-D band over the N
        packed patches; B = 1) and the mixer output recomputed, (N, D) like the layer's.
    """
    mixer = call.located.module
    hidden = call.hidden_states
    grid = call.options.get("grid_thw")
    if grid is None or hidden.dim() != 2:
        raise TypeError("mamba_captum: Lfm3VlVisionShortConv was called without grid_thw or on batched (B, L, D) "
                        "inputs; explain the vision tower itself: mc.implicit_attention(vision_tower, "
                        "pixel_values=..., grid_thw=...).")
    layout = PackedPatches.from_grid(grid, mixer.spatial_merge_size)
    length, width = hidden.shape
    if layout.length != length:
        raise ValueError(f"mamba_captum: grid_thw holds {layout.length} patches, the layer received {length}.")
    kernel = same_conv_kernel(mixer.spatial_conv, "Lfm3VlVisionShortConv's spatial_conv")
    neighbours = layout.neighbours(kernel, hidden.device)  # (K², N)
    taps = mixer.spatial_conv.weight[:, 0].reshape(width, -1).to(work_dtype)  # (D, K²), the same tap order
    in_gate, out_gate, x = run(mixer.in_proj, hidden).to(work_dtype)[None].chunk(3, dim=-1)  # (1, N, D) each
    conved = sparse_conv(in_gate * x, taps, neighbours)  # the conv's output, from the band
    bias = mixer.spatial_conv.bias
    bias = torch.zeros(width, dtype=work_dtype, device=hidden.device) if bias is None else bias.to(work_dtype)
    output = out_gate * conved  # unified: H x, out_proj's input without the bias' share
    rebuilt = run(mixer.out_proj, (output + out_gate * bias)[0].to(hidden.dtype))
    out_proj = linear_readout(mixer.out_proj)
    gate64, bias64 = out_gate[0].double(), bias.double()

    per_channel = lambda t: None if t is None else t[..., None]  # noqa: E731  (1, N, D, 1): D one-channel heads
    if formulation == "hidden":  # the band alone over u; the gate and the bias act after it
        values, row, inputs, conv, result = in_gate * x, None, None, taps[:, None, :], conved

        def readout(out):
            return out_proj(gate64 * (out.reshape(length, width) + bias64))
    else:
        values, result = x, output
        row = out_gate if "gate" in components else None
        inputs = in_gate if "act" in components else None  # B acts before the conv
        conv = taps[:, None, :] if "conv" in components else None

        def readout(out):
            return out_proj(out.reshape(length, width) + gate64 * bias64)
    operator = HeadOperator(None, mask=None, heads=width, head_dim=1, row_weight=per_channel(row),
                            conv_weight=conv, input_weight=per_channel(inputs), neighbours=neighbours,
                            values=per_channel(values), output=per_channel(result), readout=readout)
    return operator, rebuilt
