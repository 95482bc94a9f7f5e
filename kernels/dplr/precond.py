"""The preconditioned delta rules of flash-linear-attention 0.6.0 (``fla.ops.precond_gated_delta_rule``,
``fla.ops.precond_kda``) as inputs of the DPLR rule, and the L2 norm fla's delta-rule kernels apply to q and k.

Per head, with k (and q) L2-normalised (eps 1e-6 inside the root, as fla's kernels: :func:`l2_normalised`)::

    A_t = exp(g^atk_t) A_{t−1} + β^atk_t k_t ⊙ k_t                         (the "ATK" diagonal state, K per head)
    r_t = log(A_t + eps) − c_h,   M_t = exp(−log(x) · r_t / (1 + |r_t|)),   k̃_t = M_t ⊙ k_t   (M_t in [1/x, x])
    S_t = D_t S_{t−1} + β_t k̃_t (v_t − k_tᵀ D_t S_{t−1})ᵀ = (I − β_t k̃_t k_tᵀ) D_t S_{t−1} + β_t k̃_t v_tᵀ

with c_h = ``log_atk_scale`` (−0.2 when None), D_t = exp(g_t) (one per value head: gated DeltaNet) or diag(exp(g_t))
(one per key channel: KDA). The ATK state is a gated linear recurrence with a one-dimensional key β^atk and the value
k ⊙ k (:func:`mamba_captum.kernels.gated_linear.gated_linear_chunked`); it depends on the keys and the ATK gates
only, so the rule is linear in v with transitions independent of v: the DPLR rule
S_t = D_t S_{t−1} + b_t (a_tᵀ S_{t−1}) + k'_t v_tᵀ (:func:`.chunked.dplr_chunked`) with a = D_t k (the read sees the
decayed state), b = −β k̃ and the written key k' = β k̃.

- :func:`l2_normalised`: x / sqrt(Σ x² + 1e-6) over the last dim (fla's in-kernel L2 norm of the delta rules).
- :func:`atk_preconditioned_keys`: k̃ and the final ATK state.
- :func:`precond_dplr_inputs`: (q, k', a, b, log decay) for :func:`.chunked.dplr_chunked`, from q, k, k̃, g, β.
- :func:`precond_rule_inputs`: both, from the normalised q, k and the gates: what the op and the maps' core share.
"""
from __future__ import annotations

import math

import torch

from ..gated_linear.chunked import gated_linear_chunked


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σ x² + 1e-6) over the last dim, computed in float32 (float64 for float64 x), returned in x's dtype:
    fla's in-kernel L2 norm (``use_qk_l2norm_in_kernel``). x: (..., K)."""
    work = x.to(_compute_dtype(x))
    return (work * torch.rsqrt(work.square().sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def atk_preconditioned_keys(k: torch.Tensor, g_atk: torch.Tensor, beta_atk: torch.Tensor, log_atk_scale=None,
                            x: float = 1.5, eps: float = 1e-6, initial_A_state: torch.Tensor | None = None,
                            output_final_state: bool = False):
    """The preconditioned keys k̃ = M ⊙ k and the final ATK state (module docstring), differentiable.

    Args:
        k: (B, T, H, K) the keys as the rule uses them (normalised). g_atk: (B, T, H) log decays. beta_atk: (B, T, H).
        log_atk_scale: (H,) the per-head centre c_h, a number, or None (−0.2, fla's default). x: the squash range
            (M in [1/x, x]; x ≤ 0 gives M = 1, as fla's kernels). eps: inside the log.
        initial_A_state: (B, H, K) or None (zero). output_final_state: return A_T as well.
    Returns:
        (k̃ (B, T, H, K), A_T (B, H, K) or None), in the compute dtype (k's, float32 for half types).
    """
    dtype = _compute_dtype(k)
    k = k.to(dtype)
    batch, length, heads, _ = k.shape
    # A_t: a gated linear recurrence with one-dimensional keys β^atk (query 1, scale 1) and values k ⊙ k
    ones = k.new_ones(batch, length, heads, 1)
    state = None if initial_A_state is None else initial_A_state.to(dtype)[:, :, None, :]
    accumulated, final = gated_linear_chunked(ones, beta_atk.to(dtype)[..., None], k * k,
                                              g_atk.to(torch.promote_types(g_atk.dtype, dtype)), scale=1.0,
                                              initial_state=state, output_final_state=output_final_state)
    if log_atk_scale is None:
        log_atk_scale = -0.2
    centre = (torch.as_tensor(log_atk_scale, dtype=dtype, device=k.device).reshape(-1, 1)
              if isinstance(log_atk_scale, torch.Tensor) else log_atk_scale)  # (H, 1) or a number
    deviation = torch.log(accumulated.to(dtype) + eps) - centre
    log_x = math.log(x) if x > 0 else 0.0
    multiplier = torch.exp(-log_x * deviation / (1.0 + deviation.abs()))
    return k * multiplier, (final[:, :, 0].to(dtype) if output_final_state else None)


def precond_dplr_inputs(q: torch.Tensor, k: torch.Tensor, k_precond: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor):
    """The preconditioned rule as DPLR inputs: (q, k' = β k̃, a = D k, b = −β k̃, log_decay (B, T, HV, K)), q, k, k̃
    repeated for the HV value heads, in the compute dtype (q's, float32 for half types); the scale is left to the
    caller.

    Args:
        q, k, k_precond: (B, T, H, K) as the rule uses them (normalised; k̃ from :func:`atk_preconditioned_keys`).
        g: (B, T, HV) log decays per head or (B, T, HV, K) per key channel. beta: (B, T, HV).
    """
    dtype = _compute_dtype(q)
    group = beta.shape[2] // q.shape[2]
    q, k, k_precond = (x.to(dtype).repeat_interleave(group, dim=2) for x in (q, k, k_precond))
    log_decay = g.to(torch.promote_types(g.dtype, torch.float32))
    if log_decay.dim() == 3:
        log_decay = log_decay[..., None]
    log_decay = log_decay.expand(*k.shape)
    written = beta.to(dtype)[..., None] * k_precond
    read = log_decay.exp().to(dtype) * k  # the erase reads the state after this token's decay
    return q, written, read, -written, log_decay


def precond_rule_inputs(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, g_atk: torch.Tensor,
                        beta_atk: torch.Tensor, log_atk_scale=None, x: float = 1.5, eps: float = 1e-6,
                        initial_A_state: torch.Tensor | None = None, output_final_state: bool = False):
    """The whole preconditioned rule as DPLR inputs: the ATK state on its own heads (the key heads for gated DeltaNet,
    the value heads for KDA: q and k are repeated to them), k̃ from it, then :func:`precond_dplr_inputs`.

    Args:
        q, k: (B, T, H, K) as the rule uses them (normalised). g: (B, T, HV) or (B, T, HV, K). beta: (B, T, HV).
        g_atk, beta_atk: (B, T, H_atk), H_atk = H or HV. log_atk_scale, x, eps, initial_A_state (B, H_atk, K),
            output_final_state: as :func:`atk_preconditioned_keys`.
    Returns:
        (q, k', a, b, log_decay (B, T, HV, K), the final ATK state (B, H_atk, K) or None).
    """
    atk_heads = g_atk.shape[2]
    if atk_heads != k.shape[2]:
        q, k = (t.repeat_interleave(atk_heads // t.shape[2], dim=2) for t in (q, k))
    k_precond, final_A = atk_preconditioned_keys(k, g_atk, beta_atk, log_atk_scale, x, eps, initial_A_state,
                                                 output_final_state)
    return (*precond_dplr_inputs(q, k, k_precond, g, beta), final_A)
