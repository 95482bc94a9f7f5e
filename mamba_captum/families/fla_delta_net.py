"""flash-linear-attention's DeltaNet: ``DeltaNet`` (model type ``delta_net``); and what the adapters of fla's other
delta-rule layers share (:mod:`.fla_gated_deltanet`, :mod:`.fla_kda`, :mod:`.fla_comba`,
:mod:`.fla_gated_deltaproduct`): the q / k / v projections with their short convs, the output gate and norm, the
delta-rule core and the operator.

Forward (fla 0.6.0, ``fla/layers/delta_net.py``), h the layer input (fla packs the real tokens; see Pads): q, k, v =
the projections of h, each through its short conv (q and k: SiLU when ``qk_activation='silu'``, else no activation;
v: SiLU), or without convs ``silu(v_proj h)`` and q, k through SiLU when ``qk_activation='silu'``; then q, k through
relu / elu+1 / identity for the other ``qk_activation``; ``qk_norm='sum'``: q, k divided by their L1 norms;
β = σ(b_proj h) (1 without ``use_beta``; × 2 with ``allow_neg_eigval``); the delta rule (``fused_recurrent_delta_rule``
/ ``chunk_delta_rule``, q and k L2-normalised in the kernel with ``qk_norm='l2'``)::

    S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,      o_t = K^−½ S_tᵀ q_t

then the RMS norm over each head's value channels (``o_norm``; with ``use_gate`` the gated norm with gate
swish(g_proj h)), ``o_proj``.

hidden:  α_h[t, s] = q_tᵀ (I − β_t k_t k_tᵀ) ⋯ (I − β_{s+1} k_{s+1} k_{s+1}ᵀ) β_s k_s   (q, k as the kernel uses them,
         q scaled by K^−½), over v after its conv.
unified: H_c = diag(ν_c · swish(g_c)) · α_h · diag(σ(pre_c) · m) · M_c   over v_proj's output before the conv (pre: the
         conv's output; M_c the conv's taps; without a conv: diag(ν_c · swish(g_c)) · α_h · diag(σ(v_proj_c) · m));
         ν the norm's per-token scale (weight / rms, from the layer's own o), the gate factor 1 without ``use_gate``.
q, k and β come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.

Pads: fla unpads the batch (each sequence from a zero state and a zero conv window). The rebuild runs the padded
batch with the pads' inputs zeroed (:func:`mamba_captum.operators.masked_tokens`): zero projections, zero conv inputs
and zero keys write nothing into the state, so the real tokens' outputs are fla's, for left and right padding; a
conv bias would give the pads non-zero keys, so the keys after the conv are zeroed at the pads as well (a conv bias
makes the unified operator affine: refused there, as for GLA). Packed sequences (``cu_seqlens``) and a cached
prefix are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.delta_rule import delta_rule_output_chunked
from ..kernels.dplr import dplr_chunked
from ..operators import DeltaRuleCore, masked_tokens
from ..rules import silu_rule
from .common import run
from .fla_heads import head_lrp, head_operator, refuse_packed_or_cached, short_conv
from .gated_deltanet import delta_rule_inputs

MIXER_CLASSES = ("DeltaNet",)
INNER_MIXERS = {"DeltaNet": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def checked_input(call, formulation: str):
    """The layer's input h (B, L, D) with the pads zeroed, after refusing what the rebuild does not follow: packed
    sequences, a cached prefix, and (unified) a value conv with a bias (an affine operator)."""
    mixer = call.located.module
    name = type(mixer).__name__
    refuse_packed_or_cached(call)
    if formulation == "unified" and mixer.use_short_conv and mixer.v_conv1d.bias is not None:
        raise NotImplementedError(f"mamba_captum: the unified operator of fla's {name} whose value conv has a bias is "
                                  "not linear in the values; use formulation='hidden'.")
    if mixer.use_short_conv and mixer.v_conv1d.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: fla's {name} with value conv activation "
                                  f"{mixer.v_conv1d.activation!r} (fla's layers use silu).")
    return masked_tokens(call.hidden_states, call.attention_mask)


def qkv_projections(mixer, h, mask, *, qk_silu: bool = True):
    """q, k (B, L, H·K) as the layer passes them on (after their convs; keys zeroed at the pads), and the values:
    (v_proj's output, the pre-activation of the values' SiLU (the conv's output, or v_proj's output without a
    conv), v = silu(pre)), each (B, L, C) with C the value projection's width.

    qk_silu: whether q and k pass through a SiLU without convs (DeltaNet: only for ``qk_activation='silu'``)."""
    def projected(name, conv_name, silu):
        x = run(getattr(mixer, name), h)
        if mixer.use_short_conv:
            return (x, *short_conv(getattr(mixer, conv_name), x))
        return x, x, (F.silu(x) if silu else x)

    q = projected("q_proj", "q_conv1d", qk_silu)[2]
    k = masked_tokens(projected("k_proj", "k_conv1d", qk_silu)[2], mask)
    value_pre, act_pre, v = projected("v_proj", "v_conv1d", True)
    return q, k, value_pre, act_pre, v


def delta_layer_input(call, formulation: str, *, qk_silu: bool = True):
    """(mixer, h, projections) of a delta-rule layer's recorded call: the layer, its input h (B, L, D) from
    :func:`checked_input` and ``(q, k, value_pre, act_pre, v)`` from :func:`qkv_projections`."""
    mixer = call.located.module
    h = checked_input(call, formulation)
    return mixer, h, qkv_projections(mixer, h, call.attention_mask, qk_silu=qk_silu)


def write_strength(mixer, h) -> torch.Tensor:
    """β (B, L, HV) float64: σ(b_proj h) (1 without ``use_beta``), × 2 with ``allow_neg_eigval``."""
    if getattr(mixer, "use_beta", True):
        beta = torch.sigmoid(run(mixer.b_proj, h).double())
    else:
        beta = torch.ones(*h.shape[:2], mixer.num_heads, dtype=torch.float64, device=h.device)
    return beta * 2.0 if mixer.allow_neg_eigval else beta


def output_gate(mixer, h, gated: bool, head_dim: int):
    """(gate (B, L, HV, P) float64 or None, norm): the gated norm's gate act(g_proj h) (act: fla's swish or sigmoid,
    from ``o_norm.activation``) and ``o_norm``; without a gate (None, ``o_norm``)."""
    norm = mixer.o_norm
    if not gated:
        return None, norm
    activation = getattr(norm, "activation", "swish")
    act = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}.get(activation)
    if act is None:
        raise NotImplementedError(f"mamba_captum: fla's gated norm with activation {activation!r}.")
    gate = act(run(mixer.g_proj, h).double())
    return gate.reshape(*gate.shape[:2], -1, head_dim), norm


def dplr_output(core):
    """values (B, L, HV, P) float64 -> o = α v (B, L, HV, P): the chunked DPLR rule of a :class:`DPLRCore` (Comba,
    the preconditioned rules), as :func:`delta_operator`'s ``core_output``."""
    def output(values):
        return dplr_chunked(core.q.double(), core.k.double(), values, core.a.double(), core.b.double(),
                            core.log_decay, scale=core.scale)[0]
    return output


def delta_operator(call, formulation, components, work_dtype, *, mixer, core, value_pre, act_pre, v, gate, norm,
                   heads: int, head_dim: int, core_output=None):
    """The hidden or unified operator (:func:`.fla_heads.head_operator`) of a delta-rule layer and its rebuilt
    output.

    Args:
        core: the core α (a :class:`DeltaRuleCore`: q, k as the kernel uses them, HV heads). value_pre, act_pre, v:
            from :func:`qkv_projections`. gate, norm: from :func:`output_gate`. heads, head_dim: HV and P.
        core_output: ``values (B, L, HV, P) float64 -> o = α v`` (B, L, HV, P) float64; None: the chunked delta rule
            of a :class:`DeltaRuleCore`.
    """
    batch, length = v.shape[:2]
    values = v.reshape(batch, length, heads, head_dim).to(work_dtype)
    if core_output is None:
        output = delta_rule_output_chunked(core.q.double(), core.k.double(), core.beta.double(), core.log_decay,
                                           values.double())
    else:
        output = core_output(values.double())
    taps = mixer.v_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=head_dim,
                         values=values, output=output, gate=gate, norm=norm, out_proj=mixer.o_proj,
                         value_pre=value_pre, conv_pre=act_pre, taps=taps)


def delta_lrp(call, work_dtype, *, core, gated: bool, heads: int, head_dim: int, substeps: int = 1) -> torch.Tensor:
    """A delta-rule layer's output under MambaLRP's rules (:func:`.fla_heads.head_lrp`), a differentiable function
    of ``call.hidden_states``: v_proj and the value conv linear (a bias a constant; the pads' values zeroed before
    the conv, as fla's packed conv sees them), the values' SiLU by the identity rule, the core α (q, k, β, the decays:
    ``core``, detached) and the norm's ν detached, the gate act(g_proj h) (with ``gated``; act from the gated norm's
    ``activation``) by the identity and half rules (swish) or :func:`mamba_captum.rules.sigmoid_gate`. heads,
    head_dim: HV and P; substeps: n, the values' sub-steps (j, head, channel) of a gated DeltaProduct, whose core has
    n·HV heads (:func:`.fla_heads.head_lrp`). (B, L, D), float64."""
    mixer = call.located.module
    h = checked_input(call, "lrp")
    value = masked_tokens(run(mixer.v_proj, h).to(work_dtype), call.attention_mask)
    pre = short_conv(mixer.v_conv1d, value, work_dtype)[0] if mixer.use_short_conv else value
    values = silu_rule(pre).reshape(*pre.shape[:2], substeps * heads, head_dim)
    gate_input = run(mixer.g_proj, h) if gated else None
    activation = getattr(mixer.o_norm, "activation", "swish") if gated else None
    return head_lrp(call, work_dtype, core=core, values=values, gate_input=gate_input, gate_activation=activation,
                    norm=mixer.o_norm, out_proj=mixer.o_proj, heads=heads, head_dim=head_dim, substeps=substeps)


def _core(mixer, h, q, k, work_dtype):
    """DeltaNet's core (no decay; q, k through ``qk_activation`` / ``qk_norm`` as the kernel gets them)."""
    batch, length, _ = h.shape
    heads, key_dim = mixer.num_heads, mixer.head_k_dim
    with torch.no_grad():
        q, k = (_feature_map(mixer, x.reshape(batch, length, heads, key_dim)).flatten(2) for x in (q, k))
        beta = write_strength(mixer, h)
        no_decay = torch.zeros(batch, length, heads, dtype=torch.float64, device=h.device)
        if mixer.qk_norm == "l2":
            return delta_rule_inputs(q, k, beta, no_decay, heads, key_dim, work_dtype)
        per_head = lambda t: t.to(work_dtype).reshape(batch, length, heads, key_dim)  # noqa: E731
        return DeltaRuleCore(per_head(q) * key_dim ** -0.5, per_head(k), beta.to(work_dtype), no_decay)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`delta_lrp`; q, k and β detached in the core). (B, L, D),
    float64."""
    with torch.no_grad():
        mixer, h, (q, k, *_) = delta_layer_input(call, "lrp", qk_silu=call.located.module.qk_activation == "silu")
        core = _core(mixer, h, q, k, work_dtype)
    return delta_lrp(call, work_dtype, core=core, gated=mixer.use_gate, heads=mixer.num_heads,
                     head_dim=mixer.head_v_dim)


def _feature_map(mixer, x):
    """DeltaNet's ``qk_activation`` after the convs (silu is the convs' own) and its ``qk_norm='sum'``."""
    activation = mixer.qk_activation
    if activation == "relu":
        x = x.relu()
    elif activation == "elu":
        x = F.elu(x) + 1.0
    elif activation not in ("silu", "identity"):
        raise NotImplementedError(f"mamba_captum: DeltaNet with qk_activation {activation!r}.")
    if mixer.qk_norm == "sum":  # fla: F.normalize(x, p=1, eps=1e-6)
        x = F.normalize(x, p=1, dim=-1, eps=1e-6)
    return x


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (module docstring).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer, h, (q, k, value_pre, act_pre, v) = delta_layer_input(call, formulation,
                                                                qk_silu=call.located.module.qk_activation == "silu")
    heads, value_dim = mixer.num_heads, mixer.head_v_dim
    core = _core(mixer, h, q, k, work_dtype)
    gate, norm = output_gate(mixer, h, mixer.use_gate, value_dim)
    return delta_operator(call, formulation, components, work_dtype, mixer=mixer, core=core, value_pre=value_pre,
                          act_pre=act_pre, v=v, gate=gate, norm=norm, heads=heads, head_dim=value_dim)
