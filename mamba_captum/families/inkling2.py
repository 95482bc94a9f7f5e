"""Inkling2 (model type inkling2_text): Inkling's layout (:mod:`.inkling`) with gated attention, sink logits,
RMS-normalised values, dynamic value convolutions in the full-attention layers, scaled short convolutions and
attention residuals over depth.

Decoder layer (transformers 5.23, ``Inkling2SlidingDecoderLayer`` / ``Inkling2FullDecoderLayer``), with the
scaled short convolution ``S(x) = (x + conv(m ⊙ x)) / √(K+1)`` (``Inkling2ShortConvolution``, float32)::

    a  = post_attention_convolution(o_proj(σ(gate_proj h') ⊙ Attn(q, k, v)))
    r  = a (at an attention-residual block boundary) or h + a
    out = r + post_mlp_convolution(mlp(norm(depth_attention(blocks, r))))

where h' are the (per-token) depth-attention mixes of earlier blocks' states, normalised (the full layers give the
query, key and value their own), and the depth attention mixes layers, not tokens. The values::

    sliding: v = ν ⊙ (x + conv(m ⊙ x)) / √(K+1)                x = v_proj(h')
    full:    v = ν ⊙ (x_t + Σ_τ w_{t,τ} m_{t−τ} x_{t−τ}) / √(2K+1)   x = v_proj(h'_v)

with the full layers' taps ``w_{t,τ} = static_weight[τ] + weight_proj(h'_v)_{t, kv head, τ}`` (per row: the output
token t has its own taps, a band that is still linear in x), and ``ν = 1 / √(mean_head(v̂²) + ε)`` the unweighted
RMS norm of each key/value head's convolved value v̂. ν depends on the values themselves; as for every norm of the
library (the gated norms of Mamba-2 and the delta rule, mLSTM's layer norm), its scale is fixed at its real value
(detached), so ``y = H x`` holds exactly at the explained input and ν is a diagonal factor on the value side.

Per query-head channel c = (h, p), the attention's operator is ``A_c = diag(σ(gate)_c) · P_h · diag(ν) · V_c`` over
x (P_h rebuilt from the interface call: sink logits, relative position logits and the full layers' log-scaled
query included; q and k, their L2 clips and k's convolution are inside P, detached), composed, as in Inkling, with
post_attention_convolution's band ``T_d`` on o_proj's output channel d (no residual between them), and the MLP
branch is post_mlp_convolution's band under ``"{i}.post_mlp_convolution"``.

formulation "hidden": the probabilities alone over the value the interface received, composed with the post-
attention band. Components of "unified": "s6" the probabilities, "conv" the convolutions' taps (off: their scaled
skips), "gate" σ(gate), "norm" ν.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from ..operators import skip_taps
from . import inkling
from .unhooked import linear_readout, run

CONV_CLASS = "Inkling2ShortConvolution"
ATTENTION_CLASSES = ("Inkling2SlidingAttention", "Inkling2FullAttention")
MIXER_CLASSES = (*ATTENTION_CLASSES, CONV_CLASS)
# why MambaLRP has no rules for this family (mamba_captum.families.layers.lrp_plan names it)
LRP_UNSUPPORTED = ("its convolutions (some with token-dependent taps) and data-dependent sink / relative "
                   "logits have no rules written yet")
CONSUMES_ATTENTION = ATTENTION_CLASSES
INNER_MIXERS = {name: ("k_sconv", "v_sconv") for name in ATTENTION_CLASSES}
BRANCH_CONVOLUTIONS = {"post_attention_convolution": "self_attn", "post_mlp_convolution": None}
follows = partial(inkling.follows, places=BRANCH_CONVOLUTIONS, classes=(CONV_CLASS,))


def _value_taps(module, value_input, work_dtype):
    """(x, taps, scale): the value projection (B, L, Hkv, d) and the value convolution's taps with its skip, scale
    included: static (Hkv, d, K) in the sliding layers, per row (B, L, Hkv, d, K) in the full ones."""
    kv_heads, head_dim = module.num_key_value_heads, module.head_dim
    batch, length, _ = value_input.shape
    x = run(module.v_proj, value_input).to(work_dtype).view(batch, length, kv_heads, head_dim)
    conv = module.v_sconv
    if type(conv).__name__ == "Inkling2DynamicShortConvolution":
        width = conv.conv_kernel_size
        scale = 1.0 / math.sqrt(2 * width + 1)
        dynamic = run(conv.weight_proj, value_input).to(work_dtype).view(batch, length, kv_heads, 1, width)
        static = conv.static_weight.to(work_dtype).T.reshape(kv_heads, head_dim, width)
        by_lag = static + dynamic  # (B, L, Hkv, d, K): [..., τ] weighs the token τ back
        return x, skip_taps(by_lag.flip(-1), scale), scale
    width = conv.conv_kernel_size
    scale = 1.0 / math.sqrt(width + 1)
    taps = skip_taps(conv.conv1d.weight[:, 0, :].to(work_dtype), scale).view(kv_heads, head_dim, width)
    return x, taps, scale


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype, attention=None):
    """Rebuild one of the layer's mixers from its recorded input (and, for the attention, its interface call).

    Returns:
        (operator, rebuilt_output): for the attention a :class:`HeadOperator` (o_proj's output, (B, L, D)), which
        the engine composes with post_attention_convolution's band; for a branch convolution its band operator.
    """
    module = call.located.module
    if type(module).__name__ == CONV_CLASS:
        return inkling.branch_conv(call, components, work_dtype, scale=1.0 / math.sqrt(module.conv_kernel_size + 1))
    hidden = call.hidden_states
    batch, length, _ = hidden.shape
    value_input = call.options.get("value_hidden_states", hidden)  # the full layers' own value input
    x, taps, scale = _value_taps(module, value_input, work_dtype)
    gate = torch.sigmoid(run(module.gate_proj, hidden).to(work_dtype)).view(batch, length, module.num_heads,
                                                                             module.head_dim)
    eps = module.v_norm.eps

    def norm(values):  # Inkling2UnweightedRMSNorm's scale, per token and key/value head
        return torch.rsqrt(values.square().mean(-1, keepdim=True) + eps)

    operator, attended = inkling.attention_operator(
        call, formulation, components, work_dtype, attention, x=x, taps=taps, scale=scale,
        mask=inkling.conv_mask(call, work_dtype), readout_proj=linear_readout(module.o_proj), gate=gate, norm=norm)
    rebuilt = run(module.o_proj, attended.reshape(batch, length, -1).to(module.o_proj.weight.dtype))
    return operator, rebuilt
