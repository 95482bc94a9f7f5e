"""Softmax attention layers of hybrids (Jamba, Bamba, Zamba2's shared block, NemotronH, FalconH1, GraniteMoeHybrid).

The probabilities are rebuilt from what the layer handed to HF's attention interface (query and key after
projections, norms and RoPE; the mask; the scaling), so they are the same whatever ``attn_implementation`` the
model was loaded with (eager, sdpa, flash): ``P = softmax(q kᵀ · scaling + mask)`` per head, key/value heads repeated
for grouped-query attention; with an additive ``position_bias`` handed to the interface (inkling's relative logits)
and ``sinks`` (inkling2: one more logit per head and query whose value is zero, dropped after the softmax);
flash's varlen ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (packed sequences, e.g. LFM3-VL's vision frames) keep each
query within its own segment. ``P v`` is checked against the interface's real output.
"""
from __future__ import annotations

import torch

from ..operators import SoftmaxOperator


def _dense_block_mask(block_mask, batch: int, q_len: int, k_len: int, device) -> torch.Tensor:
    """flex_attention's ``BlockMask`` as the (B, 1, Lq, Lk) boolean mask its ``mask_mod`` defines, token by token."""
    from torch.nn.attention.flex_attention import create_mask

    return create_mask(block_mask.mask_mod, batch, 1, q_len, k_len, device=device)


def _segment_ids(cu_seqlens, length: int, device) -> torch.Tensor:
    """(length,) the packed segment of each token from cumulative lengths (0, n_1, n_1 + n_2, ...)."""
    bounds = torch.as_tensor(cu_seqlens, device=device).long()
    return torch.bucketize(torch.arange(length, device=device), bounds[1:], right=True)


def _additive_mask(call, q_len: int, k_len: int, dtype, device):
    mask = call.attention_mask
    if mask is not None and not torch.is_tensor(mask) and hasattr(mask, "mask_mod"):  # attn_implementation="flex"
        mask = _dense_block_mask(mask, call.query.shape[0], q_len, k_len, device)
    if mask is not None and mask.dim() == 4:
        mask = mask[..., :k_len]
        if mask.dtype == torch.bool:
            return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, float("-inf"))
        return mask.to(dtype)
    # No 4-D mask: causal (sdpa / flash build it themselves), plus the 2-D padding mask flash receives.
    is_causal = call.options.get("is_causal", getattr(call.module, "is_causal", True))
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if is_causal:
        keep = torch.tril(keep, diagonal=k_len - q_len)
    window = call.options.get("sliding_window")
    if window:
        keep = keep & torch.triu(torch.ones_like(keep), diagonal=k_len - q_len - window + 1)
    segments_q, segments_k = call.options.get("cu_seq_lens_q"), call.options.get("cu_seq_lens_k")
    if segments_q is not None and segments_k is not None:  # flash varlen: packed sequences attend within themselves
        keep = keep & (_segment_ids(segments_q, q_len, device)[:, None] == _segment_ids(segments_k, k_len, device))
    keep = keep[None, None]
    if mask is not None and mask.dim() == 2:
        keep = keep & mask[:, None, None, :k_len].bool()
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, float("-inf"))


def rebuild(call, work_dtype: torch.dtype, mask):
    """Returns (operator, rebuilt_output, real_output): the :class:`SoftmaxOperator` and P·v next to the real
    interface output, both (B, L, Hq, d)."""
    q, k, v = (t.to(work_dtype) for t in (call.query, call.key, call.value))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scaling = call.scaling if call.scaling is not None else q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scaling
    softcap = call.options.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    position_bias = call.options.get("position_bias")  # inkling: data-dependent relative logits (B, H, Lq, Lk)
    if position_bias is not None:
        scores = scores + position_bias.to(work_dtype)
    scores = scores + _additive_mask(call, q.shape[2], k.shape[2], work_dtype, q.device)
    sinks = call.options.get("sinks")  # inkling2: one extra logit per (head, query) with a zero value (B, H, Lq, 1)
    if sinks is not None:
        sinks = sinks.to(work_dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1].nan_to_num(0.0)
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked (pad) rows -> 0
    rebuilt = (probs @ v).transpose(1, 2)
    operator = SoftmaxOperator(probs, mask, values=v, output=rebuilt, readout=lambda out: out)
    return operator, rebuilt, call.output.to(work_dtype)
