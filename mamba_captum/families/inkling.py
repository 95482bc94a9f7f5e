"""Inkling (model types inkling_text, and the language model of inkling_mm_model): softmax attention whose keys and
values are convolved, and short convolutions on both residual branches.

Decoder layer (transformers 5.23 and 5.24, ``InklingDecoderLayer.forward``), with ``S(x) = x + conv(m ⊙ x)``
(``InklingShortConvolution``: depthwise causal conv of K taps, no bias, computed in float32; m the 2-D padding
mask ``conv_mask``, None without padding)::

    h1 = h + attn_sconv(o_proj(Attn(q, k_sconv(k_proj h'), v_sconv(v_proj h'))))     h' = input_layernorm(h)
    h2 = h1 + mlp_sconv(mlp(post_attention_layernorm(h1)))

Two token mixers per decoder layer, in this order:

- **The attention branch** ``attn_sconv ∘ o_proj ∘ Attn``: no residual between the attention and ``attn_sconv``, so
  they are one mixer, the composition (:class:`ComposedOperator`) of
  ``A_c = P_h · V_c`` over ``x = v_proj(h')`` (values per key/value channel, repeated for the query heads), with
  P_h the softmax probabilities rebuilt from the layer's attention-interface call (its log-scaled query and its
  relative ``position_bias``; q_norm, k_proj and k_sconv are inside P, detached as every query and key) and V_c the
  band ``I + M_c`` of v_sconv (:func:`skip_taps`), followed by ``T_d = I + M_d`` of attn_sconv on o_proj's
  output channel d. Path d ← c: ``T_d · A_c`` with weight ``o_proj.weight[d, c]``.
- **The MLP branch** ``mlp_sconv ∘ mlp``: the MLP mixes no tokens, so its token mixer is ``T_d = I + M_d`` of
  mlp_sconv over the MLP's output, under the key ``"{i}.mlp_sconv"`` (:class:`LayerPartKey`, after the layer's
  int key). It is a branch of its own: the residual ``h1`` is added around it.

k_sconv and v_sconv belong to the attention's operator (:data:`INNER_MIXERS`), never mixers of their own.

Pads: v_sconv and the branch convolutions mask their conv input, not their skip, so a pad's own value is its own
(x at the pad); the probabilities give pad keys zero weight, and the operators' pad rows and columns are zero. What
comes from no real token (the pads' values on pad rows) is added by the readouts.

formulation "hidden": the probabilities alone over the value the interface received (after v_sconv), one map per
head, composed with attn_sconv's band, which acts after o_proj and cannot be moved into the values. The MLP
branch's band is the same in both formulations (it has no core). Components of "unified": "s6" the probabilities
(off: the bands alone), "conv" the three convolutions' taps (off: their skips, the identity).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import DenseCore, HeadOperator, causal_band, skip_taps
from .common import linear_readout, rerun_under_hooks, run

MIXER_CLASSES = ("InklingAttention", "InklingShortConvolution")
# the attention adapter takes the layer's recorded attention-interface call (its probabilities)
CONSUMES_ATTENTION = ("InklingAttention",)
# convolutions inside the attention that its operator explains (not mixers of their own)
INNER_MIXERS = {"InklingAttention": ("k_sconv", "v_sconv")}
# where the residual-branch convolutions sit in a decoder layer: name -> the mixer whose output they take (None: the
# MLP's, which mixes no tokens)
BRANCH_CONVOLUTIONS = {"attn_sconv": "self_attn", "mlp_sconv": None}


def follows(layer: int, name: str, module, places=BRANCH_CONVOLUTIONS, classes=("InklingShortConvolution",)):
    """The name of the mixer of the same decoder layer whose output ``module`` takes with no residual between them
    (a branch convolution after the attention), or None. A branch convolution elsewhere than the decoder layer's
    known places is refused: how it composes with the other mixers would be a guess.

    Raises:
        TypeError: a branch convolution at an unknown place.
    """
    if type(module).__name__ not in classes:
        return None
    if name not in places:
        raise TypeError(f"mamba_captum: layer {layer} has a {type(module).__name__} at {name!r}, where the adapter "
                        f"does not know how it composes with the layer's other mixers (known places: "
                        f"{', '.join(places)}); please report the model class and config.")
    return places[name]


def conv_mask(call, dtype) -> torch.Tensor | None:
    """The 2-D padding mask the convolutions received (``conv_mask``), or None."""
    mask = call.options.get("conv_mask")
    return None if mask is None else mask.to(dtype)


def branch_conv(call, components: frozenset, work_dtype: torch.dtype, scale: float = 1.0):
    """A residual-branch convolution ``scale · (x + conv(m ⊙ x))`` as a band operator over its input x, one channel
    per hidden channel: ``T_d = scale · (I + M_d)`` (pad rows and columns 0).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` (no core, D one-channel heads) and the convolution's
        output recomputed, (B, L, D).
    """
    module = call.located.module
    x = call.hidden_states.to(work_dtype)
    batch, length, width = x.shape
    mask = conv_mask(call, work_dtype)
    real = torch.ones(batch, length, 1, dtype=work_dtype, device=x.device) if mask is None else mask[:, :, None]
    weight = module.conv1d.weight[:, 0, :].to(work_dtype)  # (D, K)
    taps = skip_taps(weight, scale)
    output = causal_band(x * real, taps)  # H x: what the real tokens give
    constant = (1 - real) * x * scale  # the pads' own skip
    rebuilt = output + constant
    kept = skip_taps(weight, scale, conv="conv" in components)

    def readout(out):
        return out.reshape(batch, length, width) + constant.to(out.dtype)

    operator = HeadOperator(None, mask=mask, heads=width, head_dim=1, conv_weight=kept[:, None, :],
                            values=(x * real)[..., None], output=output[..., None], readout=readout)
    return operator, rebuilt


def attention_operator(call, formulation, components, work_dtype, attention, *, x, taps, scale, mask,
                       readout_proj, gate=None, norm=None):
    """The attention part of the branch: a :class:`HeadOperator` with the probabilities as its core, per query-head
    channel c = (h, p) ``H_c = diag(gate_c) · P_h · diag(ν_h) · V_c`` over the value projection (the key/value
    channel of c).

    Args:
        x: (B, L, Hkv, d) the value projection (before the convolution). taps: (Hkv, d, K), or (B, L, Hkv, d, K) per
            row, the value convolution's taps with its skip and scale (:func:`skip_taps`). scale: the skip's weight
            (a pad's own value is ``scale · x``). mask: (B, L) or None.
        readout_proj: o_proj as a float64 function of (B, L, Hq·d).
        gate: (B, L, Hq, d) an output gate before o_proj, or None. norm: ``norm(values) -> (B, L, Hkv, 1)``, a
            per-token scale of the convolved values computed from them (fixed at its value: the library's norm
            convention), or None.
    Returns:
        (operator, attended): the operator and o_proj's input recomputed, (B, L, Hq, d).
    """
    module = call.located.module
    heads, head_dim, groups = module.num_heads, module.head_dim, module.num_key_value_groups
    batch, length = x.shape[:2]
    real = torch.ones(batch, length, 1, 1, dtype=work_dtype, device=x.device) if mask is None \
        else mask[:, :, None, None]
    band = causal_band(x * real, taps)  # (B, L, Hkv, d): the real tokens' share of the convolved values
    rest = (1 - real) * x * scale  # a pad's own value through the skip: no real token's
    nu = None if norm is None else norm(band + rest)  # (B, L, Hkv, 1)
    if nu is not None:
        band, rest = band * nu, rest * nu
    repeat = lambda t: t.repeat_interleave(groups, dim=2)  # noqa: E731  (B, L, Hkv, ...) -> (B, L, Hq, ...)
    probs = attention.probs.to(work_dtype)
    attend = lambda v: (probs @ v.transpose(1, 2)).transpose(1, 2)  # noqa: E731  (B, L, Hq, d) -> (B, L, Hq, d)
    weight = torch.ones(batch, length, heads, head_dim, dtype=work_dtype, device=x.device) if gate is None \
        else gate.to(work_dtype)
    token_part = weight * attend(repeat(band))  # H x
    constant = weight * attend(repeat(rest))  # zero on real rows: the probabilities give pads no weight
    attended = token_part + constant

    if formulation != "unified":  # the probabilities alone over the interface's value; the gate joins o_proj
        interface_values = attention.values.transpose(1, 2).to(work_dtype)  # (B, L, Hq, d), heads repeated
        weight64 = weight.double()

        def hidden_readout(out):
            return readout_proj((weight64 * out).reshape(batch, length, heads * head_dim))

        operator = HeadOperator(DenseCore(probs), mask=mask, heads=heads, head_dim=head_dim, values=interface_values,
                                output=attend(interface_values), readout=hidden_readout)
        return operator, attended
    constant64 = constant.double()

    def readout(out):
        return readout_proj((out + constant64.to(out.dtype)).reshape(batch, length, heads * head_dim))

    taps_q = taps.repeat_interleave(groups, dim=0 if taps.dim() == 3 else 2)
    conv = taps_q if "conv" in components else torch.full((heads, head_dim, 1), float(scale), dtype=work_dtype,
                                                          device=x.device)
    col = repeat(nu).expand(batch, length, heads, head_dim) if (nu is not None and "norm" in components) else None
    row = gate.to(work_dtype) if (gate is not None and "gate" in components) else None
    operator = HeadOperator(DenseCore(probs), mask=mask, heads=heads, head_dim=head_dim, row_weight=row,
                            col_weight=col, conv_weight=conv, s6="s6" in components, values=repeat(x * real),
                            output=token_part, readout=readout)
    return operator, attended


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype, attention=None):
    """Rebuild one of the layer's mixers from its recorded input (and, for the attention, its interface call).

    Returns:
        (operator, rebuilt_output): for the attention a :class:`HeadOperator` (o_proj's output, (B, L, D)), which
        the engine composes with attn_sconv's band; for a branch convolution its band operator.
    """
    module = call.located.module
    if type(module).__name__ == "InklingShortConvolution":
        return branch_conv(call, components, work_dtype)
    hidden = call.hidden_states
    batch, length, _ = hidden.shape
    kv_heads, head_dim = module.num_key_value_heads, module.head_dim
    x = run(module.v_proj, hidden).to(work_dtype).view(batch, length, kv_heads, head_dim)
    taps = skip_taps(module.v_sconv.conv1d.weight[:, 0, :].to(work_dtype)).view(kv_heads, head_dim, -1)
    operator, attended = attention_operator(call, formulation, components, work_dtype, attention, x=x, taps=taps,
                                            scale=1.0, mask=conv_mask(call, work_dtype),
                                            readout_proj=linear_readout(module.o_proj))
    rebuilt = run(module.o_proj, attended.reshape(batch, length, -1).to(module.o_proj.weight.dtype))
    return operator, rebuilt


def short_conv_rule(module, x: torch.Tensor, mask, work_dtype: torch.dtype) -> torch.Tensor:
    """An ``InklingShortConvolution`` ``x + conv(m ⊙ x)`` (depthwise causal, m the 2-D padding mask or None) in the
    work dtype: linear in x (HF computes it in float32; the rule keeps a float64 model's precision)."""
    conv = module.conv1d
    length = x.shape[1]
    value = x.to(work_dtype)
    masked = value if mask is None else value * mask[:, :, None].to(work_dtype)
    taps = conv.weight.to(work_dtype)
    out = F.conv1d(masked.transpose(1, 2), taps, None if conv.bias is None else conv.bias.to(work_dtype),
                   padding=taps.shape[-1] - 1, groups=taps.shape[0])[..., :length].transpose(1, 2)
    return out + value


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The mixer's output under MambaLRP's rules, a differentiable function of ``call.hidden_states``.

    - A branch convolution (``attn_sconv``, ``mlp_sconv``): :func:`short_conv_rule`, linear.
    - The attention: its own forward re-run on the input, with ``k_sconv`` / ``v_sconv`` by :func:`short_conv_rule`
      (in the work dtype), HF's attention interface answered by the engine's softmax rule P̄ v (P from the detached
      queries and keys, :mod:`mamba_captum.lrp_forward`) and the relative logits (``rel_logits_proj``: a
      data-dependent bias of the scores, from ``r_proj``) detached with P: v_proj, v_sconv and o_proj are linear.
      The queries' norm and log-scaling and the keys' path only reach P.

    Needs the layer's own keywords (``call.options``: its attention mask and ``conv_mask``), as MambaLRP's engine
    records them. (B, L, D_model)."""
    module = call.located.module
    options = dict(call.options)
    if options.get("cache") is not None:
        raise NotImplementedError("mamba_captum: MambaLRP explains whole sequences: call Inkling with "
                                  "use_cache=False (its rule re-runs the layer, which would write the cache twice).")
    if type(module).__name__ == "InklingShortConvolution":
        return short_conv_rule(module, call.hidden_states, options.get("conv_mask"), work_dtype)
    if "attention_mask" not in options:
        raise ValueError("mamba_captum: Inkling's MambaLRP rule needs the layer's attention mask as it got it.")

    def convolved(conv, args, kwargs, output):  # k_sconv / v_sconv by their rule, in the work dtype
        x = args[0] if args else kwargs["hidden_states"]
        return short_conv_rule(conv, x, kwargs.get("conv_mask"), work_dtype).to(x.dtype)

    handles = [module.k_sconv.register_forward_hook(convolved, with_kwargs=True),
               module.v_sconv.register_forward_hook(convolved, with_kwargs=True),
               module.rel_logits_proj.register_forward_hook(lambda _, args, out: out.detach())]
    return rerun_under_hooks(module, call.hidden_states, options, handles, work_dtype)
