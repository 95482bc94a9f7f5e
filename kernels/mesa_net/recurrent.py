"""MesaNet one token at a time with explicit K × K states (see :mod:`kernels.mesa_net`): the reference of
:func:`~.chunked.mesa_chunked`, and fla's decoding step (``jacobi_start``)."""
from __future__ import annotations

import torch

from .chunked import CG_EPS, conjugate_gradient


def mesa_recurrent(q, k, v, log_decay, beta, lamb, iterations: int, *, h_kk_init=None, h_kv_init=None,
                   jacobi_start: bool = False, output_final_state: bool = False):
    """Per token: update H^kk, H^kv, then ``iterations`` CG steps on (H^kk_t + diag λ) x = q_t, from 0 (fla's chunk
    kernel) or with ``jacobi_start`` from q_t / (diag H^kk_t + λ + 1e−5) (fla's decoding kernel); o_t = H^kv_tᵀ x.
    Computed in q's dtype.

    Args:
        q, k: (B, L, H, K). v: (B, L, H, V). log_decay, beta: (B, L, H). lamb: (H, K). h_kk_init: (B, H, K, K) or
        None; h_kv_init: (B, H, K, V) or None.
    Returns:
        (o (B, L, H, V), q* (B, L, H, K), (H^kk_L, H^kv_L) or None).
    """
    batch, length, heads, dim = q.shape
    dtype = q.dtype
    h_kk = q.new_zeros(batch, heads, dim, dim) if h_kk_init is None else h_kk_init.to(dtype)
    h_kv = q.new_zeros(batch, heads, dim, v.shape[-1]) if h_kv_init is None else h_kv_init.to(dtype)
    lamb = lamb.to(dtype)
    outputs, queries = [], []
    for t in range(length):
        decay = log_decay[:, t].to(dtype).exp()[..., None, None]
        written = beta[:, t].to(dtype)[..., None] * k[:, t].to(dtype)
        h_kk = decay * h_kk + written[..., :, None] * k[:, t].to(dtype)[..., None, :]
        h_kv = decay * h_kv + written[..., :, None] * v[:, t].to(dtype)[..., None, :]
        matrix = h_kk

        def apply_a(p, matrix=matrix):  # H^kkᵀ p + λ p, as fla's kernels read the state
            return torch.einsum("bhij,bhi->bhj", matrix, p) + lamb * p

        query = q[:, t]
        start = (query / (torch.diagonal(h_kk, dim1=-2, dim2=-1) + lamb + CG_EPS) if jacobi_start
                 else torch.zeros_like(query))
        x = conjugate_gradient(apply_a, query, start, iterations)
        queries.append(x)
        outputs.append(torch.einsum("bhkv,bhk->bhv", h_kv, x))
    o, q_star = torch.stack(outputs, dim=1), torch.stack(queries, dim=1)
    return o, q_star, ((h_kk, h_kv) if output_final_state else None)
