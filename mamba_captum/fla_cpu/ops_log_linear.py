"""Plain-torch versions of what flash-linear-attention's ``LogLinearMamba2`` layer needs on a CPU: the op
``chunk_log_linear_attn`` (``fla.ops.log_linear_attn``) over :mod:`mamba_captum.kernels.log_linear`, and the layer's
``forward``, which in fla refuses every device but CUDA.

``chunk_log_linear_attn``: o_i = scale · Σ_{j ≤ i} (q_i · k_j) exp(G_i − G_j) λ_i[ℓ(i, j)] v_j, ℓ the Fenwick level of
the absolute positions (fla's ``naive_log_linear_attn``), computed by blocks of 64 query rows (a masked matmul per
block, O(T²) work, O(64·T) memory per head). Its state is fla's :class:`LogLinearAttentionState`, in fla's layout: one
(K, V) state per level of completed 64-token chunks (the Fenwick tree of the chunks, each decayed to the end of the
last completed chunk; level ℓ held where bit ℓ of the chunk count is set), the tokens of the last partial chunk
(q, k, v, the raw log decays, the level scales; zero-padded to 64) and the token count. A state given back continues
the sequence at its absolute positions. The states are float32 as fla's, or the inputs' dtype where that is wider.
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from ..kernels.log_linear import bit_lengths, levels_needed, log_linear_alpha
from .ops import refuse

CHUNK = 64  # fla's chunk of the level states (its kernel's BT)


def _sequence(q, k, v, g, level_scales, scale: float, start):
    """One sequence (tensors (1, T, ·)), continued from ``start`` = (offset, levels (L_in, H, K, V), q, k, v, g and
    level scales of the partial chunk (64, ·)) or from nothing (None).

    Returns:
        (o (1, T, H, V), its final state's parts: the token count, {level: (H, K, V)}, the partial chunk's tensors).
    """
    heads, groups = v.shape[2], k.shape[2]
    offset, carried, old_levels = 0, 0, None
    if start is not None:
        offset, old_levels, *partial = start
        carried = offset % CHUNK
        # the tokens of the partial chunk go before the new ones: the chunks stay aligned to absolute positions
        q, k, v, g, level_scales = (torch.cat([p[:carried][None].to(t.dtype), t], dim=1)
                                    for p, t in zip(partial, (q, k, v, g, level_scales)))
    first = offset - carried  # the absolute position of token 0 (a multiple of 64)
    length = q.shape[1]
    q_heads, k_heads = (t.repeat_interleave(heads // groups, dim=2) for t in (q, k))  # head h reads group h // (H/G)
    cumulative = g.cumsum(1)
    outs = []
    for block_start in range(carried, length, CHUNK):
        rows = torch.arange(block_start, min(block_start + CHUNK, length), device=q.device)
        keys = int(rows[-1]) + 1
        alpha = log_linear_alpha(q_heads[:, :keys], k_heads[:, :keys], cumulative[:, :keys],
                                 level_scales[:, :keys], rows, offset=first)
        outs.append(torch.einsum("bhrl,blhv->brhv", alpha, v[:, :keys].to(alpha.dtype)))
    o = torch.cat(outs, dim=1) if outs else v[:, :0].clone()
    first_chunk = first // CHUNK
    if old_levels is not None and first_chunk:
        rows = torch.arange(carried, length, device=q.device)
        for level in range(first_chunk.bit_length()):
            if not first_chunk >> level & 1:
                continue
            # every key of an old level's block sits at one Fenwick level from each new query
            block_start = (first_chunk >> (level + 1) << (level + 1)) * CHUNK
            levels = bit_lengths(torch.bitwise_xor(rows + first, torch.full_like(rows, block_start)),
                                 levels_needed(length, first) - 1)
            weights = level_scales[0, rows].gather(-1, levels[:, None, None].expand(-1, heads, 1))[..., 0]  # (R, H)
            read = torch.einsum("rhk,hkv->rhv", q_heads[0, rows].to(o.dtype), old_levels[level].to(o.dtype))
            o = o + (weights * cumulative[0, rows].exp())[None, :, :, None].to(o.dtype) * read[None]
    o = o * scale

    completed = (first + length) // CHUNK  # the absolute count of completed chunks
    end = completed * CHUNK - first  # the new tokens [0, end) are in completed chunks
    to_end = cumulative[0, end - 1] if end > 0 else torch.zeros_like(cumulative[0, 0])  # (H,)
    levels = {}
    for level in range(completed.bit_length()):
        if not completed >> level & 1:
            continue
        block = completed >> (level + 1) << (level + 1)  # the first chunk of this level's block
        low, high = max(block * CHUNK - first, 0), (block + (1 << level)) * CHUNK - first
        decay = (to_end[None] - cumulative[0, low:high]).exp()  # (S, H)
        state = torch.einsum("shk,shv->hkv", k_heads[0, low:high] * decay[..., None].to(k.dtype), v[0, low:high])
        if old_levels is not None:  # the old levels whose blocks lie inside this one, decayed from the call's start
            for old in range(first_chunk.bit_length()):
                old_block = first_chunk >> (old + 1) << (old + 1)
                if first_chunk >> old & 1 and block <= old_block < block + (1 << level):
                    state = state + to_end.exp()[:, None, None] * old_levels[old].to(state.dtype)
        levels[level] = state
    partial = tuple(t[0, end:] for t in (q, k, v, g, level_scales))
    return o, (first + length, levels, partial)


def _final_state(parts, lengths, offsets, like_q, like_k, like_v, like_g, like_scales):
    """fla's :class:`LogLinearAttentionState` of the sequences' parts (see :func:`_sequence`), with fla's number of
    level slots (one more than the highest level its kernel can write)."""
    from fla.ops.log_linear_attn.chunk import LogLinearAttentionState

    totals = [length + offset for length, offset in zip(lengths, offsets)]
    max_level = math.ceil(math.log(max(math.ceil(t / CHUNK) for t in totals), 2)) - 1  # fla's formula, to the bit
    if max(totals) // CHUNK > 0:
        max_level = max(max_level, math.floor(math.log2(max(totals) // CHUNK)))
    count, heads, key_dim, value_dim = len(parts), like_v.shape[2], like_k.shape[-1], like_v.shape[-1]
    state_dtype = torch.promote_types(torch.float32, like_v.dtype)
    ht = like_v.new_zeros(count, max_level + 2, heads, key_dim, value_dim, dtype=state_dtype)

    q_prev, k_prev, v_prev, g_prev, scales_prev = (t.new_zeros(count, CHUNK, *t.shape[2:])
                                                   for t in (like_q, like_k, like_v, like_g, like_scales))
    for n, (_, levels, partial) in enumerate(parts):
        for level, state in levels.items():
            ht[n, level] = state
        for target, tensor in zip((q_prev, k_prev, v_prev, g_prev, scales_prev), partial):
            target[n, :tensor.shape[0]] = tensor
    offsets_out = torch.tensor([total for total, _, _ in parts], dtype=torch.int32, device=like_v.device)
    return LogLinearAttentionState(ht=ht, offsets=offsets_out, q_prev=q_prev, k_prev=k_prev, v_prev=v_prev,
                                   g_prev=g_prev, level_scales_prev=scales_prev)


def chunk_log_linear_attn(q, k, v, g, level_scales, initial_state=None, output_final_state=False, cu_seqlens=None,
                          scale=1.0):
    """fla's ``chunk_log_linear_attn`` in torch (see the module docstring).

    Args:
        q, k: (B, T, G, K); v: (B, T, H, V), H a multiple of G (head h reads group h // (H/G)); g: (B, T, H) log
            decays; level_scales: (B, T, H, n) λ per token, head and level (n covering the positions' levels).
        initial_state: fla's ``LogLinearAttentionState`` of N sequences, or None. cu_seqlens: (N + 1) packed
            sequences (B = 1), or None. scale: the score scale (None: K^-1/2).
    Returns:
        (o (B, T, H, V) in v's dtype, the final ``LogLinearAttentionState`` or None).
    """
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    if v.shape[2] % k.shape[2]:
        raise ValueError("The number of value heads must be divisible by the number of query/key heads.")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        pieces = [(b, slice(None)) for b in range(q.shape[0])]
    else:
        bounds = cu_seqlens.tolist()
        pieces = [(0, slice(s, e)) for s, e in zip(bounds[:-1], bounds[1:])]
    offsets = [0] * len(pieces) if initial_state is None else [int(o) for o in initial_state.offsets.tolist()]
    outs, parts = [], []
    for n, (b, span) in enumerate(pieces):
        start = None
        if initial_state is not None:
            s = initial_state
            start = (offsets[n], s.ht[n], s.q_prev[n], s.k_prev[n], s.v_prev[n], s.g_prev[n],
                     s.level_scales_prev[n])
        part = [t[b:b + 1, span] for t in (q, k, v, g, level_scales)]
        o, state_parts = _sequence(*part, scale=scale, start=start)
        outs.append(o)
        parts.append(state_parts)
    o = torch.cat(outs, dim=1 if cu_seqlens is not None else 0).to(v.dtype)
    if not output_final_state:
        return o, None
    lengths = [q[b:b + 1, span].shape[1] for b, span in pieces]
    return o, _final_state(parts, lengths, offsets, q, k, v, g, level_scales)


# -- the layer's forward ----------------------------------------------------------------------------------------------
def _causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None):
    """The causal-conv1d package's ``causal_conv1d_fn`` in torch: x (B, D, L), weight (D, W), bias (D,) -> (B, D, L),
    the depthwise causal conv, then SiLU with ``activation`` "silu" / "swish"."""
    refuse("causal_conv1d_fn", seq_idx=seq_idx)
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"mamba_captum: causal_conv1d_fn with activation={activation!r}.")
    width = weight.shape[-1]
    out = F.conv1d(x, weight[:, None].to(x.dtype), None if bias is None else bias.to(x.dtype), padding=width - 1,
                   groups=x.shape[1])[..., :x.shape[-1]]
    return out if activation is None else F.silu(out)


def _causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """The causal-conv1d package's ``causal_conv1d_update`` in torch: one token x (B, D) into ``conv_state``
    (B, D, W), the last W inputs, updated in place; returns the conv's output for the token (B, D)."""
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"mamba_captum: causal_conv1d_update with activation={activation!r}.")
    conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
    conv_state[:, :, -1] = x.to(conv_state.dtype)
    out = (conv_state * weight.to(conv_state.dtype)).sum(-1)
    out = out if bias is None else out + bias.to(out.dtype)
    return (out if activation is None else F.silu(out)).to(x.dtype)


class _WithTorchConv:
    """The layer as fla's ``cuda_kernels_forward`` reads it, with the causal-conv1d package's two functions in torch
    in place of the conv functions it kept when built (the package's CUDA ones, or fla's Triton ones: both fail on a
    CPU). Everything else is the layer's own."""

    def __init__(self, layer):
        self._layer = layer

    def __getattr__(self, name):
        if name == "causal_conv1d_fn":
            return _causal_conv1d
        if name == "causal_conv1d_update":
            return _causal_conv1d_update
        if name == "backend":
            return "cuda"  # the package's calling convention: (B, D, L) in and out, the update in place
        return getattr(self._layer, name)


def log_linear_mamba2_forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                              output_attentions=False, **kwargs):
    """fla's ``LogLinearMamba2.forward`` on a CPU (fla's raises NotImplementedError off CUDA): its own
    ``cuda_kernels_forward`` (prefill, training and cached one-token steps), whose ops are swapped, with the torch
    short convolution of :class:`_WithTorchConv`; the cache updated as fla's forward updates it."""
    if getattr(self, "chunk_size", 64) != 64:  # fla's scan refuses it with a bare NotImplementedError: name it
        raise NotImplementedError(f"mamba_captum: fla's LogLinearMamba2 with chunk_size={self.chunk_size}: fla's "
                                  "log-linear scan runs with chunk_size=64 only (on a GPU too); build it with 64.")
    layer_module = sys.modules[type(self).__module__]
    last_state = layer_module.get_layer_cache(self, past_key_values)
    output, conv_state, recurrent_state = type(self).cuda_kernels_forward(
        _WithTorchConv(self), hidden_states, last_state, use_cache, attention_mask)
    layer_module.update_layer_cache(self, past_key_values, recurrent_state=recurrent_state, conv_state=conv_state,
                                    offset=hidden_states.shape[1])
    return output, None, past_key_values
