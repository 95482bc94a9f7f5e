"""MesaNet over all tokens at once (see :mod:`kernels.mesa_net`): the conjugate-gradient steps of every token run
together, each product (H^kk_t + diag λ) p_t a gated linear attention read of H^kk."""
from __future__ import annotations

import torch

from ..gated_linear.chunked import gated_linear_chunked

CG_EPS = 1e-5  # fla's guard in both CG denominators (and in its decoding kernel's Jacobi start)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1)


def conjugate_gradient(apply_a, q: torch.Tensor, x: torch.Tensor, iterations: int) -> torch.Tensor:
    """fla's CG for A x = q from x: r = q − A x, p = r, then exactly ``iterations`` times (no stopping test)
    a = rᵀr / (pᵀ A p + 1e−5), x += a p, r −= a A p, p = r + (r'ᵀr' / (rᵀr + 1e−5)) p.

    Args:
        apply_a: (…, K) -> A (…, K), one system per leading index. q, x: (…, K). iterations: the step count.
    Returns:
        x (…, K).
    """
    r = q - apply_a(x)
    p, delta_old = r, _dot(r, r)
    for _ in range(int(iterations)):
        a_p = apply_a(p)
        step = delta_old / (_dot(p, a_p) + CG_EPS)
        x = x + step[..., None] * p
        r = r - step[..., None] * a_p
        delta_new = _dot(r, r)
        p = r + (delta_new / (delta_old + CG_EPS))[..., None] * p
        delta_old = delta_new
    return x


def _compute(q: torch.Tensor) -> torch.dtype:
    """At least float32; float64 stays float64."""
    return torch.promote_types(q.dtype, torch.float32)


def mesa_query(q, k, log_decay, beta, lamb, iterations: int, h_kk_init=None) -> torch.Tensor:
    """q* for every token: ``iterations`` CG steps from 0 on (H^kk_t + diag λ) x = q_t.

    Args:
        q, k: (B, L, H, K) as the rule uses them (fla normalises them first). log_decay: (B, L, H) ≤ 0.
        beta: (B, L, H). lamb: (H, K). h_kk_init: (B, H, K, K) or None (zeros).
    Returns:
        q* (B, L, H, K) in the compute dtype (q's, at least float32).
    """
    work = _compute(q)
    q, k = q.to(work), k.to(work)
    written = beta.to(work)[..., None] * k
    log_decay = log_decay.to(torch.promote_types(log_decay.dtype, work))
    state = None if h_kk_init is None else h_kk_init.to(work)
    ridge = lamb.to(work)

    def apply_a(p):  # (H^kk_t + diag λ) p_t for every token t: a gated linear attention read of H^kk (H^kkᵀ p)
        return gated_linear_chunked(p, written, k, log_decay, scale=1.0, initial_state=state)[0] + ridge * p

    return conjugate_gradient(apply_a, q, torch.zeros_like(q), iterations)


def mesa_chunked(q, k, v, log_decay, beta, lamb, iterations: int, *, h_kk_init=None, h_kv_init=None,
                 output_final_state: bool = False):
    """MesaNet's outputs with q* from CG steps started at 0 (fla's ``chunk_mesa_net``).

    Args:
        q, k: (B, L, H, K). v: (B, L, H, V). log_decay, beta: (B, L, H). lamb: (H, K). iterations: CG steps.
        h_kk_init: (B, H, K, K) or None. h_kv_init: (B, H, K, V) or None. output_final_state: return the states.
    Returns:
        (o (B, L, H, V), q* (B, L, H, K), (H^kk_L, H^kv_L) or None), in the compute dtype (q's, at least float32).
    """
    work = _compute(q)
    q_star = mesa_query(q, k, log_decay, beta, lamb, iterations, h_kk_init)
    written = beta.to(work)[..., None] * k.to(work)
    log_decay = log_decay.to(torch.promote_types(log_decay.dtype, work))
    cast = lambda t: None if t is None else t.to(work)  # noqa: E731
    o, h_kv = gated_linear_chunked(q_star, written, v.to(work), log_decay, scale=1.0, initial_state=cast(h_kv_init),
                                   output_final_state=output_final_state)
    if not output_final_state:
        return o, q_star, None
    _, h_kk = gated_linear_chunked(q_star, written, k.to(work), log_decay, scale=1.0, initial_state=cast(h_kk_init),
                                   output_final_state=True)
    return o, q_star, (h_kk, h_kv)
