"""Plain-torch versions of flash-linear-attention's gated slot attention ops (``fla.ops.gsa``: ``chunk_gsa``,
``fused_recurrent_gsa``), which fla's ``GatedSlotAttention`` (GSA) and ``Raven`` layers call.

GSA is two passes of gated linear attention over M slots with a softmax between them (fla's ``naive_recurrent_gsa``),
per head, with slot write weights s_t (M) and log decays g_t ≤ 0 (M), one per slot::

    pass 1 (keys into slots):  Hk_t = Hk_{t−1} diag(e^{g_t}) + k_t s_tᵀ   (K × M),   ok_t = scale · Hk_tᵀ q_t
    softmax over the slots:    p_t = softmax(ok_t)                                                    (M)
    pass 2 (slots to values):  Hv_t = diag(e^{g_t}) Hv_{t−1} + s_t v_tᵀ   (M × V),   o_t = Hv_tᵀ p_t

Pass 2 is GLA with queries p, keys s and per-key-channel decays g (scale 1): :func:`gated_linear_chunked` as it is.
Pass 1 decays the state along its value side (the slots), which the GLA kernels do not take; slot m of it is
ok_t[m] = scale · Σ_{r≤t} (q_t · k_r) e^{Γ_t,m − Γ_r,m} s_r,m — a GLA head of its own with one decay per head g[..., m]
and the single value s[..., m]: :func:`mamba_captum.kernels.gated_linear.slot_scores`, the same kernel over H·M heads
of value width 1.

Without g (``g=None``) the slot logits s are normalised cumulatively first (ABC): fla's ``fused_additive_gate``
(:func:`.ops_gla_family.fused_additive_gate`). Keys and values shared by groups of query heads (HQ = NG · H) are
repeated per query head, and the final states taken from each group's first head (fla's ``[:, ::NG]``).

Each has its fla function's signature and layout (q, k: (B, T, H, K), v: (B, T, H, V), s, g: (B, T, H, M); the
state a pair (N, H, K, M), (N, H, M, V); packed sequences through ``cu_seqlens`` with B = 1), computes in float32 at
least (float64 for float64 inputs; fla's softmax is float32), returns o in q's dtype, and is differentiable through
autograd. A reversed scan is refused by name.
"""
from __future__ import annotations

import torch

from ..kernels.gated_linear import gated_linear_chunked, slot_scores
from .ops import refuse
from .ops_gla_family import fused_additive_gate


def _work(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gsa(q, k, v, s, g, scale, initial_state, output_final_state):
    """Both passes on one batch of whole sequences: (o (B, T, H, V) in the work dtype, (Hk, Hv) or None).
    initial_state: (Hk (B, H, K, M) or None, Hv (B, H, M, V) or None) — a None part starts from zeros."""
    work = _work(q)
    hk0, hv0 = initial_state
    q, k, v, s = (x.to(work) for x in (q, k, v, s))
    g = g.to(work)
    if q.shape[1] == 0:  # an empty packed sequence: no output, its state as it started
        batch, _, heads, key_dim = q.shape
        slots, width = s.shape[-1], v.shape[-1]
        hk = q.new_zeros(batch, heads, key_dim, slots) if hk0 is None else hk0.to(work)
        hv = q.new_zeros(batch, heads, slots, width) if hv0 is None else hv0.to(work)
        return v.new_zeros(batch, 0, heads, width), ((hk, hv) if output_final_state else None)
    ok, hk = slot_scores(q, k, s, g, scale, hk0, output_final_state)
    probs = ok.softmax(-1)
    o, hv = gated_linear_chunked(probs, s, v, g, scale=1.0, initial_state=hv0, output_final_state=output_final_state)
    return o, ((hk, hv) if output_final_state else None)


def _gsa_packed(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens):
    """The fla op's preamble (packed-input checks, the additive gate without g, the default scale, the query groups)
    and :func:`_gsa` per packed sequence. Returns (o, [Hk, Hv]) as fla does ([None, None] without final states)."""
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
        if initial_state is not None and initial_state[0].shape[0] != len(cu_seqlens) - 1:
            raise ValueError("The number of initial states is expected to be equal to the number of input sequences, "
                             f"i.e., {len(cu_seqlens) - 1} rather than {initial_state[0].shape[0]}.")
    if g is None:
        s, g, _ = fused_additive_gate(x=s, cu_seqlens=cu_seqlens, output_dtype=k.dtype, gate_dtype=torch.float32)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    hk0, hv0 = (None, None) if initial_state is None else initial_state
    key_heads, query_heads = k.shape[2], q.shape[2]
    if query_heads < key_heads or query_heads % key_heads:
        raise ValueError(f"The number of query heads ({query_heads}) must be a multiple of the number of key heads "
                         f"({key_heads}).")
    groups = query_heads // key_heads
    if groups > 1:
        k, v, s, g = (x.repeat_interleave(groups, dim=2) for x in (k, v, s, g))
        hk0, hv0 = (x.repeat_interleave(groups, dim=1) if x is not None else None for x in (hk0, hv0))
    if cu_seqlens is None:
        o, states = _gsa(q, k, v, s, g, scale, (hk0, hv0), output_final_state)
    else:  # each packed sequence on its own, from its own initial state
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for n, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            part = slice(begin, end)
            o, final = _gsa(q[:, part], k[:, part], v[:, part], s[:, part], g[:, part], scale,
                            tuple(None if x is None else x[n:n + 1] for x in (hk0, hv0)), output_final_state)
            outs.append(o)
            finals.append(final)
        o = torch.cat(outs, dim=1)
        states = (torch.cat([f[0] for f in finals]), torch.cat([f[1] for f in finals])) if output_final_state \
            else None
    o = o.to(q.dtype)
    if states is None:
        return o, [None, None]
    hk, hv = states
    if groups > 1:
        hk, hv = hk[:, ::groups].contiguous(), hv[:, ::groups].contiguous()
    return o, [hk, hv]


def chunk_gsa(q, k, v, s, g=None, scale=None, initial_state=None, output_final_state=False, checkpoint_level=2,
              cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla.ops.gsa.chunk_gsa: gated slot attention (see the module docstring). q (B, T, HQ, K); k (B, T, H, K);
    v (B, T, H, V); s, g (B, T, H, M) (g None: ABC's cumulative normalisation of s); initial_state (Hk (N, H, K, M),
    Hv (N, H, M, V)) or None. Returns (o (B, T, HQ, V), [Hk, Hv] or [None, None]). ``checkpoint_level`` (fla's
    memory / recomputation trade-off) changes nothing here; ``chunk_size`` is checked as fla checks it."""
    if "head_first" in kwargs:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    chunk_size = kwargs.pop("chunk_size", None)
    if chunk_size is not None and (chunk_size <= 0 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"`chunk_size` must be a power of 2, got {chunk_size}.")
    refuse("chunk_gsa", **kwargs)
    assert checkpoint_level in [0, 1, 2]
    return _gsa_packed(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)


def fused_recurrent_gsa(q, k, v, s, g=None, scale=None, initial_state=None, output_final_state=False, reverse=False,
                        cu_seqlens=None):
    """fla.ops.gsa.fused_recurrent_gsa: :func:`chunk_gsa` (the same recurrence; query heads sharing key heads are
    taken for any length, where fla's kernel takes them for single-token inference only). ``reverse`` is refused."""
    refuse("fused_recurrent_gsa", reverse=reverse)
    return _gsa_packed(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
