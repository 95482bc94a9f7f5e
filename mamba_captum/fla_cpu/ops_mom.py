"""Plain-torch version of flash-linear-attention 0.6.0's MoM token layout (``fla.layers.mom.transform``), with a
stable sort.

fla's ``transform`` groups the k copies of each real token by (batch row, memory) with ``argsort`` of one key per
copy, then cuts each memory's run of copies into a padded sub-sequence that the memory's gated delta rule runs as a
sequence of its own. The sort is meant to keep each memory's tokens in token order, but ``argsort`` is not stable:
on a CPU it reorders equal keys (a memory's tokens came out as [1, 3, 5, 0]), after which the layer is not causal
(a later token reaches an earlier one's output) and a row's output depends on the other rows of its batch (0.72
relative on a tiny model). Inside ``fla_on_cpu()`` the layout uses a stable sort: every memory's tokens in token
order, the layout fla's code describes; the adapter (``families/fla_mom.py``) rebuilds that same layout, and a
layout fla's own sort gives differently elsewhere (on CUDA) fails the engine's reconstruction check instead of
giving other numbers. fla's fix would be ``argsort(stable=True)`` in ``transform``.

Same signature and outputs as fla's: x (B, L, D) and selected_memories (B, L) or (B, L, k) -> (transformed
(M, B, n, D), truncation indices (B·M, n), sorted indices (B·L·k,), n, mask (B·M, n), mask (M, B, n)); like fla's,
it zeroes the pads' rows of ``routing_mask`` in place.
"""
from __future__ import annotations

import torch


def transform(x, routing_mask, num_memories, selected_memories, attention_mask):
    """fla.layers.mom.transform with each memory's tokens in token order (module docstring)."""
    topk = 1
    if selected_memories.dim() == 3:  # (B, L, k): k copies of every token, next to each other
        topk = selected_memories.shape[2]
        x = x.repeat_interleave(topk, dim=1)
        selected_memories = selected_memories.reshape(selected_memories.shape[0], -1)
    if attention_mask is not None:
        attention_mask = attention_mask[:, -routing_mask.shape[1]:]
        routing_mask[attention_mask.bitwise_not().unsqueeze(-1).expand(-1, -1, num_memories)] = 0
    batch, copies, width = x.shape
    with torch.no_grad():
        rows = torch.arange(batch, device=x.device).repeat_interleave(copies)
        if attention_mask is not None:  # the pads' copies after every row's
            rows[attention_mask.repeat_interleave(topk, dim=1).bitwise_not().flatten()] = batch
        memories = selected_memories.reshape(-1)
        sorted_indices = (rows * (memories.max() + 1) + memories).argsort(stable=True)
    x_sorted = x.reshape(batch * copies, width)[sorted_indices]
    with torch.no_grad():
        counts = routing_mask.sum(dim=1).flatten()  # (B·M,) copies per (row, memory), in sorted order
        ends = counts.cumsum(dim=0)
        longest = counts.max()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        indices = torch.arange(longest, device=ends.device)[None, :] + starts[:, None]
        mask = indices < ends[:, None]
        truncation_indices = torch.where(mask, indices, torch.zeros_like(indices))
    gathered = torch.gather(x_sorted, 0, truncation_indices.reshape(-1, 1).expand(-1, width))
    transformed = gathered.reshape(batch, num_memories, -1, width).transpose(0, 1)
    mask_2 = mask.reshape(batch, num_memories, -1).transpose(0, 1)
    return transformed, truncation_indices, sorted_indices, longest, mask, mask_2
