"""flash-linear-attention's HGRN: ``HGRNAttention`` (model type ``hgrn``), an elementwise gated recurrence: each of
its D = ``hidden_size · expand_ratio`` channels is a "head" of one key and one value channel.

Forward (fla 0.6.0, ``fla/layers/hgrn.py``; the layer does NOT unpad a masked batch, it zeroes the pads instead):
i, f = the projections of h (each through a short conv without activation when ``use_short_conv``, its input zeroed
at the pads); f ← logsigmoid(f), raised by the model's per-layer lower bound λ (layers after the first:
f ← log(λ + (1 − λ)·e^f)); x = silu(i) · (1 − e^f) · m; per channel h_t = e^{f_t} h_{t−1} + x_t, o_t = h_t; then
``o_proj(rms_norm(o) · swish(g_proj h))`` with ONE gated RMS norm over all D channels of a token. The pads run too:
a left pad's output is zero (nothing written yet), a right pad's is the decaying state, and both are rebuilt.

hidden:  α_c[t, s] = e^{F_t,c − F_s,c}  (s ≤ t; F the cumulative f)  over x (what the recurrence adds).
unified: H_c = diag(ν_c · swish(g_c)) · α_c · diag(1 − e^{f_c}) · diag(σ(pre_c) · m) · M_c  over i before its conv
         (pre the conv's output, M_c its band; without a conv pre = i and no M_c); the input gate 1 − e^{f} is part
         of the core (it is the recurrence's, as HGRN-2's key k = 1 − e^g), so ``components`` without "s6" drops it.
         ν_c = weight_c / rms of the token's whole o, from the real activations.
f enters α (detached), as the decays of the SSMs, not the attribution.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.gated_linear import gated_linear_chunked
from ..operators import GatedLinearCore
from .common import run
from .fla_heads import head_operator, short_conv
from .fla_hgrn2 import lower_bounded, refuse_conv_bias, refuse_norm_bias, refuse_packed

MIXER_CLASSES = ("HGRNAttention",)
INNER_MIXERS = {"HGRNAttention": ("i_conv1d", "f_conv1d")}  # the short convs: part of H
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's HGRN has none yet (its "
                   "lower-bounded forget gate and layer-wide gated norm need their own)")


def _projected(mixer, h, mask, name: str, conv_name: str):
    """(before the conv, after it) of projection ``name``; fla's conv zeroes its input at the pads first."""
    x = run(getattr(mixer, name), h)
    if not mixer.use_short_conv:
        return x, x
    masked = x if mask is None else x * mask[:, :, None].to(x.dtype)
    return x, short_conv(getattr(mixer, conv_name), masked)[1]


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (the pads as fla runs them: not zeroed, not dropped).

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` (one head per channel) and the mixer output recomputed
        from it, (B, L, D), pads included.
    """
    mixer = call.located.module
    refuse_packed(call, "HGRN")
    refuse_conv_bias(mixer, "i_conv1d", formulation, "HGRN")
    refuse_norm_bias(mixer.g_norm, "HGRN")
    if mixer.g_norm.activation not in ("swish", "silu"):
        raise NotImplementedError(f"mamba_captum: HGRN's gated norm with activation {mixer.g_norm.activation!r}.")
    h, mask = call.hidden_states, call.attention_mask
    batch, length, _ = h.shape
    width = mixer.input_dim
    value_pre, pre = _projected(mixer, h, mask, "i_proj", "i_conv1d")
    log_forget = lower_bounded(F.logsigmoid(_projected(mixer, h, mask, "f_proj", "f_conv1d")[1].double()), call)
    input_gate = 1 - log_forget.exp()
    values = F.silu(pre.double()) * input_gate
    if mask is not None:
        values = values * mask[:, :, None].to(values.dtype)
    channels = lambda t: t.reshape(batch, length, width, 1)  # noqa: E731  (one head per channel)
    ones = torch.ones(batch, length, width, 1, dtype=torch.float64, device=h.device)
    output, _ = gated_linear_chunked(ones, ones, channels(values), log_forget, scale=1.0)
    with torch.no_grad():
        if formulation == "hidden":
            core = GatedLinearCore(ones.to(work_dtype), ones.to(work_dtype), log_forget.detach(), 1.0)
        else:  # over silu(i): the input gate 1 − e^f is the core's key
            core = GatedLinearCore(ones.to(work_dtype), channels(input_gate.detach()).to(work_dtype),
                                   log_forget.detach(), 1.0)
    gate = F.silu(run(mixer.g_proj, h).double())
    taps = mixer.i_conv1d.weight[:, 0, :] if mixer.use_short_conv else None
    return head_operator(call, formulation, components, work_dtype, core=core, heads=width, head_dim=1,
                         values=channels(values).to(work_dtype), output=output, gate=channels(gate),
                         norm=mixer.g_norm, out_proj=mixer.o_proj, value_pre=value_pre, conv_pre=pre, taps=taps,
                         norm_over_width=True, zero_pads=False)
