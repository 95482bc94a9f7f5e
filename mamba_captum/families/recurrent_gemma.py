"""Griffin / RecurrentGemma: RecurrentGemmaRecurrentBlock (conv + RG-LRU); its local attention layers are softmax
layers (:mod:`.softmax`).

Forward (transformers 5.23, ``RecurrentGemmaRecurrentBlock.forward`` and ``RecurrentGemmaRglru.forward``):
``y = gelu(linear_y(h))``; ``x = linear_x(h)``; ``c = conv_1d(x)`` (depthwise, causal, with bias); per head,
input gate ``i = σ(c W_i + b_i)`` and recurrent gate ``ρ = σ(c W_ρ + b_ρ)``; ``log a = −8 ρ softplus(Λ)``;
``mult = √(1 − a²)``, 1 where ``position_ids == 0``; ``s_t = a_t s_{t−1} + mult_t i_t c_t`` with the state reset
(a = 0) where ``position_ids == 0``; ``out = linear_out(s · y)``. The block ignores ``attention_mask``.

hidden:  α_c[t, j] = Π_{k=j+1..t} a_{k,c} · mult_{j,c} · i_{j,c}, 0 across a reset          over c (conv output).
unified: H_c = diag(y_c) · α_c · M_c (Zimerman et al., Eq. 17; M the bias-free conv)         over x (conv input).

Upstream HF applies the √(1 − a²) multiplier (the UIA fork switches it off); we follow HF. The conv bias enters
the output as y · α · b, a part that comes from no token: it is added back by the readout, like Mamba's D skip.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..kernels.scans import reset_decay_scan
from ..operators import DecayOperator
from ..rules import half_product, identity_rule
from .common import linear_readout, run

MIXER_CLASSES = ("RecurrentGemmaRecurrentBlock",)
IGNORES_ATTENTION_MASK = True


def segments_from_positions(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """(B, L) segment ids: a new segment starts at every ``position_ids == 0`` (where RG-LRU resets its state)."""
    reset = (position_ids == 0).expand(batch, length)
    return reset.long().cumsum(1)


def gates(lru, conv_out: torch.Tensor):
    """Input gate i and recurrent gate ρ of RecurrentGemmaRglru, per head (block-diagonal weights), float64."""
    batch, length, width = conv_out.shape
    heads = lru.num_attention_heads
    per_head = conv_out.double().reshape(batch, length, heads, lru.block_width)
    gate = lambda weight, bias: torch.sigmoid(  # noqa: E731
        torch.einsum("blhi,hij->blhj", per_head, weight.double()) + bias.double()).reshape(batch, length, width)
    return gate(lru.input_gate_weight, lru.input_gate_bias), gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)


def _recorded(call):
    """(the recurrent block, its input, the position_ids it was called with, which reset its state)."""
    position_ids = call.options.get("position_ids")
    if position_ids is None:
        raise RuntimeError(f"mamba_captum: {call.located.name} was called without position_ids.")
    return call.located.module, call.hidden_states, position_ids


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (and ``position_ids``).

    Returns:
        (operator, rebuilt_output): the :class:`DecayOperator` and the mixer output recomputed from it, (B, L, D_model).
    """
    block, hidden, position_ids = _recorded(call)
    batch, length, _ = hidden.shape
    lru, conv = block.rg_lru, block.conv_1d
    y_branch = run(block.act_fn, run(block.linear_y, hidden))
    x = run(block.linear_x, hidden)
    taps = conv.weight[:, 0, :]  # (W, K)
    conv_out = F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=taps.shape[1] - 1,
                        groups=taps.shape[0])[..., :length].transpose(1, 2)

    w = lambda t: t.to(work_dtype)  # noqa: E731
    input_gate, recurrent_gate = gates(lru, conv_out)
    log_a = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param.double())
    segments = segments_from_positions(position_ids.to(hidden.device), batch, length)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
    multiplier = torch.where((position_ids.to(hidden.device) == 0).expand(batch, length)[..., None],
                             torch.ones_like(multiplier), multiplier)
    col = w(multiplier * input_gate)
    log_decay = w(-log_a)
    gate = w(y_branch)
    common = dict(log_decay=log_decay, log_q=None, log_k=None, log_diag=None, segments=segments,
                  mask=None if call.attention_mask is None else w(call.attention_mask), s6="s6" in components,
                  decay_source="rg_lru.recurrent_param (with the recurrence gate)")

    scan = reset_decay_scan(w(conv_out), log_decay, col_weight=col, segments=segments)  # RG-LRU output
    rebuilt = run(block.linear_out, (scan * gate).to(hidden.dtype))
    linear_out = linear_readout(block.linear_out)
    gate64 = gate.double()
    if formulation == "hidden":  # over the conv output c; the gelu branch comes after
        operator = DecayOperator(**common, col_weight=col, values=w(conv_out), output=scan,
                                 readout=lambda y: linear_out(y * gate64))
        return operator, rebuilt
    # unified: over x; the conv bias' share y · α b comes from no token and is added back by the readout
    conv_bias = torch.zeros_like(col) if conv.bias is None else w(conv.bias).expand_as(col)
    bias_share = reset_decay_scan(conv_bias, log_decay, col_weight=col, segments=segments) * gate64
    operator = DecayOperator(
        **common,
        row_weight=gate if "gate" in components else None,
        col_weight=col if "s6" in components else None,
        conv_weight=w(taps) if "conv" in components else None,
        values=w(x), output=scan * gate64 - bias_share,
        readout=lambda y: linear_out(y + bias_share),
    )
    return operator, rebuilt


@contextlib.contextmanager
def preserved_states(model):
    """Restore the recurrent blocks' cached states (``conv1d_state``, ``rg_lru.recurrent_states``), which every
    RecurrentGemma forward overwrites (``use_cache=False`` sets them to None), on every exit path."""
    blocks = [m for m in model.modules() if type(m).__name__ in MIXER_CLASSES]
    saved = [(block.conv1d_state, block.rg_lru.recurrent_states) for block in blocks]
    try:
        yield
    finally:
        for block, (conv_state, recurrent_states) in zip(blocks, saved):
            block.conv1d_state, block.rg_lru.recurrent_states = conv_state, recurrent_states


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The recurrent block's output under MambaLRP-style rules, a differentiable function of ``call.hidden_states``:
    the conv (linear, its bias a constant); the RG-LRU's gates (a_t, i_t and √(1 − a_t²), computed from the real
    conv output) detached, so the recurrence is linear in the conv output; the GELU branch by the identity rule;
    ``scan ⊙ gelu(linear_y(h))`` by the half rule. The projections' and conv's biases are its constant terms.
    (B, L, D_model), float64."""
    block, hidden, position_ids = _recorded(call)
    batch, length, _ = hidden.shape
    lru, conv = block.rg_lru, block.conv_1d
    y_pre = run(block.linear_y, hidden).double()
    with torch.no_grad():
        y_act = run(block.act_fn, y_pre)
    y_branch = identity_rule(y_pre, y_act)
    x = run(block.linear_x, hidden).double()
    conv_out = F.conv1d(x.transpose(1, 2), conv.weight.double(), None if conv.bias is None else conv.bias.double(),
                        padding=conv.weight.shape[-1] - 1, groups=conv.weight.shape[0])[..., :length].transpose(1, 2)
    with torch.no_grad():
        input_gate, recurrent_gate = gates(lru, conv_out)
        log_a = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param.double())
        reset = (position_ids.to(hidden.device) == 0).expand(batch, length)[..., None]
        multiplier = torch.where(reset, torch.ones_like(log_a), torch.sqrt(1 - torch.exp(2 * log_a)))
        segments = segments_from_positions(position_ids.to(hidden.device), batch, length)
    scan = reset_decay_scan(conv_out, -log_a, col_weight=multiplier * input_gate, segments=segments)
    return linear_readout(block.linear_out)(half_product(scan, y_branch))


preserved_state = preserved_states  # the adapter contract's name (mamba_captum.families.registry.Adapter)
