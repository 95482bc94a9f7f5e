"""The selective scan the library's own models run (:mod:`mamba_captum.vision`'s Vim, the Mamba-1 rebuild's check):
mamba-ssm's ``selective_scan_fn`` on the fastest exact implementation for the inputs' device.

It lives with the kernels, below the engine, so that a model or an adapter can run it without importing
:mod:`mamba_captum.fast_scans` (which swaps transformers' own scans and sits above the adapters).
"""
from __future__ import annotations

import importlib.util

import torch

from ..triton_maps import triton_available
from .chunked import selective_scan_chunked
from .triton import selective_scan_triton


def has_mamba_ssm() -> bool:
    """True when mamba-ssm is installed (its CUDA kernel is then the fastest scan on CUDA)."""
    return importlib.util.find_spec("mamba_ssm") is not None


def mamba_ssm_selective_scan():
    """mamba-ssm's ``selective_scan_fn`` (imported on first use: mamba-ssm is optional)."""
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    return selective_scan_fn


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """mamba-ssm's ``selective_scan_fn`` on the fastest exact implementation for the inputs' device (mamba-ssm's
    CUDA kernel when installed, Triton on CUDA, the chunked torch scan elsewhere); differentiable. The library's own
    models (:mod:`mamba_captum.vision`) run their scans through it.

    Shapes: u, delta (B, D, L); A (D, N); B, C (B, N, L); D (D,) or None; z (B, D, L) or None; returns y (B, D, L)
    in u's dtype.
    """
    if u.device.type == "cuda" and has_mamba_ssm():
        scan = mamba_ssm_selective_scan()
    elif u.device.type == "cuda" and triton_available() and u.dtype != torch.float64:
        scan = selective_scan_triton
    else:
        scan = selective_scan_chunked
    return scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)
