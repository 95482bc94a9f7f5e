"""Softmax attention over packed segments: ``Lfm3VlVisionAttention`` (the attention layers of LFM3-VL's vision
tower, model type lfm3_vl_vision).

Forward (transformers 5.23): on the packed patches h (N, D), q, k, v projections, RMS norms on q and k, 2-D RoPE;
then bidirectional attention within each frame (``cu_seqlens``, from ``grid_thw``): one call of HF's attention
interface per frame (eager, sdpa, flex), or one varlen call with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (flash);
``out_proj`` of the heads. The probabilities of each call are rebuilt as for every softmax layer
(:mod:`.softmax`, ``is_causal=False`` as recorded) and checked against that call's output; here they are placed
on the diagonal of one (1, H, N, N) matrix, zero across frames and items::

    P_h = blockdiag(P_h^(frame 1), P_h^(frame 2), ...)        over the values v (N, Hkv, d), kv heads repeated,

and ``out_proj(P v)`` is checked against the layer's real output, so the segment order is verified too. The maps
are the head mean (head-wise with ``reduce=None``), as for the softmax layers of hybrids; formulation and
components do not apply.
"""
from __future__ import annotations

import torch

from ..operators import SoftmaxOperator
from .common import linear_readout, run

MIXER_CLASSES = ("Lfm3VlVisionAttention",)
# why MambaLRP has no rules for this family (mamba_captum.families.lrp_plan.lrp_plan names it)
LRP_UNSUPPORTED = "MambaLRP explains token models; the vision towers over packed patches are not covered"
NONCAUSAL = True
# the adapter explains the layer from its recorded attention-interface calls (which are then no maps of their own)
CONSUMES_ATTENTION = True
ATTENTION_SEGMENTS = True  # one call per segment of the packed sequence (or one varlen call): all of them


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype, attention=None):
    """Rebuild the layer from the :class:`SoftmaxOperator` of each of its attention-interface calls, in order.

    Returns:
        (operator, rebuilt_output): a :class:`SoftmaxOperator` (1, H, N, N) block-diagonal over the packed
        sequence, and ``out_proj(P v)`` (N, D) like the layer's output.
    """
    module = call.located.module
    hidden = call.hidden_states
    if hidden.dim() != 2:
        raise TypeError(f"mamba_captum: {type(module).__name__} was called on batched inputs; explain the vision "
                        "tower itself: mc.implicit_attention(vision_tower, pixel_values=..., grid_thw=...).")
    length = hidden.shape[0]
    cu_seqlens = call.options.get("cu_seqlens")
    segments = None if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    sizes = [op.probs.shape[-1] for op in attention]
    whole = len(attention) == 1 and sizes[0] == length  # one varlen call: its mask already holds the segments
    if sum(sizes) != length or (segments is not None and not whole and sizes != segments):
        raise RuntimeError(f"mamba_captum: {type(module).__name__} attended over segments of {sizes} tokens, but "
                           f"its input has {length} tokens in segments of {segments}; not supported.")
    heads = attention[0].probs.shape[1]
    probs = attention[0].probs.new_zeros(1, heads, length, length)
    start = 0
    for op, size in zip(attention, sizes):
        probs[:, :, start:start + size, start:start + size] = op.probs
        start += size
    probs = probs.to(work_dtype)
    values = torch.cat([op.values for op in attention], dim=2).to(work_dtype)  # (1, H, N, d)
    output = (probs @ values).transpose(1, 2)  # (1, N, H, d)
    rebuilt = run(module.out_proj, output.reshape(length, -1).to(module.out_proj.weight.dtype))
    out_proj = linear_readout(module.out_proj)

    def readout(out):
        return out_proj(out.reshape(length, -1))

    return SoftmaxOperator(probs, None, values=values, output=output, readout=readout), rebuilt
