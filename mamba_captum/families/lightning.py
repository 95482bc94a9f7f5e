"""MiniMax lightning attention: MiniMaxLightningAttention (minimax); its other layers are softmax layers.

Forward (transformers 5.23, ``MiniMaxLightningAttention.forward``): ``q, k, v = silu(qkv_proj h)·m`` (per head
``[q | k | v]``, pads zeroed after the activation); per head, with the layer's fixed slope λ_h (``slope_rate``),
``o_t = Σ_{s≤t} exp(−λ_h (t − s)) (q_t · k_s) v_s`` (computed block by block; the blocks do not change it);
``out = out_proj(σ(output_gate h) ⊙ ν ⊙ o)`` with ν the RMS norm's scale over all heads' channels (× its weight).

hidden:  α_h[t, s] = (q_t · k_s) · exp(−λ_h (t − s))                                    over v (after silu).
unified: H_c = diag(σ(g_c) · ν_c) · α_h · diag(σ(pre_c) · m)                           over v before the silu
         (pre: qkv_proj's value channels; silu(pre) = σ(pre) · pre), ν computed from the real activations.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import GatedScoresCore, HeadOperator, gate_norm_rows
from ..rules import sigmoid_gate, silu_rule
from .gated_deltanet import core_output
from .common import linear_readout, run

MIXER_CLASSES = ("MiniMaxLightningAttention",)


def _rms_scale(norm, output):
    """ν (B, L, H·d): the RMS norm's scale over all heads' channels, times its weight."""
    return norm.weight.to(output.dtype) * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


def _projected(call, work_dtype: torch.dtype, why: str):
    """(mixer, qkv_proj's output (B, L, H, 3d) in ``work_dtype``, the token mask (B, L, 1, 1)): what
    :func:`rebuild` and :func:`lrp` both start from; the mixer is refused unless its activation is SiLU."""
    mixer = call.located.module
    if type(mixer.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.act_fn!r}; {why}.")
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, _ = hidden.shape
    pre = run(mixer.qkv_proj, hidden).to(work_dtype).reshape(batch, length, mixer.num_attention_heads,
                                                              3 * mixer.head_dim)
    token_mask = torch.ones(batch, length, 1, 1, dtype=work_dtype, device=hidden.device) if mask is None \
        else mask.to(work_dtype)[:, :, None, None]
    return mixer, pre, token_mask


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed, (B, L, D).
    """
    mixer, pre, token_mask = _projected(call, work_dtype, "the unified operator is defined for silu")
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, _ = hidden.shape
    heads, head_dim = mixer.num_attention_heads, mixer.head_dim
    w = lambda t: t.to(work_dtype)  # noqa: E731
    q, k, v = (F.silu(pre) * token_mask).split(head_dim, dim=-1)  # (B, L, H, d) each
    slopes = mixer.slope_rate.reshape(heads).double()
    positions = torch.arange(length, dtype=torch.float64, device=hidden.device)
    core = GatedScoresCore(q, k, (-slopes[None, None, :] * positions[None, :, None]).expand(batch, length, heads))
    output = torch.einsum("bhts,bshd->bthd", core.full(), v)  # (B, L, H, d): the lightning attention
    flat = output.reshape(batch, length, heads * head_dim)
    nu = _rms_scale(mixer.norm, flat).reshape(batch, length, heads, head_dim)
    gate = torch.sigmoid(w(run(mixer.output_gate, hidden))).reshape(batch, length, heads, head_dim)
    rebuilt = run(mixer.out_proj, (gate * nu * output).reshape(batch, length, -1).to(hidden.dtype))
    out_proj = linear_readout(mixer.out_proj)
    common = dict(mask=None if mask is None else w(mask), heads=heads, head_dim=head_dim)
    if formulation == "hidden":  # the operator's output is the attention's; norm and gate come after it
        gate64 = gate.double()

        def readout(out):
            flat_out = out.reshape(batch, length, -1)
            return out_proj(gate64.reshape(batch, length, -1) * _rms_scale(mixer.norm, flat_out) * flat_out)

        return HeadOperator(core, **common, values=v, output=output, readout=readout), rebuilt
    row = gate_norm_rows(components, gate, nu)
    col = torch.sigmoid(pre[..., 2 * head_dim:]) * token_mask if "act" in components else token_mask.expand_as(v)
    operator = HeadOperator(core, **common, row_weight=row, col_weight=col, s6="s6" in components,
                            values=pre[..., 2 * head_dim:], output=gate * nu * output,
                            readout=lambda out: out_proj(out.reshape(batch, length, -1)))
    return operator, rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP-style rules: the values' SiLU by the identity rule, the core
    ``(q_t · k_s) exp(−λ (t − s))`` (q, k from the real activations) detached, the RMS norm's normaliser detached,
    the output gate ``σ(g) ⊙ ·`` by :func:`mamba_captum.rules.sigmoid_gate`. (B, L, D), float64."""
    mixer, pre, token_mask = _projected(call, work_dtype, "MambaLRP's rules are written for silu")
    hidden = call.hidden_states
    batch, length, _ = hidden.shape
    heads, head_dim = mixer.num_attention_heads, mixer.head_dim
    with torch.no_grad():
        q, k, _ = (F.silu(pre) * token_mask).split(head_dim, dim=-1)
        slopes = mixer.slope_rate.reshape(heads).double()
        positions = torch.arange(length, dtype=torch.float64, device=hidden.device)
        core = GatedScoresCore(q, k, (-slopes[None, None, :] * positions[None, :, None]).expand(batch, length, heads))
    v = silu_rule(pre[..., 2 * head_dim:]) * token_mask
    output = core_output(core, v)
    nu = _rms_scale(mixer.norm, output.detach().reshape(batch, length, -1)).reshape(batch, length, heads, head_dim)
    gate_pre = run(mixer.output_gate, hidden).to(work_dtype).reshape(batch, length, heads, head_dim)
    return linear_readout(mixer.out_proj)((nu * sigmoid_gate(gate_pre, output)).reshape(batch, length, -1).double())
