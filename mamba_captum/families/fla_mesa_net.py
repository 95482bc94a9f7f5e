"""flash-linear-attention's MesaNet: ``MesaNet`` (model type ``mesa_net``).

Forward (fla 0.6.0, ``fla/layers/mesa_net.py``), h the layer input (fla packs the real tokens; see Pads): q, k =
silu(short conv(q_proj h)), silu(short conv(k_proj h)) (the convs are always there), v = v_proj h (no conv), H heads
of K channels; β = σ(b_proj h), the log decay g = logsigmoid(a_proj h), one per head and token, and
λ = softplus(lambda_params) + ``lambda_lower_bound`` (H, K), all three taken in float32 (``.float()``, also in a
float64 model); ``chunk_mesa_net`` with q, k L2-normalised in the kernel (eps 1e-6 inside the root)::

    H^kk_t = e^{g_t} H^kk_{t−1} + β_t k_t k_tᵀ,   H^kv_t = e^{g_t} H^kv_{t−1} + β_t k_t v_tᵀ,   o_t = H^kv_tᵀ q*_t

with q*_t ≈ (H^kk_t + diag(λ))^{−1} q_t from ``max_cg_step_training`` conjugate-gradient steps started at 0 (fla's
kernels; not the exact solve: :mod:`mamba_captum.kernels.mesa_net`); then the RMS norm over each head's channels
(with ``use_output_gate`` the gated norm with gate swish(g_proj h)), ``o_proj``.

q* depends on q, k, β, g and λ, not on v: o is linear in v. The rebuild recomputes q* with the same function as the
CPU op (:func:`~mamba_captum.kernels.mesa_net.mesa_query`, same steps, same dtype as the layer runs it).

hidden:  α_h[t, s] = e^{Γ_t − Γ_s} β_s k_sᵀ q*_t  (s ≤ t; Γ the cumulative g of head h): a gated linear core over
         (q*, β k) with one decay per head, scale 1, over v = v_proj h.
unified: H_c = diag(ν_c · swish(g_c)) · α_h · diag(m)   over the same v (no value conv), ν the norm's per-token scale
         (weight / rms over the head's channels, from the layer's own o), the gate factor 1 without an output gate.
q*, k, β and g come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.

Pads: fla unpads the batch (each sequence from zero states and a zero conv window). The rebuild runs the padded batch
with the pads' inputs zeroed: zero q and k at the pads (zeroed after the convs too, for a conv bias) write nothing
into H^kk or H^kv and read nothing, so the real tokens' q* and outputs are fla's, for left and right padding. Packed
sequences (``cu_seqlens``) and a cached prefix (decoding, whose CG starts elsewhere) are refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.dplr import l2_normalised
from ..kernels.gated_linear import gated_linear_chunked
from ..kernels.mesa_net import mesa_query
from ..operators import GatedLinearCore, masked_tokens
from .common import run
from .fla_delta_net import output_gate
from .fla_heads import head_lrp, head_operator, refuse_packed_or_cached, short_conv

MIXER_CLASSES = ("MesaNet",)
INNER_MIXERS = {"MesaNet": ("q_conv1d", "k_conv1d")}  # the query / key short convs: inside α


def _checked_input(call):
    """The layer's input h (B, L, D) with the pads zeroed, after refusing packed sequences and a cached prefix."""
    refuse_packed_or_cached(call)
    return masked_tokens(call.hidden_states, call.attention_mask)


def mesa_inputs(mixer, h, mask):
    """(q*, k, β, g) of the layer on its input h (B, L, D), pads zeroed by ``mask`` (B, L) or None: q* (B, L, H, K)
    from the CG steps in the layer's own work dtype (float32 at least), k (B, L, H, K) L2-normalised as the kernel
    uses it, β and g (B, L, H) in float32 (the layer's ``.float()``; float64 in a float64 model is not what fla
    computes)."""
    batch, length, _ = h.shape
    heads, dim = mixer.num_heads, mixer.head_k_dim
    q = masked_tokens(short_conv(mixer.q_conv1d, run(mixer.q_proj, h))[1], mask)
    k = masked_tokens(short_conv(mixer.k_conv1d, run(mixer.k_proj, h))[1], mask)
    q, k = (l2_normalised(x.reshape(batch, length, heads, dim)) for x in (q, k))
    beta = torch.sigmoid(run(mixer.b_proj, h).float())
    log_decay = F.logsigmoid(run(mixer.a_proj, h).float())
    lamb = (F.softplus(mixer.lambda_params.float()) + mixer.lambda_lower_bound).reshape(heads, -1)
    q_star = mesa_query(q, k, log_decay, beta, lamb, mixer.max_cg_step_training)
    return q_star, k, beta, log_decay


def _core(mixer, h, mask, work_dtype) -> GatedLinearCore:
    """The detached core of the layer from h (B, L, D): a gated linear core over (q*, β k), one decay per head,
    scale 1 (module docstring)."""
    with torch.no_grad():
        q_star, k, beta, log_decay = mesa_inputs(mixer, h, mask)
        written = beta.to(k.dtype)[..., None] * k
        return GatedLinearCore(q_star.to(work_dtype), written.to(work_dtype), log_decay.double(), 1.0)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_heads.head_lrp`), a differentiable function of
    ``call.hidden_states``: v_proj linear (its bias a constant), the core α (q* from the CG solve, k, β, the decays)
    detached, the norm's ν detached, the gate swish(g_proj h) (with ``use_output_gate``) by the identity and half
    rules. (B, L, D), float64."""
    mixer, mask = call.located.module, call.attention_mask
    h = _checked_input(call)
    batch, length, _ = h.shape
    core = _core(mixer, h, mask, work_dtype)
    values = masked_tokens(run(mixer.v_proj, h).to(work_dtype), mask).reshape(batch, length, mixer.num_heads, -1)
    gate_input = run(mixer.g_proj, h) if mixer.use_output_gate else None
    activation = getattr(mixer.o_norm, "activation", "swish") if mixer.use_output_gate else None
    return head_lrp(call, work_dtype, core=core, values=values, gate_input=gate_input, gate_activation=activation,
                    norm=mixer.o_norm, out_proj=mixer.o_proj, heads=mixer.num_heads, head_dim=mixer.head_v_dim)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (module docstring).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    h = _checked_input(call)
    batch, length, _ = h.shape
    heads, dim = mixer.num_heads, mixer.head_v_dim
    core = _core(mixer, h, call.attention_mask, work_dtype)
    values = run(mixer.v_proj, h).reshape(batch, length, heads, dim).to(work_dtype)
    output, _ = gated_linear_chunked(core.q.double(), core.k.double(), values.double(), core.log_decay, scale=1.0)
    gate, norm = output_gate(mixer, h, mixer.use_output_gate, dim)
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=dim,
                         values=values, output=output, gate=gate, norm=norm, out_proj=mixer.o_proj)
