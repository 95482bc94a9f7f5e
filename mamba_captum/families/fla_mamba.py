"""flash-linear-attention's Mamba: ``Mamba`` (model types ``mamba`` and, with no attention layers, ``samba``).

Forward (fla 0.6.0, ``fla/layers/mamba.py``; on a CPU ``slow_forward``, on CUDA with mamba-ssm its kernels, the same
function): ``x, z = in_proj(h)``; ``x·m`` (pads zeroed before the conv); ``c = conv(x) + b`` (depthwise, causal);
``u = silu(c)·m``; ``dt, B, C = x_proj(u)``; ``Δ = softplus(dt_proj(dt))``; ``A = -exp(A_log)``; ``y = S6(u) + D·u``;
``out = out_proj(y · silu(z))``. transformers' MambaMixer without its pad mask on h (the same for real tokens, and
for pads: their u, B, C are zero, so their output is ``out_proj(0)``); with ``use_bias`` the masked x matters, since
in_proj's bias would otherwise reach the conv from the pads. mamba-ssm's fused training kernel masks nothing
(``call.unfused`` False: nothing is masked in the rebuild either).

hidden:  α_c[i,j] = Σ_n C_i[n] exp(A_cn Σ_{k=j+1..i} Δ_kc) Δ_jc B_j[n]   over u (after the conv).
unified: H_c = diag(silu(z_c)) α_c diag(σ(c_c)·m) M_c                     over x (the conv input).
Δ, B and C come from the same tokens but, as in the transformers families, enter α (detached), not the attribution.
The operator and the rebuilt output are :mod:`mamba_captum.families.mamba`'s (``scan_pieces``, ``pieces_operator``).
"""
from __future__ import annotations

import torch

from ..operators import masked_tokens
from .common import run
from .mamba import check_dtype, pieces_operator, scan_pieces

MIXER_CLASSES = ("Mamba",)
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's Mamba models (their fused "
                   "norms) have none yet")


def fla_mixer(call, kind: str):
    """The recorded mixer, refused unless it is fla's (the class name alone also fits mamba-ssm's ``Mamba`` /
    ``Mamba2``, another layout) and its activation is SiLU."""
    mixer = call.located.module
    if not type(mixer).__module__.startswith("fla."):
        raise NotImplementedError(
            f"mamba_captum: {call.located.name} is a {type(mixer).__module__}.{type(mixer).__name__}, not fla's "
            f"{kind} layer; only flash-linear-attention's {kind} (fla.layers) is supported under this class name.")
    if mixer.activation not in ("silu", "swish"):
        raise NotImplementedError(f"mamba_captum: {call.located.name} uses activation {mixer.activation!r}; "
                                  "the unified operator is defined for silu.")
    return mixer


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`SelectiveOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = fla_mixer(call, "Mamba")
    hidden, mask = call.hidden_states, call.attention_mask
    x, z = run(mixer.in_proj, hidden).chunk(2, dim=-1)  # (B, L, D_in) each, the model's dtype
    if call.unfused:  # fla zeroes the pads' conv input (after in_proj, so its bias too)
        x = masked_tokens(x, mask)
    pieces = scan_pieces(x, z, mask, conv1d=mixer.conv1d, x_proj=mixer.x_proj, dt_proj=mixer.dt_proj,
                         A_log=mixer.A_log, D=mixer.D, rank=mixer.dt_rank, state_size=mixer.ssm_state_size,
                         unfused=call.unfused, work_dtype=work_dtype, check_dtype=check_dtype(hidden))
    del x, z  # the pieces hold what they need
    return pieces_operator(pieces, mixer.out_proj, hidden, mask, formulation, components, work_dtype)
