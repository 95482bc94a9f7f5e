"""The run-time check of the op swaps: a new fla release may change what an op computes while keeping its signature
(a default scale, the order of a decay and an update), and a swapped op would then give other numbers without a
word. So the first ``fla_on_cpu()`` of the process checks each op swap that has one of fla's own torch references
(``fla/ops/<op>/naive.py``) against it on a small random probe (float32, as fla's references compute), outputs and
final states; a swap that disagrees is not installed (fla's own function then runs: its Triton kernel on a GPU, its
error on a CPU) and warns once with :class:`FlaSwapMismatchWarning`.

:data:`PROBES`: swap key -> (fla's reference as ``module:function``, a probe builder ``(generator) -> (op kwargs,
reference kwargs)``). The probes are seeded; the tolerance (:data:`TOLERANCE`) is float32's rounding over a short
scan.
"""
from __future__ import annotations

import importlib
import warnings

import torch

TOLERANCE = 1e-4  # relative, float32 references on 12-token probes


class FlaSwapMismatchWarning(UserWarning):
    """An fla op's torch version disagrees with fla's own reference in this fla release: it is not swapped."""


def _randn(generator, *shape):
    return torch.randn(*shape, generator=generator)


def _log_decay(generator, *shape):
    return -torch.rand(*shape, generator=generator) * 0.7 - 0.02


def _gla(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    g, state = _log_decay(generator, 2, 12, 2, 4), _randn(generator, 2, 2, 4, 3)
    return (dict(q=q, k=k, v=v, g=g, initial_state=state, output_final_state=True),
            dict(q=q, k=k, v=v, gk=g, initial_state=state, output_final_state=True))


def _gla_recurrent(generator):
    ours, reference = _gla(generator)
    ours["gk"] = ours.pop("g")
    return ours, reference


def _simple_gla(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    g, state = _log_decay(generator, 2, 12, 2), _randn(generator, 2, 2, 4, 3)
    both = dict(q=q, k=k, v=v, g=g, initial_state=state, output_final_state=True)
    return both, dict(both)


def _gated_delta_rule(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    k = k / k.norm(dim=-1, keepdim=True)
    beta, g = torch.rand(2, 12, 2, generator=generator), _log_decay(generator, 2, 12, 2)
    state = _randn(generator, 2, 2, 4, 3)
    both = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, output_final_state=True)
    return both, dict(both)


def _kda(generator):
    ours, reference = _gated_delta_rule(generator)
    g = _log_decay(generator, 2, 12, 2, 4)
    ours["g"], reference["g"] = g, g
    return ours, reference


def _hgrn(generator):
    x, g, state = _randn(generator, 2, 12, 6), _log_decay(generator, 2, 12, 6), _randn(generator, 2, 6)
    both = dict(x=x, g=g, initial_state=state, output_final_state=True)
    return both, dict(both)


class _HeadFirst:
    """A reference taking (B, H, T, ·) tensors, called with fla's (B, T, H, ·) op layout: its output transposed back."""

    def __init__(self, reference, names):
        self.reference, self.names = reference, names

    def __call__(self, **kwargs):
        moved = {n: (v.transpose(1, 2).contiguous() if n in self.names else v) for n, v in kwargs.items()}
        o, state = self.reference(**moved)
        return o.transpose(1, 2), state


def _dplr(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    kk = _randn(generator, 2, 12, 2, 4)
    kk = kk / kk.norm(dim=-1, keepdim=True)
    a, b = -kk, kk * torch.rand(2, 12, 2, 4, generator=generator)
    g, state = _log_decay(generator, 2, 12, 2, 4), _randn(generator, 2, 2, 4, 3)
    ours = dict(q=q, k=k, v=v, a=a, b=b, gk=g, initial_state=state, output_final_state=True)
    # fla's dplr_recurrence: (B, H, T, ·) tensors, alpha / beta for a / b, the scale K^-1/2 fixed
    return ours, dict(q=q, k=k, v=v, alpha=a, beta=b, gk=g, initial_state=state, output_final_state=True)


def _rwkv7(generator):
    ours, reference = _dplr(generator)
    ours = dict(r=ours["q"] * 2.0, w=ours["gk"], k=ours["k"], v=ours["v"], a=ours["a"], b=ours["b"],
                scale=0.5 * ours["q"].shape[-1] ** -0.5, initial_state=ours["initial_state"],
                output_final_state=True)  # 2 · scale = K^-1/2, the scale fla's reference fixes
    return ours, reference


def _rwkv6(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    w, u, state = _log_decay(generator, 2, 12, 2, 4), _randn(generator, 2, 4), _randn(generator, 2, 2, 4, 3)
    return (dict(r=q, k=k, v=v, w=w, u=u, initial_state=state, output_final_state=True),
            dict(q=q, k=k, v=v, w=w, u=u, initial_state=state, output_final_state=True))


def _precond_gated_delta_rule(generator):
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)  # fla's reference always normalises
    beta, g = torch.rand(2, 12, 2, generator=generator), _log_decay(generator, 2, 12, 2)
    beta_atk, g_atk = torch.rand(2, 12, 2, generator=generator), _log_decay(generator, 2, 12, 2)
    state, a_state = _randn(generator, 2, 2, 4, 3), torch.rand(2, 2, 4, generator=generator)
    both = dict(q=q, k=k, v=v, g=g, beta=beta, g_atk=g_atk, beta_atk=beta_atk, initial_state=state,
                initial_A_state=a_state, output_final_state=True, log_atk_scale=_randn(generator, 2) * 0.5)
    return dict(both, use_qk_l2norm_in_kernel=False), dict(both)


def _gsa(generator):
    """Gated slot attention from given states: the output only (fla's op returns its state pair as a list, which
    the probe's comparison does not unpack), which reads both initial states through both passes."""
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    s, g = _randn(generator, 2, 12, 2, 5), _log_decay(generator, 2, 12, 2, 5)
    state = (_randn(generator, 2, 2, 4, 5), _randn(generator, 2, 2, 5, 3))
    both = dict(q=q, k=k, v=v, s=s, g=g, scale=0.5, initial_state=state, output_final_state=False)
    return both, dict(both)


def _abc(generator):
    """ABC from given states (its slot gates from the slot logits s): the output only, as for GSA (the state pair
    is compared in tests/test_fla_abc.py); fla's reference takes (B, H, T, ·) tensors."""
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    s = _randn(generator, 2, 12, 2, 5) * 2.0
    state = (_randn(generator, 2, 2, 4, 5), _randn(generator, 2, 2, 5, 3))
    both = dict(q=q, k=k, v=v, s=s, initial_state=state, output_final_state=False)
    return both, dict(both)


def _log_linear(generator):
    """Log-linear attention over 12 tokens (levels 0-4) with two value heads per key group: the output only (fla's
    reference has no state; the states are compared in tests/test_fla_log_linear_mamba2.py)."""
    q, k, v = _randn(generator, 2, 12, 1, 4), _randn(generator, 2, 12, 1, 4), _randn(generator, 2, 12, 2, 3)
    g, level_scales = _log_decay(generator, 2, 12, 2), torch.rand(2, 12, 2, 6, generator=generator) + 0.1
    both = dict(q=q, k=k, v=v, g=g, level_scales=level_scales, scale=0.5)
    return both, dict(both)


def _comba(generator):
    """Comba with its read key p, L2-normalised keys (fla's chunk reference takes them normalised)."""
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    p = _randn(generator, 2, 12, 2, 4)
    k, p = k / k.norm(dim=-1, keepdim=True), p / p.norm(dim=-1, keepdim=True)
    beta, g = torch.rand(2, 12, 2, generator=generator), _log_decay(generator, 2, 12, 2)
    state = _randn(generator, 2, 2, 4, 3)
    both = dict(q=q, k=k, v=v, p=p, g=g, beta=beta, scale=0.5, initial_state=state, output_final_state=True)
    return both, dict(both, chunk_size=4)  # chunk 4: the reference's chunk boundaries inside the 12 tokens


def _gated_delta_product(generator):
    """Two delta steps per token (k, v, β with 2·12 rows) and a decay per token."""
    q = _randn(generator, 2, 12, 2, 4)
    k, v = _randn(generator, 2, 24, 2, 4), _randn(generator, 2, 24, 2, 3)
    k = k / k.norm(dim=-1, keepdim=True)
    beta, g = torch.rand(2, 24, 2, generator=generator), _log_decay(generator, 2, 12, 2)
    state = _randn(generator, 2, 2, 4, 3)
    both = dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=2, scale=0.5, initial_state=state,
                output_final_state=True)
    return both, dict(both)


def _precond_kda(generator):
    ours, reference = _precond_gated_delta_rule(generator)
    g = _log_decay(generator, 2, 12, 2, 4)
    ours["g"], reference["g"] = g, g
    ours.pop("use_qk_l2norm_in_kernel")  # fla's chunk_precond_kda always normalises; its reference never does
    return ours, reference


def _kda_gate(generator):
    # one sequence (B = 1): an output without a state compares alike whether or not it is wrapped in a tuple
    both = dict(g=_randn(generator, 1, 12, 2, 4), A_log=_randn(generator, 2), dt_bias=_randn(generator, 8))
    return both, dict(both)


def _mesa_net(generator):
    """MesaNet, 6 CG steps, with initial states (H^kk_0 a sum of outer products: the CG's matrix stays positive
    definite); fla's chunk reference takes q, k normalised and a chunk size (12 tokens: 3 chunks of 4)."""
    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (_randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4)))
    v, g = _randn(generator, 2, 12, 2, 4), _log_decay(generator, 2, 12, 2)
    beta, lamb = torch.rand(2, 12, 2, generator=generator), torch.rand(2, 4, generator=generator) + 0.25
    keys = _randn(generator, 2, 2, 3, 4)
    h_kk, h_kv = torch.einsum("bhnk,bhnj->bhkj", keys, keys), _randn(generator, 2, 2, 4, 4)
    both = dict(q=q, k=k, v=v, g=g, beta=beta, lamb=lamb, h_kk_init=h_kk, h_kv_init=h_kv, max_CG_iteration=6)
    return dict(both, output_final_state=True), dict(both, chunk_size=4)


def _mesa_net_decoding(generator):
    """One MesaNet decoding step, 8 CG steps (fla's kernel starts them at q / (diag + λ + 1e-5), its reference at
    q / (diag + λ): converged, they agree to float32 rounding)."""
    ours, _ = _mesa_net(generator)
    step = {name: ours[name][:, 0] for name in ("q", "k", "v", "g", "beta")}
    both = dict(step, lamb=ours["lamb"], prev_h_kk=ours["h_kk_init"], prev_h_kv=ours["h_kv_init"], max_CG_iteration=8)
    return both, dict(both)

_DPLR_REFERENCE = ("fla.ops.generalized_delta_rule.dplr.naive:dplr_recurrence",
                   ("q", "k", "v", "alpha", "beta", "gk"))
_RWKV6_REFERENCE = ("fla.ops.rwkv6.recurrent_naive:naive_recurrent_rwkv6", ("q", "k", "v", "w"))


def _cyfa(generator):
    """CyFA's probe: 6 slots, a clock started far from 0; its state is a triple (Hk, Hv, λ), which the comparison
    does not unpack, so the probe reads the output from a given initial state (the final states: tests)."""
    q, k, v = _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 4), _randn(generator, 2, 12, 2, 3)
    g, delta = _log_decay(generator, 2, 12, 2), 2 * torch.rand(2, 12, 2, generator=generator)
    beta = torch.rand(2, 12, 2, generator=generator)
    state = (_randn(generator, 2, 2, 4, 6), _randn(generator, 2, 2, 6, 3), 5 * _randn(generator, 2, 2))
    both = dict(q=q, k=k, v=v, g=g, delta=delta, beta=beta, readout=_randn(generator, 2, 5, 5),
                q_norm_weight=1 + 0.2 * _randn(generator, 4), k_norm_weight=1 + 0.2 * _randn(generator, 4),
                q_norm_eps=1e-5, k_norm_eps=1e-5, scale=0.7, initial_state=state)
    return both, dict(both)

PROBES = {
    "fla.ops.generalized_delta_rule.dplr.chunk.chunk_dplr_delta_rule": (_DPLR_REFERENCE, _dplr),
    "fla.ops.rwkv7.chunk.chunk_rwkv7": (_DPLR_REFERENCE, _rwkv7),
    "fla.ops.rwkv6.chunk.chunk_rwkv6": (_RWKV6_REFERENCE, _rwkv6),
    "fla.ops.gla.chunk.chunk_gla": ("fla.ops.gla.naive:naive_recurrent_gla", _gla),
    "fla.ops.gla.fused_recurrent.fused_recurrent_gla": ("fla.ops.gla.naive:naive_recurrent_gla", _gla_recurrent),
    "fla.ops.simple_gla.chunk.chunk_simple_gla": ("fla.ops.simple_gla.naive:naive_recurrent_simple_gla",
                                                  _simple_gla),
    "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule": (
        "fla.ops.gated_delta_rule.naive:naive_recurrent_gated_delta_rule", _gated_delta_rule),
    "fla.ops.kda.chunk.chunk_kda": ("fla.ops.kda.naive:naive_recurrent_kda", _kda),
    "fla.ops.cyfa.chunk.chunk_cyfa": ("fla.ops.cyfa.naive:naive_recurrent_cyfa", _cyfa),
    "fla.ops.cyfa.fused_recurrent.fused_recurrent_cyfa": ("fla.ops.cyfa.naive:naive_recurrent_cyfa", _cyfa),
    "fla.ops.comba.chunk.chunk_comba": ("fla.ops.comba.naive:naive_chunk_comba", _comba),
    "fla.ops.gated_delta_product.chunk.chunk_gated_delta_product": (
        "fla.ops.gated_delta_product.naive:naive_recurrent_gated_delta_product", _gated_delta_product),
    "fla.ops.hgrn.fused_recurrent.fused_recurrent_hgrn": ("fla.ops.hgrn.naive:naive_recurrent_hgrn", _hgrn),
    "fla.ops.log_linear_attn.chunk.chunk_log_linear_attn": ("fla.ops.log_linear_attn.naive:naive_log_linear_attn",
                                                            _log_linear),
    "fla.ops.gsa.chunk.chunk_gsa": ("fla.ops.gsa.naive:naive_recurrent_gsa", _gsa),
    "fla.ops.gsa.fused_recurrent.fused_recurrent_gsa": ("fla.ops.gsa.naive:naive_recurrent_gsa", _gsa),
    "fla.ops.precond_gated_delta_rule.chunk.chunk_precond_gated_delta_rule": (
        "fla.ops.precond_gated_delta_rule.naive:naive_recurrent_precond_gated_delta_rule", _precond_gated_delta_rule),
    "fla.ops.precond_kda.chunk.chunk_precond_kda": ("fla.ops.precond_kda.naive:naive_recurrent_precond_kda",
                                                    _precond_kda),
    "fla.ops.kda.gate.fused_kda_gate": ("fla.ops.kda.gate:naive_kda_gate", _kda_gate),
    "fla.ops.abc.chunk.chunk_abc": (("fla.ops.abc.naive:naive_recurrent_abc", ("q", "k", "v", "s")), _abc),
    "fla.ops.mesa_net.chunk.chunk_mesa_net": ("fla.ops.mesa_net.naive:naive_mesa_net_CG", _mesa_net),
    "fla.ops.mesa_net.decoding_one_step.mesa_net_decoding_one_step": (
        "fla.ops.mesa_net.naive:naive_mesa_net_decoding_one_step", _mesa_net_decoding),
}


def _relative(got, expected) -> float:
    scale = expected.abs().max().item()
    error = (got.double() - expected.double()).abs().max().item()
    return error / scale if scale > 0 else error


def probe_difference(key: str, replacement) -> float | None:
    """The largest relative difference between ``replacement`` and fla's reference on the probe of ``key`` (outputs
    and final states); None where there is no probe or fla has no such reference (absent: not checkable here)."""
    if key not in PROBES:
        return None
    where, build = PROBES[key]
    head_first = None
    if isinstance(where, tuple):  # a reference with (B, H, T, ·) tensors: these argument names moved
        where, head_first = where
    module, _, name = where.partition(":")
    try:
        reference = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if head_first is not None:
        reference = _HeadFirst(reference, head_first)
    ours_kwargs, reference_kwargs = build(torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = replacement(**ours_kwargs)
        theirs = reference(**reference_kwargs)
    # outputs and states flattened (a state may be a pair, as GSA's, or a triple); a function giving one tensor (a
    # reference without a state, a gate function) is a 1-tuple, never unpacked along its batch dimension
    pairs = list(zip(_flat(ours), _flat(theirs)))
    return max(_relative(a, b) for a, b in pairs if a is not None and b is not None)


def _flat(result) -> list:
    """A function's result as a flat list of tensors (None kept in place)."""
    if result is None or isinstance(result, torch.Tensor):
        return [result]
    return [item for part in result for item in _flat(part)]


_verdicts: dict = {}  # (swap key, replacement) -> passed: each probe runs once per process


def check_swaps(swaps) -> list:
    """The swaps that pass their probe (or have none); each failing one warns with :class:`FlaSwapMismatchWarning`.
    A probe runs on the first installation of the process that needs it (its verdict is kept)."""
    kept = []
    for swap in swaps:
        verdict = _verdicts.get((swap.key, swap.replacement))
        if verdict is not None:
            if verdict:
                kept.append(swap)
            continue
        try:
            difference = probe_difference(swap.key, swap.replacement)
        except Exception as error:  # noqa: BLE001 (a reference that cannot run this probe: the swap cannot be vouched for)
            difference, detail = float("inf"), f"{type(error).__name__}: {error}"
        else:
            detail = None
        passed = _verdicts[(swap.key, swap.replacement)] = difference is None or difference <= TOLERANCE
        if passed:
            kept.append(swap)
            continue
        warnings.warn(
            f"mamba_captum: fla's {swap.key} and its torch version differ on the swap check "
            f"({detail or f'relative {difference:.3g}, tolerance {TOLERANCE:g}'}) in this fla release: it is not "
            "swapped, so it runs fla's own kernel (on a CPU: fails). Please report the fla version.",
            FlaSwapMismatchWarning, stacklevel=5)
    return kept
