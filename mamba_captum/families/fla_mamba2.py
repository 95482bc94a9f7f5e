"""flash-linear-attention's Mamba-2: ``Mamba2`` (model type ``mamba2``).

Forward (fla 0.6.0, ``fla/layers/mamba2.py``; on a CPU ``torch_forward``, on CUDA with mamba-ssm its kernels, the
same function): ``z, xBC, dt = in_proj(h·m)``; ``xBC·m`` (pads zeroed before the conv, in_proj's bias too);
``xBC = silu(conv(xBC) + b)·m``; split into x (H heads × P), B, C (G groups × N); ``Δ_h = clamp(softplus(dt +
dt_bias), dt_limit)``; ``A_h = -exp(A_log_h)``; ``y = SSD(x) + D·x`` (D per head, or per channel with
``D_has_hdim``); ``out = out_proj(norm(y, z))`` with fla's ``RMSNormGated`` (over each of the ``n_groups`` channel
groups; the gate silu(z) applied before the norm, or after it with ``norm_before_gate``), or ``y·silu(z)`` without
``rmsnorm``. fla's torch path (every CPU, and CUDA without mamba-ssm) runs the SSD in float32 even for a float64
model (``.float()``), and with ``n_groups`` > 1 gives head h the B, C of group h mod G (``B.repeat``), where mamba-ssm's
kernels give it group h // (H/G): the rebuild follows the path that ran.

hidden:  α_h[i,j] = (C_i · B_j)_{g(h)} exp(A_h Σ_{k=j+1..i} Δ_kh) Δ_jh                 over x after the conv.
unified: H_c = diag(ν_c) diag(silu(z_c)) α_h diag(σ(c_c)·m) M_c  for channel c of head h    over x before the conv,
         ν the norm's scale weight / rms (over y·silu(z), or over y with ``norm_before_gate``), computed from the
         real activations (absent without ``rmsnorm``).
The operator and the rebuilt output are :func:`mamba_captum.families.mamba2.ssd_operator`'s.
"""
from __future__ import annotations

import sys

import torch

from ..operators import masked_tokens
from .common import run
from .fla_mamba import fla_mixer
from .mamba2 import ssd_operator

MIXER_CLASSES = ("Mamba2",)
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's Mamba-2 models (their fused "
                   "norms) have none yet")


def norm_scale(mixer, y: torch.Tensor, gate: torch.Tensor):
    """ν (B, L, H·P): the per-token, per-channel scale of fla's ``RMSNormGated`` on y (gate = silu(z)), or None
    without the norm."""
    norm = mixer.norm
    if norm is None:
        return None
    width = y.shape[-1]
    group_size = norm.group_size or width
    normed = y if norm.norm_before_gate else y * gate
    grouped = normed.reshape(*normed.shape[:-1], width // group_size, group_size)
    inv_rms = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight.to(y.dtype) * inv_rms.expand_as(grouped).reshape(normed.shape)


def kernel_path(mixer) -> bool:
    """Whether the layer ran mamba-ssm's kernels (CUDA, mamba-ssm installed) rather than fla's torch path."""
    layer_module = sys.modules.get(type(mixer).__module__)
    return bool(getattr(layer_module, "is_fast_path_available", False)) and mixer.in_proj.weight.device.type == "cuda"


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`SSDOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = fla_mixer(call, "Mamba2")
    if mixer.norm is not None and type(mixer.norm).__name__ != "RMSNormGated":
        raise NotImplementedError(f"mamba_captum: {call.located.name}'s output norm {type(mixer.norm).__name__} is "
                                  "not fla's RMSNormGated.")
    mask = call.attention_mask
    projected = run(mixer.in_proj, masked_tokens(call.hidden_states, mask))
    heads, d_inner = mixer.num_heads, mixer.intermediate_size
    extra = projected.shape[-1] - d_inner - mixer.conv_dim - heads
    if extra:  # fla's in_proj has exactly z, xBC, dt (its forward splits off 2 · d_mlp more channels, always 0)
        raise NotImplementedError(f"mamba_captum: {call.located.name}'s in_proj gives {extra} channels beyond "
                                  "z, xBC and dt (a gated MLP beside the SSM), which the operator does not describe.")
    z, xbc, dt = projected.split([d_inner, mixer.conv_dim, heads], dim=-1)
    if call.unfused:  # fla zeroes the pads' conv input; the fused training kernel does not
        xbc = masked_tokens(xbc, mask)
    D = mixer.D.view(heads, mixer.head_dim) if mixer.D_has_hdim else mixer.D[:, None]
    return ssd_operator(call, formulation, components, work_dtype, z=z, xbc=xbc, dt=dt, conv=mixer.conv1d,
                        heads=heads, head_dim=mixer.head_dim, groups=mixer.n_groups, state=mixer.ssm_state_size,
                        time_step_limit=tuple(mixer.dt_limit), A_log=mixer.A_log, dt_bias=mixer.dt_bias, D=D,
                        norm_scale=lambda y, gate: norm_scale(mixer, y, gate), out_proj=mixer.out_proj,
                        tiled_groups=not kernel_path(mixer))
