"""flash-linear-attention's gated DeltaProduct: ``GatedDeltaProduct`` (model type ``gated_deltaproduct``).

Forward (fla 0.6.0, ``fla/layers/gated_deltaproduct.py``), h the layer input (pads: :mod:`.fla_delta_net`): q, k, v =
silu(short conv(projection of h)) each (without convs silu(projection)); per token n = ``num_householder`` keys,
values and β: k (n·H·K channels), v (n·HV·P), β = σ(b_proj h) (n·HV; × 2 with ``allow_neg_eigval``), laid out
(j, head, channel) for sub-step j; with ``use_forget_gate`` g = −exp(A_log)·softplus(a_proj h + dt_bias) per value
head (from float32 casts of a_proj h and A_log); q, k repeated for the HV value heads; ``chunk_gated_delta_product``
(or, without gradients, ``fused_recurrent_gated_delta_rule`` over the T·n sub-steps) with q, k L2-normalised in the
kernel: per token S ← e^{g_t} S, then for j = 0 … n − 1 S ← (I − β_{t,j} k_{t,j} k_{t,j}ᵀ) S + β_{t,j} k_{t,j}
v_{t,j}ᵀ, then o_t = K^−½ Sᵀ q_t; ``o_norm`` (with ``use_output_gate`` fla's gated RMS norm, gate swish(g_proj h),
else its RMS norm); ``o_proj``. That is the gated delta rule over the L·n sub-steps (t, j), the decay on (t, 0) and
the query on (t, n − 1), read there (:class:`mamba_captum.operators.DeltaProductCore`).

hidden:  one core per sub-step j and value head h, α_(j,h)[t, s] = α_h[(t, n−1), (s, j)], the delta rule's weight of
         the value written at sub-step j of token s in token t's output, over v after its conv as the n·HV heads
         (j, h) of P channels; o_t = Σ_j (α_(j,h) v_(j,h))_t: the readout sums the sub-steps, then the norm and gate.
unified: H_c = diag(ν_(h,p) · swish(g_(h,p))) · α_(j,h) · diag(σ(pre_c) · m) · M_c   for value channel c = (j, h, p)
         of v_proj's output before the conv (pre the conv's output, M_c its taps; without a conv
         diag(σ(v_proj_c) · m)); ν the norm's per-token scale over the head's P channels of o; the layer's o_proj
         input is Σ_j of the output channels (j, h, p) (n = 1: the channels themselves).
q, k, β and g come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch

from ..kernels.delta_rule import delta_rule_output_chunked
from ..operators import DeltaProductCore, HeadOperator, gate_norm_rows
from .common import linear_readout, run
from .fla_delta_net import checked_input, delta_lrp, output_gate, qkv_projections
from .fla_gated_deltanet import head_log_decay
from .fla_heads import rms_scale
from .gated_deltanet import delta_rule_inputs

MIXER_CLASSES = ("GatedDeltaProduct",)
INNER_MIXERS = {"GatedDeltaProduct": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def delta_product_core(mixer, h, q, k, work_dtype):
    """The :class:`DeltaProductCore` of the layer: q (B, L, H·K), k (B, L, n·H·K) after their convs."""
    batch, length, _ = h.shape
    n, value_heads, key_dim = mixer.num_householder, mixer.num_v_heads, mixer.head_k_dim
    beta = torch.sigmoid(run(mixer.b_proj, h).double()).reshape(batch, length * n, value_heads)
    if mixer.allow_neg_eigval:
        beta = beta * 2.0
    if mixer.use_forget_gate:
        log_decay = head_log_decay(run(mixer.a_proj, h).float(), mixer.A_log.float(), mixer.dt_bias)
    else:
        log_decay = torch.zeros(batch, length, value_heads, dtype=torch.float64, device=h.device)
    # the sub-steps (t, j): q_t on (t, n − 1) and g_t on (t, 0), zero elsewhere; k's channels (j, head, channel)
    queries = q.new_zeros(batch, length, n, q.shape[-1])
    queries[:, :, -1] = q
    decays = log_decay.new_zeros(batch, length, n, value_heads)
    decays[:, :, 0] = log_decay
    inner = delta_rule_inputs(queries.flatten(1, 2), k.reshape(batch, length * n, -1), beta, decays.flatten(1, 2),
                              value_heads, key_dim, work_dtype)
    return DeltaProductCore(inner.q, inner.k, inner.beta, inner.log_decay, substeps=n)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (module docstring).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` (n·HV heads of P channels) and the mixer output
        recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    mask = call.attention_mask
    h = checked_input(call, formulation)
    batch, length, _ = h.shape
    n, value_heads, value_dim = mixer.num_householder, mixer.num_v_heads, mixer.head_v_dim
    heads = n * value_heads  # (j, h)
    q, k, value_pre, act_pre, v = qkv_projections(mixer, h, mask)
    with torch.no_grad():
        core = delta_product_core(mixer, h, q, k, work_dtype)
    per_head = lambda t: t.reshape(batch, length, heads, value_dim)  # noqa: E731
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    values = per_head(w(v))
    # the sub-steps' shares of o: the delta rule run with the values of sub-step j alone, read at (t, n − 1)
    expanded = values.double().reshape(batch, length * n, value_heads, value_dim)
    step = torch.arange(length * n, device=h.device) % n
    partial = torch.stack([delta_rule_output_chunked(core.q.double(), core.k.double(), core.beta.double(),
                                                     core.log_decay, expanded * (step == j)[:, None, None])[:, n - 1::n]
                           for j in range(n)], dim=2)  # (B, L, n, HV, P)
    output = partial.sum(2)  # o (B, L, HV, P)
    gate, norm = output_gate(mixer, h, mixer.use_output_gate, value_dim)
    nu = rms_scale(norm, output)
    scale = nu if gate is None else nu * gate  # ν ⊙ gate, (B, L, HV, P)
    rebuilt = run(mixer.o_proj, (scale * output).reshape(batch, length, -1).to(h.dtype))
    if mask is not None:
        rebuilt = rebuilt * mask.to(rebuilt.dtype)[:, :, None]
    readout_proj = linear_readout(mixer.o_proj)
    summed = lambda out: out.reshape(batch, length, n, value_heads, value_dim).sum(2)  # noqa: E731
    operator_mask = w(mask)
    common = dict(mask=operator_mask, heads=heads, head_dim=value_dim)
    if formulation == "hidden":  # the core's output per sub-step; the sum, the norm and the gate come after it
        def readout(out):
            o = summed(out)
            factor = rms_scale(norm, o) * (o if gate is None else gate * o)
            return readout_proj(factor.reshape(batch, length, -1))

        return HeadOperator(core, **common, values=values, output=w(partial.flatten(2, 3)), readout=readout), rebuilt
    tiled = lambda t: None if t is None else t.repeat(1, 1, n, 1)  # (B, L, HV, P) -> (B, L, n·HV, P)  # noqa: E731
    row = tiled(gate_norm_rows(components, w(gate), w(nu)))
    col = per_head(torch.sigmoid(w(act_pre))) if "act" in components else None
    if operator_mask is not None:
        mask_col = operator_mask[:, :, None, None].expand(batch, length, heads, value_dim)
        col = mask_col if col is None else col * mask_col
    conv = None
    if mixer.use_short_conv and "conv" in components:
        conv = w(mixer.v_conv1d.weight[:, 0, :]).reshape(heads, value_dim, -1)
    if row is None and col is None and conv is None:
        col = torch.ones(batch, length, heads, value_dim, dtype=work_dtype, device=h.device)
    operator = HeadOperator(core, **common, row_weight=row, col_weight=col, conv_weight=conv, s6="s6" in components,
                            values=per_head(w(value_pre)), output=w((tiled(scale) * partial.flatten(2, 3))),
                            readout=lambda out: readout_proj(summed(out).reshape(batch, length, -1)))
    return operator, rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_delta_net.delta_lrp` over the n sub-steps: the core α
    (q, the n keys and β per token, the forget gate) detached, the values' SiLU by the identity rule, ν detached, the
    gate by its rule). (B, L, D), float64."""
    mixer = call.located.module
    with torch.no_grad():
        h = checked_input(call, "lrp")
        q, k, *_ = qkv_projections(mixer, h, call.attention_mask)
        core = delta_product_core(mixer, h, q, k, work_dtype)
    return delta_lrp(call, work_dtype, core=core, gated=mixer.use_output_gate, heads=mixer.num_v_heads,
                     head_dim=mixer.head_v_dim, substeps=mixer.num_householder)
