"""What the adapters of flash-linear-attention's linear layers share: the projections' short convolutions as plain
torch, fla's norms' per-token scale, and the hidden / unified operator of a layer whose core mixes values per head
(:class:`mamba_captum.operators.HeadOperator`).

fla's layers unpad a padded batch into packed sequences; a zeroed pad contributes nothing to a state that starts at
zero, so the rebuild zeroes pads instead (``masked_tokens``) and zeroes the pads' outputs, which fla repads with
zeros.

unified: H_c = diag(ν_c · act(z_c)) · α_h · diag(σ(pre_c) · m) · M_c   (with a SiLU short conv M on the values; without
         one, the column weight is the mask alone), over the values before the conv.
hidden:  α_h over the values as the core sees them (after the conv).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from types import SimpleNamespace

from ..operators import HeadOperator, gate_norm_rows, masked_tokens
from ..rules import silu_rule
from .common import linear_readout, run
from .gated_deltanet import core_output, output_gate


def refuse_packed_or_cached(call) -> None:
    """Refuse a layer call the rebuild cannot follow: packed sequences (``cu_seqlens``: the rebuild reads one sequence
    per batch row) and a cached prefix (``past_key_values`` holding this layer: the rebuild starts from a zero
    state), each by name with the fix."""
    mixer, options = call.located.module, call.options
    name = type(mixer).__name__
    if options.get("cu_seqlens") is not None:
        raise NotImplementedError(f"mamba_captum: fla's {name} with packed sequences (cu_seqlens); pass a padded "
                                  "batch with attention_mask instead.")
    cache = options.get("past_key_values")
    if cache is not None and len(cache) > mixer.layer_idx:
        raise NotImplementedError(f"mamba_captum: fla's {name} continuing a cached prefix (past_key_values); explain "
                                  "the whole sequence in one call.")


def short_conv(conv, x: torch.Tensor, dtype: torch.dtype | None = None):
    """(pre-activation, output) of fla's ``ShortConvolution`` (a depthwise causal ``nn.Conv1d``, SiLU or no
    activation) on x (B, L, C), computed by ``F.conv1d`` in ``dtype`` (default the conv's)."""
    dtype = conv.weight.dtype if dtype is None else dtype
    length = x.shape[1]
    pre = F.conv1d(x.transpose(1, 2).to(dtype), conv.weight.to(dtype),
                   None if conv.bias is None else conv.bias.to(dtype), padding=conv.weight.shape[-1] - 1,
                   groups=x.shape[-1])[..., :length].transpose(1, 2)
    if conv.activation is None:
        return pre, pre
    if conv.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: fla's ShortConvolution with activation {conv.activation!r}.")
    return pre, F.silu(pre)


def rule_values(mixer, h: torch.Tensor, mask: torch.Tensor | None, work_dtype, projection: str,
                conv: str) -> torch.Tensor:
    """The values (B, L, C) a layer's core mixes, under MambaLRP's rules, a differentiable function of h (B, L, D):
    the projection ``projection`` and, with ``mixer.use_short_conv``, the short conv ``conv`` linear (a bias a
    constant; the pads zeroed before the conv, as fla's packed conv sees them, and after it), the conv's SiLU (if
    any) by the identity rule."""
    value = masked_tokens(run(getattr(mixer, projection), h).to(work_dtype), mask)
    if mixer.use_short_conv:
        conv_module = getattr(mixer, conv)
        pre = short_conv(conv_module, value, work_dtype)[0]
        value = pre if conv_module.activation is None else silu_rule(pre)
    return masked_tokens(value, mask)


def rms_scale(norm, output: torch.Tensor, *, over_width: bool = False, eps: float | None = None) -> torch.Tensor:
    """ν (B, L, H, P): an fla RMSNorm's (or gated RMSNorm's) per-token scale weight / rms of output (B, L, H, P), the
    rms over each head's P channels or, with ``over_width``, over all H·P channels of the token (one norm across the
    heads, weight (H·P,)). eps: the epsilon the layer uses (default ``norm.eps``). A LayerNorm (a mean subtracted, a
    bias added) is not a scale: refused."""
    if getattr(norm, "bias", None) is not None or type(norm).__name__.startswith(("LayerNorm", "FusedLayerNorm")):
        raise NotImplementedError(f"mamba_captum: the output norm {type(norm).__name__} is not an RMS scale.")
    eps = norm.eps if eps is None else eps
    channels = output.reshape(*output.shape[:2], -1) if over_width else output
    inv = torch.rsqrt(channels.pow(2).mean(-1, keepdim=True) + eps)
    weight = getattr(norm, "weight", None)
    if not over_width:
        return inv if weight is None else weight.to(output.dtype) * inv
    # the width norm's weight in float64 (the scale float64 even for a float32 output), as its layers' rebuilds had it
    scale = inv.expand_as(channels) if weight is None else inv * weight.double()
    return scale.reshape(output.shape)


def head_operator(call, formulation, components, work_dtype, *, core, heads: int, head_dim: int, values, output,
                  gate, norm, out_proj, value_pre=None, conv_pre=None, taps=None, norm_over_width: bool = False,
                  norm_eps: float | None = None, zero_pads: bool = True):
    """The hidden or unified :class:`HeadOperator` of a layer whose output is ``out_proj(ν(o) ⊙ gate ⊙ o)`` with
    ``o = α v`` per head.

    Args:
        core: the core α (a ``_Core`` of :mod:`mamba_captum.operators.heads`).
        values: (B, L, H, P) what the core mixes (after the conv). output: (B, L, H, P) ``o``, float64.
        gate: (B, L, H, P) the output gate act(z), or None. norm: the RMS norm (its scale ν from :func:`rms_scale`),
            or None.
        value_pre, conv_pre, taps: the values before a SiLU short conv, its pre-activation (B, L, H·P) and the taps
            (H·P, K); None without a conv.
        norm_over_width: the norm spans all H·P channels of a token (fla's HGRN, HGRN-2, LightNet), not each head's.
        norm_eps: the norm's epsilon where the layer does not pass ``norm.eps``; None: ``norm.eps``.
        zero_pads: zero the pads' rebuilt outputs (fla repads an unpadded batch with zeros); False for a layer that
            runs its pads (HGRN).
    Returns:
        (operator, the mixer's rebuilt output (B, L, D)).
    """
    hidden_states, mask = call.hidden_states, call.attention_mask
    batch, length = hidden_states.shape[:2]
    per_head = lambda t: t.reshape(batch, length, heads, head_dim)  # noqa: E731
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    gate = None if gate is None else gate.double()
    nu = lambda out: rms_scale(norm, out, over_width=norm_over_width, eps=norm_eps)  # noqa: E731

    def scaled(out):  # ν(out) ⊙ gate ⊙ out, float64
        factor = out if gate is None else gate * out
        return factor if norm is None else nu(out) * factor

    inner = scaled(output.double())
    rebuilt = run(out_proj, inner.reshape(batch, length, -1).to(hidden_states.dtype))
    if mask is not None and zero_pads:
        rebuilt = rebuilt * mask.to(rebuilt.dtype)[:, :, None]
    readout_proj = linear_readout(out_proj)
    operator_mask = None if mask is None else w(mask)
    common = dict(mask=operator_mask, heads=heads, head_dim=head_dim)
    if formulation == "hidden":  # the core's output; the norm and the gate come after it
        return HeadOperator(core, **common, values=w(values), output=w(output),
                            readout=lambda out: readout_proj(scaled(out).reshape(batch, length, -1))), rebuilt
    row = gate_norm_rows(components, w(gate), None if norm is None else w(nu(output.double())))
    col = None
    if conv_pre is not None and "act" in components:
        col = per_head(torch.sigmoid(w(conv_pre)))
    if operator_mask is not None:
        mask_col = operator_mask[:, :, None, None].expand(batch, length, heads, head_dim)
        col = mask_col if col is None else col * mask_col
    conv = w(taps).reshape(heads, head_dim, -1) if taps is not None and "conv" in components else None
    if row is None and col is None and conv is None:
        col = torch.ones(batch, length, heads, head_dim, dtype=work_dtype, device=hidden_states.device)
    operator = HeadOperator(core, **common, row_weight=row, col_weight=col, conv_weight=conv, s6="s6" in components,
                            values=per_head(w(value_pre)) if value_pre is not None else w(values),
                            output=w(inner), readout=lambda out: readout_proj(out.reshape(batch, length, -1)))
    return operator, rebuilt


def head_lrp(call, work_dtype, *, core, values, gate_input, gate_activation: str | None, norm, out_proj,
             heads: int, head_dim: int, norm_over_width: bool = False, norm_eps: float | None = None,
             zero_pads: bool = True, substeps: int = 1):
    """The output ``out_proj(ν(o) ⊙ act(z) ⊙ o)``, ``o = α v`` per head, of a layer as :func:`head_operator` reads
    it, under MambaLRP's rules: the core α detached (``core_output``), ν detached, the gate by ``output_gate`` (SiLU:
    the identity and half rules; a sigmoid: :func:`mamba_captum.rules.sigmoid_gate`), so the output is linear in
    ``values`` and ``gate_input``.

    Args:
        core: the core α (B, H, L, L) through ``core.full()``.
        values: (B, L, H, P) the core's values under the rules (differentiable, in ``work_dtype``).
        gate_input: (B, L, H·P) or (B, L, H, P) the gate's pre-activation z (differentiable), or None (no gate).
        gate_activation: "swish" / "silu" or "sigmoid" (None without a gate). norm: the RMS norm (ν by
            :func:`rms_scale`), or None. norm_over_width, norm_eps, zero_pads: as :func:`head_operator`.
        substeps: n, with values (B, L, n·H, P) over the core's n·H heads (j, h) (a gated DeltaProduct's sub-steps):
            o_h is the sum over j of their outputs.
    Returns:
        (B, L, D) float64.
    """
    batch, length = values.shape[:2]
    output = core_output(core, values).reshape(batch, length, substeps, heads, head_dim).sum(2)
    # ν from the un-gated o (the norm acts before the gate), detached
    nu = None if norm is None else rms_scale(norm, output.detach(), over_width=norm_over_width, eps=norm_eps)
    if gate_input is not None:
        gate_input = gate_input.to(work_dtype).reshape(batch, length, heads, head_dim)
        output = output_gate(SimpleNamespace(activation=gate_activation), gate_input, output)
    if nu is not None:
        output = output * nu.to(output.dtype)
    out = linear_readout(out_proj)(output.reshape(batch, length, -1).double())
    if call.attention_mask is not None and zero_pads:
        out = out * call.attention_mask.to(out.dtype)[:, :, None]
    return out
