"""flash-linear-attention's linear attention: ``LinearAttention`` (model type ``linear_attn``).

Forward (fla 0.6.0, ``fla/layers/linear_attn.py``): q, k, v = the projections of h (no conv); key / value heads
repeated for ``num_kv_heads``; the feature maps φ_q, φ_k (``elementwise_product`` (Hadamard), ``hedgehog``, ``t2r``,
``dpfp``, ``elu`` (elu + 1), ``relu``, ``identity``: functions of one token's q or k alone); optionally
q ← q / (Σ q + 1e-4), k ← k / (Σ k + 1e-4) (``norm_q``, ``norm_k``); ``o = linear_attn(q, k, v)``:
S_t = S_{t−1} + k_t v_tᵀ, o_t = scale · S_tᵀ q_t (scale = K'^−½, K' the feature dim), with ``normalize``
(``norm_feature_map``) divided by the per-row normaliser z_t = scale · q_t · Σ_{s≤t} k_s + 1e-10 — a scale of row t
computed from the queries and keys alone, so o stays linear in v; then the RMS norm over each head's value channels
(or none, ``output_norm='identity'``), ``o_proj``.

hidden:  α_h[t, s] = scale · (q_t · k_s) / z_t  (s ≤ t; z_t = 1 without ``normalize``)  over v.
unified: H_c = diag(ν_c) · α_h · diag(m)  over v (ν_c the norm's weight / rms of the head's o, from the real
         activations; 1 without a norm).
q, k and z come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.gated_linear import gated_linear_chunked
from ..operators import GatedLinearCore, masked_tokens
from .common import run
from .fla_heads import head_lrp, head_operator
from .fla_hgrn2 import refuse_packed

MIXER_CLASSES = ("LinearAttention",)
NORMALIZER_EPS = 1e-10  # fla.ops.linear_attn: added to the normaliser q_t · Σ k_s


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight.double(), None if layer.bias is None else layer.bias.double())


def feature_map(function, x: torch.Tensor) -> torch.Tensor:
    """One of fla's feature maps on x (B, L, H, K), in float64. Its parameter-free modules (DPFP, ReLU, identity) run
    as they are; those with linear layers (Hadamard, Hedgehog, T2R) from their weights in float64 (no hooks fire);
    fla's ``elu_p1`` (a Triton function) is elu + 1."""
    x = x.double()
    if getattr(function, "__name__", "") == "elu_p1":
        return F.elu(x) + 1
    name = type(function).__name__
    if isinstance(function, nn.Module) and not any(True for _ in function.parameters()):
        return run(function, x)
    if name == "HadamardFeatureMap":
        return _linear(function.layer1, x) * _linear(function.layer2, x)
    if name == "HedgehogFeatureMap":
        y = 2 * _linear(function.layer, x)
        return torch.cat([y, -y], dim=-1).softmax(-1)
    if name == "T2RFeatureMap":
        return _linear(function.layer, x).relu()
    raise NotImplementedError(f"mamba_captum: fla's linear attention with the feature map {function!r}.")


def _core(mixer, h: torch.Tensor, mask: torch.Tensor | None, work_dtype: torch.dtype) -> GatedLinearCore:
    """The detached core of the layer's op from h (B, L, D): q, k (key heads repeated) through the feature maps and
    the optional sum normalisations, the pads' keys zeroed (fla drops pads; a feature map gives a zero token a
    nonzero key), with ``normalize`` the row normaliser z_t dividing the query: α[t, s] = scale q_t·k_s / z_t."""
    batch, length, _ = h.shape
    key_dim = mixer.head_k_dim
    with torch.no_grad():
        q = run(mixer.q_proj, h).reshape(batch, length, mixer.num_heads, key_dim)
        k = run(mixer.k_proj, h).reshape(batch, length, -1, key_dim).repeat_interleave(mixer.num_kv_groups, dim=2)
        q, k = feature_map(mixer.feature_map_q, q), feature_map(mixer.feature_map_k, k)
        if mixer.norm_q:
            q = q / (q.sum(-1, True) + 1e-4)
        if mixer.norm_k:
            k = k / (k.sum(-1, True) + 1e-4)
        k = masked_tokens(k.flatten(2), mask).reshape(k.shape)
        scale = q.shape[-1] ** -0.5
        if mixer.do_feature_map_norm:
            q = q / (scale * (q * k.cumsum(1)).sum(-1, keepdim=True) + NORMALIZER_EPS)
        return GatedLinearCore(q.to(work_dtype), k.to(work_dtype), None, scale)


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules (:func:`.fla_heads.head_lrp`), a differentiable function of
    ``call.hidden_states``: v_proj linear (its bias a constant), the core α (the feature-mapped q, k and the
    normaliser) detached, the norm's ν detached; the pads' outputs o_proj(0), as fla repads o before its norm and
    o_proj. (B, L, D), float64."""
    mixer, mask = call.located.module, call.attention_mask
    refuse_packed(call, "LinearAttention")
    h = masked_tokens(call.hidden_states, mask)
    batch, length, _ = h.shape
    core = _core(mixer, h, mask, work_dtype)
    values = masked_tokens(run(mixer.v_proj, h).to(work_dtype), mask).reshape(batch, length, -1, mixer.head_v_dim)
    norm = None if isinstance(mixer.norm, nn.Identity) else mixer.norm
    return head_lrp(call, work_dtype, core=core, values=values.repeat_interleave(mixer.num_kv_groups, dim=2),
                    gate_input=None, gate_activation=None, norm=norm, out_proj=mixer.o_proj, heads=mixer.num_heads,
                    head_dim=mixer.head_v_dim, zero_pads=False)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    refuse_packed(call, "LinearAttention")
    mask = call.attention_mask
    h = masked_tokens(call.hidden_states, mask)
    batch, length, _ = h.shape
    heads, value_dim, groups = mixer.num_heads, mixer.head_v_dim, mixer.num_kv_groups
    v = run(mixer.v_proj, h).reshape(batch, length, -1, value_dim).repeat_interleave(groups, dim=2)
    core = _core(mixer, h, mask, work_dtype)
    values = v.to(work_dtype)
    output, _ = gated_linear_chunked(core.q.double(), core.k.double(), values.double(), None, scale=core.scale)
    norm = None if isinstance(mixer.norm, nn.Identity) else mixer.norm
    return head_operator(call, formulation, components, work_dtype, core=core, heads=heads, head_dim=value_dim,
                         values=values, output=output, gate=None, norm=norm, out_proj=mixer.o_proj,
                         zero_pads=False)
