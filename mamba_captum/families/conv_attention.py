"""Softmax attention with a causal band on the values: ZAYA's CCA attention (``ZayaAttention``, model type zaya).
Inkling's attention, whose values are convolved too, is in :mod:`.inkling` and :mod:`.inkling2`.

ZAYA (transformers 5.23, ``ZayaCCAProjection.forward``): the mixer input h is masked (h ⊙ m), q and k go through
two causal convolutions, norms and RoPE (all inside the probabilities, which are rebuilt from the query and key
handed to the attention interface, :mod:`.softmax`). The value has no learned conv: ``cat(v_proj_current(h),
v_proj_delayed(h))`` viewed into key/value heads, the second half of the channels (the last n_kv/2 heads)
shifted back one token, so the value at token j is ``[W_c h_j ; W_d h_{j−1}]``; token 0 takes ``v_proj_delayed(0)``
(its bias) on those channels. Per value channel c of query head h::

    H_c = P_h · M_c        over x = cat(v_proj_current(h ⊙ m), v_proj_delayed(h ⊙ m))  (the values before the shift)

with M_c the identity on "current" channels and the one-token shift on "delayed" ones: a :class:`HeadOperator`
with the core P (a :class:`DenseCore`) and two-tap conv weights (0, 1) / (1, 0). Key/value heads are repeated for
the query heads. The readout is ``o_proj``; what comes from no real token (the shifted-in bias at token 0 and,
with ``attention_bias``, the pads' values, which are that bias) is added back there.

formulation "hidden": P alone over the value the attention interface received (after the shift), one map per
head. Components of "unified": "s6" the core P (off: the band alone), "conv" the shift (off: P over the unshifted
values, an ablation).
"""
from __future__ import annotations

import torch

from ..operators import DenseCore, HeadOperator, masked_tokens
from .common import linear_readout, run

MIXER_CLASSES = ("ZayaAttention",)
# the adapter takes the layer's recorded attention-interface call (its probabilities) and explains the whole layer
CONSUMES_ATTENTION = MIXER_CLASSES


def _shift_taps(projection, heads: int, head_dim: int, dtype, device) -> torch.Tensor:
    """(Hkv, d, 2) taps of the value band: (0, 1) (this token) on the current half of the channels, (1, 0) (the
    token before) on the delayed half; taps[..., K−1] weighs the token itself."""
    current = projection.v_proj_current.out_features
    taps = torch.zeros(heads * head_dim, 2, dtype=dtype, device=device)
    taps[:current, 1] = 1.0
    taps[current:, 0] = 1.0
    return taps.view(heads, head_dim, 2)


def _band(values: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """The causal band of values (B, L, H, d) with taps (H, d, K) (zero before the first token)."""
    out = values * taps[..., -1]
    for lag in range(1, taps.shape[-1]):
        shifted = torch.zeros_like(values)
        shifted[:, lag:] = values[:, :-lag]
        out = out + shifted * taps[..., -1 - lag]
    return out


def _attend(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """P_h v over query heads: probs (B, Hq, L, L), values (B, L, Hq, d) -> (B, L, Hq, d)."""
    return (probs @ values.transpose(1, 2)).transpose(1, 2)


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype, attention=None):
    """Rebuild the layer's operator from its recorded input and its attention call's probabilities.

    Args:
        attention: the :class:`SoftmaxOperator` rebuilt from the layer's attention-interface call (probabilities
            (B, Hq, L, L) from the recorded query and key).
    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output (o_proj's) recomputed, (B, L, D).
    """
    module = call.located.module
    projection = module.qkv_proj
    hidden, mask = call.hidden_states, call.attention_mask
    batch, length, _ = hidden.shape
    heads, head_dim = module.num_attention_heads, module.head_dim
    kv_heads, groups = module.num_key_value_heads, module.num_key_value_groups
    probs = attention.probs.to(work_dtype)
    repeat = lambda t: t.repeat_interleave(groups, dim=2)  # noqa: E731  (B, L, Hkv, ...) -> (B, L, Hq, ...)

    # The value path as ZayaCCAProjection computes it, from the recorded (unmasked) mixer input: the values before
    # the shift, the real tokens' (x) and the rest (the pads' values: 0, or the projections' bias with
    # attention_bias; the bias shifted in at token 0).
    masked = masked_tokens(hidden, mask)
    current = run(projection.v_proj_current, masked)
    delayed = run(projection.v_proj_delayed, masked)
    first = run(projection.v_proj_delayed, masked.new_zeros(batch, 1, masked.shape[-1]))  # shifted in at token 0
    pre = torch.cat([current, delayed], dim=-1).view(batch, length, kv_heads, head_dim).to(work_dtype)
    real = torch.ones(batch, length, 1, 1, dtype=work_dtype, device=hidden.device) if mask is None \
        else mask[:, :, None, None].to(work_dtype)
    shift = _shift_taps(projection, kv_heads, head_dim, work_dtype, hidden.device)
    rest = _band(pre * (1 - real), shift).reshape(batch, length, kv_heads * head_dim)
    rest[:, 0, current.shape[-1]:] += first[:, 0].to(work_dtype)
    rest = rest.view(batch, length, kv_heads, head_dim)
    x = repeat(pre * real)
    taps = shift.repeat_interleave(groups, dim=0)  # (Hq, d, 2)
    token_part = _attend(probs, _band(x, taps))  # H x
    constant = _attend(probs, repeat(rest))  # what no real token gives (0 without attention_bias)
    rebuilt = run(module.o_proj, (token_part + constant).reshape(batch, length, heads * head_dim)
                  .to(module.o_proj.weight.dtype))

    unified = formulation == "unified"
    values, output = x, token_part
    if not unified:  # P alone over the value the interface received (after the shift)
        values, taps, constant = attention.values.transpose(1, 2).to(work_dtype), None, None
        output = _attend(probs, values)
    else:
        if "conv" not in components:
            taps = None
        if "s6" not in components or taps is None:  # an ablation: its own output (the readout is linear)
            output = _attend(probs, values) if taps is None else _band(values, taps)
    o_proj = linear_readout(module.o_proj)

    def readout(out):
        out = out if constant is None else out + constant.to(out.dtype)
        return o_proj(out.reshape(batch, length, heads * head_dim))

    operator = HeadOperator(DenseCore(probs), mask=None if mask is None else mask.to(work_dtype), heads=heads,
                            head_dim=head_dim, conv_weight=taps, s6=not unified or "s6" in components,
                            values=values, output=output, readout=readout)
    return operator, rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The layer's output under MambaLRP's rules, a differentiable function of ``call.hidden_states``: the layer's own
    forward re-run on it, whose value path (the pad mask, ``v_proj_current`` / ``v_proj_delayed``, the one-token shift
    of the delayed half, o_proj) is linear, with HF's attention interface answered by the engine's softmax rule P̄ v
    (:mod:`mamba_captum.lrp_forward`: P from the detached queries and keys). The queries' and keys' convolutions,
    norms and RoPE only reach P, so they take no relevance. The shifted-in bias at token 0 and the projections'
    biases are its constant terms. Needs the layer's own keywords (``call.options``: its mask dict, its position
    embeddings), as MambaLRP's engine records them. (B, L, D_model), in the model's dtype."""
    module = call.located.module
    options = dict(call.options)
    if options.get("cache") is not None:
        raise NotImplementedError("mamba_captum: MambaLRP explains whole sequences: call ZAYA with use_cache=False "
                                  "(its rule re-runs the layer, which would write the cache twice).")
    if "attention_mask" not in options:
        raise ValueError("mamba_captum: ZAYA's MambaLRP rule needs the layer's attention_mask mapping as it got it.")
    output, _ = type(module).forward(module, call.hidden_states, **options)  # without the layer's hooks
    return output.to(work_dtype)
