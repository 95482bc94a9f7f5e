"""Plain-torch versions of flash-linear-attention's token-mixing ops (``fla.ops``), over the library's kernels:
:mod:`mamba_captum.kernels.gated_linear` (GLA, simple GLA, RetNet, linear attention, HGRN, RWKV-6),
:mod:`mamba_captum.kernels.delta_rule` (DeltaNet, gated DeltaNet, KDA) and :mod:`mamba_captum.kernels.dplr`
(RWKV-7's generalized delta rule).

Each function has its fla function's signature, takes fla's layout (q, k: (B, T, H, K), v: (B, T, H, V), the state
(N, H, K, V), or (N, H, V, K) with ``state_v_first``), packed sequences (``cu_seqlens``, B = 1) included, and
returns what fla returns: (o, final state or None). An argument whose meaning the torch version does not implement
(a reversed scan, a value gate, context parallelism, ...) is refused with a ``NotImplementedError`` naming it, never
ignored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.delta_rule import delta_rule_chunked_states
from ..kernels.dplr.chunked import dplr_chunked
from ..kernels.gated_linear import gated_linear_chunked


def refuse(op: str, **given) -> None:
    """Refuse each argument of ``given`` that is set (not None / False / 0)."""
    for name, value in given.items():
        if value is not None and value is not False and not (isinstance(value, (int, float)) and value == 0):
            raise NotImplementedError(
                f"mamba_captum: fla's {op} with {name}={value!r} has no torch version in mamba_captum.fla_on_cpu(); "
                "run it on a GPU, or leave fla_on_cpu() for this call.")


def _state_layout(state, state_v_first):
    """fla's state (N, H, V, K) with ``state_v_first`` <-> the kernels' (N, H, K, V)."""
    return state.transpose(-1, -2) if state is not None and state_v_first else state


def per_sequence(run, cu_seqlens, tensors: dict, initial_state, output_final_state):
    """``run(**tensors, initial_state=, output_final_state=) -> (o, state)`` on each packed sequence of the tensors
    (1, T_total, ...) split at ``cu_seqlens`` (N + 1), or on the batch as it is (``cu_seqlens`` None)."""
    if cu_seqlens is None:
        return run(**tensors, initial_state=initial_state, output_final_state=output_final_state)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = {name: (t[:, start:end] if isinstance(t, torch.Tensor) and t.dim() >= 3 else t)
                for name, t in tensors.items()}
        o, state = run(**part, initial_state=None if initial_state is None else initial_state[n:n + 1],
                       output_final_state=output_final_state)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1), (torch.cat(states) if output_final_state else None)


def _gated_linear(q, k, v, log_decay, scale, initial_state, output_final_state, cu_seqlens, state_v_first=False,
                  bonus=None):
    def run(q, k, v, log_decay, initial_state, output_final_state):
        return gated_linear_chunked(q, k, v, log_decay, scale=scale, bonus=bonus, initial_state=initial_state,
                                    output_final_state=output_final_state)

    o, state = per_sequence(run, cu_seqlens, dict(q=q, k=k, v=v, log_decay=log_decay),
                            _state_layout(initial_state, state_v_first), output_final_state)
    return o, _state_layout(state, state_v_first)


# -- GLA ----------------------------------------------------------------------------------------------------------------
def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None):
    """fla.ops.gla.chunk_gla: S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ, o_t = scale · S_tᵀ q_t; g (B, T, H, K)."""
    return _gated_linear(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, state_v_first)


def fused_chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                    cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla.ops.gla.fused_chunk_gla (an alias of chunk_gla in fla 0.6)."""
    refuse("fused_chunk_gla", **kwargs)
    return chunk_gla(q, k, v, g, scale, initial_state, output_final_state, state_v_first, cu_seqlens)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, **kwargs):
    """fla.ops.gla.fused_recurrent_gla: :func:`chunk_gla` with the key gate ``gk`` (no value gate, forward only)."""
    refuse("fused_recurrent_gla", gv=gv, reverse=reverse, **kwargs)
    return _gated_linear(q, k, v, gk, scale, initial_state, output_final_state, cu_seqlens, state_v_first)


# -- simple GLA, RetNet ---------------------------------------------------------------------------------------------
def _head_decay(q, g, g_gamma):
    """The per-step log decay (B, T, H): g, or the constant g_gamma (H,) at every step, or None."""
    if g is not None and g_gamma is not None:
        raise NotImplementedError("mamba_captum: fla's simple GLA with both g and g_gamma has no torch version.")
    if g_gamma is not None:
        return g_gamma.to(torch.float32 if q.dtype != torch.float64 else q.dtype).expand(*q.shape[:3])
    return g


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla.ops.simple_gla.chunk_simple_gla: one log decay per head and step, g (B, T, H), or a constant g_gamma (H,)."""
    refuse("chunk_simple_gla", **kwargs)
    return _gated_linear(q, k, v, _head_decay(q, g, g_gamma), scale, initial_state, output_final_state, cu_seqlens,
                         state_v_first)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None,
                               **kwargs):
    """fla.ops.simple_gla.fused_recurrent_simple_gla."""
    refuse("fused_recurrent_simple_gla", reverse=reverse, **kwargs)
    return chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, state_v_first, cu_seqlens)


def fused_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None):
    """fla.ops.simple_gla.fused_chunk_simple_gla."""
    return chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, False, cu_seqlens)


def retention_decay(q):
    """RetNet's log decays per head, as fla computes them: log(1 − 2^(−5−h)), (H,) float32."""
    return (1 - 2.0 ** (-5.0 - torch.arange(q.shape[2], dtype=torch.float, device=q.device))).log()


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
    """fla.ops.retention.chunk_retention: simple GLA with the fixed decays :func:`retention_decay`."""
    refuse("chunk_retention", **kwargs)
    return chunk_simple_gla(q, k, v, None, retention_decay(q), scale, initial_state, output_final_state, False,
                            cu_seqlens)


def fused_chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla.ops.retention.fused_chunk_retention."""
    return chunk_retention(q, k, v, scale, initial_state, output_final_state, cu_seqlens)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
                              state_v_first=False, cu_seqlens=None, **kwargs):
    """fla.ops.retention.fused_recurrent_retention."""
    refuse("fused_recurrent_retention", reverse=reverse, **kwargs)
    return _gated_linear(q, k, v, _head_decay(q, None, retention_decay(q)), scale, initial_state, output_final_state,
                         cu_seqlens, state_v_first)


def parallel_retention(q, k, v, scale=None, output_attentions=False, cu_seqlens=None):
    """fla.ops.retention.parallel_retention: the output (and no attention matrix)."""
    refuse("parallel_retention", output_attentions=output_attentions)
    return chunk_retention(q, k, v, scale, None, False, cu_seqlens)[0], None


# -- RWKV-6, HGRN -------------------------------------------------------------------------------------------------------
def chunk_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                cu_seqlens_cpu=None, **kwargs):
    """fla.ops.rwkv6.chunk_rwkv6: o_t = scale · (S_{t−1} + diag(u) k_t v_tᵀ)ᵀ r_t, S_t = diag(exp(w_t)) S_{t−1} +
    k_t v_tᵀ; w (B, T, H, K) log decays, u (H, K) the bonus."""
    refuse("chunk_rwkv6", **kwargs)
    return _gated_linear(r, k, v, w, scale, initial_state, output_final_state, cu_seqlens, bonus=u)


def fused_recurrent_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False, reverse=False,
                          cu_seqlens=None):
    """fla.ops.rwkv6.fused_recurrent_rwkv6."""
    refuse("fused_recurrent_rwkv6", reverse=reverse)
    return chunk_rwkv6(r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens)


def fused_recurrent_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla.ops.hgrn.fused_recurrent_hgrn: h_t = exp(g_t) ⊙ h_{t−1} + x_t, o_t = h_t, per channel; x, g (B, T, D),
    the state (N, D). Run as D heads of one key and one value channel."""
    batch, length, width = x.shape
    ones = torch.ones(batch, length, width, 1, dtype=x.dtype, device=x.device)
    state = None if initial_state is None else initial_state.reshape(-1, width, 1, 1)
    o, final = _gated_linear(ones, ones, x[..., None], g[..., None], 1.0, state, output_final_state, cu_seqlens)
    return o[..., 0], (None if final is None else final.reshape(-1, width))


def chunk_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None):
    """fla.ops.hgrn.chunk_hgrn (the same recurrence as :func:`fused_recurrent_hgrn`)."""
    return fused_recurrent_hgrn(x, g, initial_state, output_final_state, cu_seqlens)


# -- the delta rule -----------------------------------------------------------------------------------------------------
def _l2(x):
    return (x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
            * torch.rsqrt(x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).square()
                          .sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _delta_rule(q, k, v, beta, log_decay, scale, initial_state, output_final_state, cu_seqlens, *,
                use_qk_l2norm_in_kernel=False, state_v_first=False):
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    if beta is None:
        beta = torch.ones(q.shape[:3], dtype=q.dtype, device=q.device)

    def run(q, k, v, beta, log_decay, initial_state, output_final_state):
        return delta_rule_chunked_states(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state)

    o, state = per_sequence(run, cu_seqlens, dict(q=q, k=k, v=v, beta=beta, log_decay=log_decay),
                            _state_layout(initial_state, state_v_first), output_final_state)
    return o, _state_layout(state, state_v_first)


def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
    """fla.ops.delta_rule.chunk_delta_rule: S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = scale · S_tᵀ q_t."""
    refuse("chunk_delta_rule", **kwargs)
    return _delta_rule(q, k, v, beta, None, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla.ops.delta_rule.fused_recurrent_delta_rule (β defaults to one)."""
    return _delta_rule(q, k, v, beta, None, scale, initial_state, output_final_state, cu_seqlens,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:  # fla's own check, kept: the same call, the same error
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if beta.dim() != 3:
        refuse("the delta rule", **{f"a beta of shape {tuple(beta.shape)} (one per value channel)": True})
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float() if beta.dtype != torch.float64 else beta).to(beta.dtype)
    return beta * 2.0 if allow_neg_eigval else beta


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None, **kwargs):
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule: the delta rule after a decay exp(g_t) per head, g (B, T, H);
    fla reads ``use_gate_in_kernel``, ``A_log`` and ``dt_bias`` from its kwargs (fla's GatedDeltaNet passes them)."""
    use_gate_in_kernel = kwargs.pop("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    kwargs.pop("chunk_size", None)  # fla's tile size: changes no number
    refuse("chunk_gated_delta_rule", cp_context=cp_context, **kwargs)
    if use_gate_in_kernel:
        g = _gate_in_kernel(g, A_log, dt_bias)
    return _delta_rule(q, k, v, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), g, scale, initial_state,
                       output_final_state, cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       state_v_first=state_v_first)


def _gate_in_kernel(g, A_log, dt_bias):
    """−exp(A_log) · softplus(g + dt_bias), per head (g (B, T, H)) or per key channel (g (B, T, H, K)), float32."""
    work = torch.float64 if g.dtype == torch.float64 else torch.float32
    g = g.to(work)
    heads = g.shape[2]
    if dt_bias is not None:
        g = g + dt_bias.to(work).reshape(g.shape[2:])
    a = A_log.to(work).reshape(heads, *([1] * (g.dim() - 3)))
    return -a.exp() * F.softplus(g)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, **kwargs):
    """fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule: a head decay g or a key-channel decay gk (not
    both), the gate optionally computed in the kernel from A_log and dt_bias."""
    refuse("fused_recurrent_gated_delta_rule", gv=gv, **kwargs)
    if g is not None and gk is not None:
        refuse("fused_recurrent_gated_delta_rule", **{"g and gk together": True})
    decay = g if gk is None else gk
    if use_gate_in_kernel and g is None:  # fla's own check, kept
        raise ValueError("`use_gate_in_kernel=True` requires `g`.")
    if use_gate_in_kernel and decay is not None:
        decay = _gate_in_kernel(decay, A_log, dt_bias)
    if beta is None:
        beta = torch.ones(q.shape[:3], dtype=q.dtype, device=q.device)
    return _delta_rule(q, k, v, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), decay, scale,
                       initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       state_v_first=state_v_first)


def _kda_gate(g, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound):
    if not use_gate_in_kernel:
        return g
    if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):  # fla's own check, kept
        raise ValueError("`safe_gate=True` requires `lower_bound` in [-5, 0).")
    if safe_gate or lower_bound is not None:  # fla: lower_bound · σ(exp(A_log) · (g + dt_bias))
        work = torch.float64 if g.dtype == torch.float64 else torch.float32
        x = g.to(work)
        heads = x.shape[2]
        if dt_bias is not None:
            x = x + dt_bias.to(work).reshape(x.shape[2:])
        if A_log is not None:
            x = A_log.to(work).reshape(heads, 1).exp() * x
        return lower_bound * torch.sigmoid(x)
    return _gate_in_kernel(g, A_log, dt_bias)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, A_log=None, dt_bias=None, **kwargs):
    """fla.ops.kda.chunk_kda: the gated delta rule with one decay per key channel, g (B, T, H, K)."""
    refuse("chunk_kda", return_intermediate_states=return_intermediate_states, cp_context=cp_context, **kwargs)
    decay = _kda_gate(g, use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound)
    return _delta_rule(q, k, v, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), decay, scale,
                       initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       state_v_first=state_v_first)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """fla.ops.kda.fused_recurrent_kda."""
    refuse("fused_recurrent_kda", **kwargs)
    decay = _kda_gate(g, use_gate_in_kernel, A_log, dt_bias, False, lower_bound)
    return _delta_rule(q, k, v, _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval), decay, scale,
                       initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       state_v_first=state_v_first)


# -- RWKV-7: the generalized delta rule ---------------------------------------------------------------------------------
def _dplr(q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens):
    def run(q, k, v, a, b, gk, initial_state, output_final_state):
        return dplr_chunked(q, k, v, a, b, gk, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state)

    return per_sequence(run, cu_seqlens, dict(q=q, k=k, v=v, a=a, b=b, gk=gk), initial_state, output_final_state)


def _check_lower_bound(lower_bound):
    """fla's ``lower_bound`` is the caller's promise ``lower_bound ≤ gk < 0`` (it licenses faster Triton tiles and
    changes no number): accepted, and checked as fla checks it."""
    if lower_bound is not None and lower_bound >= 0:
        raise ValueError(f"`lower_bound` must be negative (gk is a log-decay < 0), got {lower_bound}.")


def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                          disable_recompute=False, cp_context=None, lower_bound=None, **kwargs):
    """fla.ops.generalized_delta_rule.chunk_dplr_delta_rule: S_t = (diag(exp(gk_t)) + a_t b_tᵀ)-type transition
    (:mod:`mamba_captum.kernels.dplr`) plus k_t v_tᵀ; o_t = scale · S_tᵀ q_t."""
    refuse("chunk_dplr_delta_rule", cp_context=cp_context, **kwargs)
    _check_lower_bound(lower_bound)
    return _dplr(q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens)


def fused_recurrent_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=False,
                                    reverse=False, cu_seqlens=None):
    """fla.ops.generalized_delta_rule.fused_recurrent_dplr_delta_rule."""
    refuse("fused_recurrent_dplr_delta_rule", reverse=reverse)
    return _dplr(q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens)


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                cu_seqlens_cpu=None, safe_gate=False, chunk_size=None, disable_recompute=False, cp_context=None,
                lower_bound=None):
    """fla.ops.rwkv7.chunk_rwkv7: the generalized delta rule with q = r and the log decays w."""
    refuse("chunk_rwkv7", cp_context=cp_context)
    _check_lower_bound(lower_bound)
    return _dplr(r, k, v, a, b, w, scale, initial_state, output_final_state, cu_seqlens)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None, output_final_state=True,
                          cu_seqlens=None):
    """fla.ops.rwkv7.fused_recurrent_rwkv7."""
    return _dplr(r, k, v, a, b, w, scale, initial_state, output_final_state, cu_seqlens)
