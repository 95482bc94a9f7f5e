"""Plain-torch versions of flash-linear-attention 0.6.0's MesaNet ops (``fla.ops.mesa_net``: ``chunk_mesa_net``,
``mesa_net_decoding_one_step``), over :mod:`mamba_captum.kernels.mesa_net`. Layout as fla's: q, k, v
(B, T, H, K), g and β (B, T, H), λ (H, K), the states (N, H, K, K); packed sequences through ``cu_seqlens`` (B = 1).

MesaNet keeps two gated states, H^kk_t = exp(g_t) H^kk_{t−1} + β_t k_t k_tᵀ and H^kv_t = exp(g_t) H^kv_{t−1} +
β_t k_t v_tᵀ, and reads the second with q*_t ≈ (H^kk_t + diag(λ))^{−1} q_t: o_t = H^kv_tᵀ q*_t. What fla's kernels
compute for q* is NOT the exact solve but a fixed number of conjugate-gradient steps, and these versions run those
same steps:

* ``chunk_mesa_net`` (training and prefill; fla's ``chunk_fwd_mesa_cg_dim64_kernel``, and ``naive_mesa_net_CG``):
  per token, with A_t = H^kk_t + diag(λ): x = 0, r = q_t, p = r, δ = rᵀr, then exactly ``max_CG_iteration`` times
  (no stopping test): a = δ / (pᵀ A_t p + 1e−5); x += a p; r −= a A_t p; δ' = rᵀr; p = r + δ' / (δ + 1e−5) · p;
  δ = δ'. q* = x. A_t p_t for all tokens at once is a gated linear attention (queries p, keys β k, values k, one
  log decay per head, initial state H^kk_0), so each step is one gated linear read (``mesa_chunked``); so is the
  output, o = gla(q*, β k, v, g) from H^kv_0.
* ``mesa_net_decoding_one_step`` (one token with a cache; fla's ``mesa_net_decoding_one_step_kernel``): the same
  iteration from the Jacobi start x = q / (diag(H^kk_t) + λ + 1e−5), r = q − A_t x (fla's torch reference
  ``naive_mesa_net_decoding_one_step`` omits that 1e−5; the kernel is followed here).

fla's own ``naive_mesa_net_exact`` solves exactly (``torch.linalg.solve``): it is what the CG approaches, not what
the model computes. With ``use_qk_l2norm_in_kernel`` q and k are L2-normalised first (eps 1e−6 inside the root).
Precision: fla's chunk kernel rounds the normalised q, k to float16 and keeps its H^kv chunk states in bfloat16; these
versions compute in float32 (float64 for float64 inputs). Gradients: autograd through the CG steps (the exact
derivative of what the forward computes); fla's backward instead treats q* as the exact solve (one more CG solve
with A_t), which differs from it by the CG residual.
"""
from __future__ import annotations

import torch

from ..kernels.dplr import l2_normalised
from ..kernels.mesa_net import mesa_chunked, mesa_recurrent
from .ops import per_sequence


def chunk_mesa_net(q, k, v, g, beta, lamb, h_kk_init=None, h_kv_init=None, output_final_state=False,
                   max_CG_iteration=30, use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla.ops.mesa_net.chunk_mesa_net (module docstring): o_t = H^kv_tᵀ q*_t with q* from ``max_CG_iteration``
    CG steps from zero.

    Args:
        q, k, v: (B, T, H, K). g: (B, T, H) log decays. beta: (B, T, H). lamb: (H, K).
        h_kk_init, h_kv_init: (N, H, K, K) or None. cu_seqlens: (N + 1) bounds of packed sequences (B = 1).
    Returns:
        (o (B, T, H, K) in v's dtype, H^kk_T and H^kv_T (N, H, K, K) in float32 (float64 for float64 q), or None,
        None without ``output_final_state``).
    """
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalised(q), l2_normalised(k)
    initial = None if h_kk_init is None and h_kv_init is None else _PairedStates(h_kk_init, h_kv_init)

    def run(q, k, v, g, beta, initial_state, output_final_state):
        h_kk, h_kv = (None, None) if initial_state is None else initial_state.pair()
        o, _, states = mesa_chunked(q, k, v, g, beta, lamb, max_CG_iteration, h_kk_init=h_kk, h_kv_init=h_kv,
                                    output_final_state=output_final_state)
        return o, (None if states is None else torch.stack(states, dim=1))  # (N, 2, H, K, K)

    o, states = per_sequence(run, cu_seqlens, dict(q=q, k=k, v=v, g=g, beta=beta), initial, output_final_state)
    if not output_final_state:
        return o.to(v.dtype), None, None
    return o.to(v.dtype), states[:, 0], states[:, 1]


class _PairedStates:
    """The two initial states, sliced together by :func:`per_sequence` (``initial_state[n:n + 1]``)."""

    def __init__(self, h_kk, h_kv):
        self.h_kk, self.h_kv = h_kk, h_kv

    def __getitem__(self, index):
        return _PairedStates(None if self.h_kk is None else self.h_kk[index],
                             None if self.h_kv is None else self.h_kv[index])

    def pair(self):
        return self.h_kk, self.h_kv


def mesa_net_decoding_one_step(q, k, v, g, lamb, beta, prev_h_kk, prev_h_kv, max_CG_iteration=30):
    """fla.ops.mesa_net.mesa_net_decoding_one_step: one token. q, k: (B, H, K) (normalised by the caller); v: (B, H,
    V); g, beta: (B, H); lamb: (H, K); prev_h_kk (B, H, K, K), prev_h_kv (B, H, K, V). The states are updated, then
    ``max_CG_iteration`` CG steps from the Jacobi start q / (diag(H^kk) + λ + 1e−5) (fla's kernel).
    Returns (o (B, H, V) in q's dtype, H^kk, H^kv in the previous states' dtypes)."""
    work = torch.promote_types(q.dtype, torch.float32)
    token = lambda x: x.to(work)[:, None]  # noqa: E731  (B, 1, ...): one step of the per-token rule
    o, _, (h_kk, h_kv) = mesa_recurrent(token(q), token(k), token(v), token(g), token(beta), lamb,
                                        max_CG_iteration, h_kk_init=prev_h_kk, h_kv_init=prev_h_kv,
                                        jacobi_start=True, output_final_state=True)
    return o[:, 0].to(q.dtype), h_kk.to(prev_h_kk.dtype), h_kv.to(prev_h_kv.dtype)
