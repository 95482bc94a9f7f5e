"""Vision Mamba's bimamba v2 mixer (:class:`mamba_captum.vision.VimMixer`): two Mamba-1 scans, one over the reversed
sequence, averaged.

Forward: ``x, z = in_proj(h)``; ``y_f = (S6_f(u_f) + D·u_f) · silu(z)`` with ``u_f = silu(conv_f(x) + b_f)``; the same
with the ``_b`` parameters on the reversed (x, z), reversed back: ``y_b``; ``out = out_proj((y_f + y_b) / 2)``.

unified: ``H_c = ½ diag(silu z_c) [α_f,c diag(σ(pre_f,c)) M_f,c + J α_b,c diag(σ(pre_b,c)) M_b,c J]``   over x.
hidden:  ``α_f + J α_b J`` (the S6 part of each direction, each over its own u; no gate, no ½).

J reverses the tokens. The operator is non-causal: the forward scan fills the lower triangle, the backward one the
upper, both the diagonal. The D skips and the conv biases are not attributed to tokens, as for Mamba-1. Each
direction is rebuilt with the Mamba-1 adapter's pieces (:func:`mamba_captum.families.mamba.scan_pieces`).
"""
from __future__ import annotations

import torch

from ..operators import BidirectionalOperator
from .mamba import check_dtype, lrp_inner, scan_pieces, selective_operator
from .common import linear_readout, run

MIXER_CLASSES = ("VimMixer",)
NONCAUSAL = True  # every token sees every other: no padding, no causal query context


def _direction(mixer, x, z, suffix: str, work_dtype, hidden):
    A_log, D = (mixer.A_log, mixer.D) if suffix == "" else (mixer.A_b_log, mixer.D_b)
    return scan_pieces(x, z, None, conv1d=getattr(mixer, "conv1d" + suffix), x_proj=getattr(mixer, "x_proj" + suffix),
                       dt_proj=getattr(mixer, "dt_proj" + suffix), A_log=A_log, D=D, rank=mixer.dt_rank,
                       state_size=mixer.d_state, work_dtype=work_dtype, check_dtype=check_dtype(hidden))


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the mixer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`BidirectionalOperator` and the mixer output recomputed from it.
    """
    mixer = call.located.module
    hidden = call.hidden_states
    if call.attention_mask is not None:
        raise ValueError("mamba_captum: Vim mixes every token with every other (both scan directions) and has no "
                         "padding: pass no attention_mask.")
    x, z = run(mixer.in_proj, hidden).chunk(2, dim=-1)  # (B, L, D_in) each
    front = _direction(mixer, x, z, "", work_dtype, hidden)
    back = _direction(mixer, x.flip(1), z.flip(1), "_b", work_dtype, hidden)  # in reversed token order
    scale = 0.5 if mixer.if_divide_out else 1.0
    mixed = lambda forward, backward: (forward + backward.flip(1)) * scale  # noqa: E731 (out_proj's input)
    rebuilt = run(mixer.out_proj, mixed((front.scan + front.skip) * front.gate,
                                        (back.scan + back.skip) * back.gate).to(hidden.dtype))

    out_proj = linear_readout(mixer.out_proj)
    f_gate, b_gate = front.gate.double(), back.gate.double()
    if formulation == "hidden":  # outputs: the two scans; the D skips, the gates and the average come after them
        f_skip, b_skip = front.skip.double(), back.skip.double()
        readout = lambda y: out_proj(mixed((y[:, :, 0] + f_skip) * f_gate,  # noqa: E731
                                           (y[:, :, 1].flip(1) + b_skip) * b_gate))
        scale_rows = 1.0
    else:  # outputs: ½ · scan · gate per direction (in sequence order); out_proj's input adds the gated skips
        skips = mixed(front.skip * front.gate, back.skip * back.gate).double()
        readout = lambda y: out_proj(y[:, :, 0] + y[:, :, 1] + skips)  # noqa: E731
        scale_rows = scale
    operator = BidirectionalOperator(
        selective_operator(front, formulation, components, None, row_scale=scale_rows),
        selective_operator(back, formulation, components, None, row_scale=scale_rows),
        readout=readout)
    return operator, rebuilt


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The mixer's output under MambaLRP's rules, a differentiable function of ``call.hidden_states``: each direction
    by Mamba-1's rules (:func:`mamba_captum.families.mamba.lrp_inner`: the conv linear, SiLU by the identity rule,
    Δ, B, C detached, the D skip, the gate by the half rule), the backward one on the reversed tokens and reversed
    back; the average (a constant ½) and out_proj linear. Linear in the mixer input; the conv biases (and the
    projections' biases, if any) are its constant terms. (B, L, D_model), float64."""
    mixer = call.located.module
    if call.attention_mask is not None:
        raise ValueError("mamba_captum: Vim mixes every token with every other (both scan directions) and has no "
                         "padding: pass no attention_mask.")
    x, z = run(mixer.in_proj, call.hidden_states).chunk(2, dim=-1)  # (B, L, D_in) each, carrying the graph
    directions = []
    for suffix, flip in (("", False), ("_b", True)):
        xs, zs = (x.flip(1), z.flip(1)) if flip else (x, z)
        A_log, D = (mixer.A_log, mixer.D) if suffix == "" else (mixer.A_b_log, mixer.D_b)
        conv1d = getattr(mixer, "conv1d" + suffix)
        with torch.no_grad():  # the selection (Δ, B, C) from the real activations, detached
            pieces = scan_pieces(xs.detach(), zs.detach(), None, conv1d=conv1d,
                                 x_proj=getattr(mixer, "x_proj" + suffix), dt_proj=getattr(mixer, "dt_proj" + suffix),
                                 A_log=A_log, D=D, rank=mixer.dt_rank, state_size=mixer.d_state,
                                 work_dtype=work_dtype, with_scan=False)
        inner = lrp_inner(pieces, xs, zs, None, conv1d=conv1d, D=D, unfused=True, work_dtype=work_dtype)
        directions.append(inner.flip(1) if flip else inner)
    mixed = directions[0] + directions[1]
    if mixer.if_divide_out:
        mixed = mixed * 0.5
    return linear_readout(mixer.out_proj)(mixed.double())
