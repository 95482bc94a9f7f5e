"""Which map kernel runs: Triton on CUDA float32 tensors, the blocked torch kernels otherwise.

``kernel_settings(backend=..., precision=...)`` overrides the choice inside a ``with`` block (and the environment
variables ``MAMBA_CAPTUM_KERNELS`` = "auto" | "torch" | "triton" and ``MAMBA_CAPTUM_PRECISION`` = "ieee" | "tf32"
set the defaults). ``backend="triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (tests). float64 inputs always
take the torch kernels: the Triton ones compute in float32.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
from torch import Tensor

from .triton_maps import PRECISIONS, triton_available

BACKENDS = ("auto", "torch", "triton")
_settings = {"backend": os.environ.get("MAMBA_CAPTUM_KERNELS", "auto"),
             "precision": os.environ.get("MAMBA_CAPTUM_PRECISION", "ieee")}


@contextlib.contextmanager
def kernel_settings(backend: Optional[str] = None, precision: Optional[str] = None) -> Iterator[None]:
    """Choose the map kernels inside a ``with`` block; the previous settings come back on exit.

    Args:
        backend: "auto" (Triton for CUDA float32 tensors, else torch), "torch" or "triton".
        precision: "ieee" (fp32-exact Triton products, default) or "tf32" (tensor cores; about 1e-3 relative).
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    saved = dict(_settings)
    _settings.update({k: v for k, v in (("backend", backend), ("precision", precision)) if v is not None})
    try:
        yield
    finally:
        _settings.clear()
        _settings.update(saved)


def use_triton(like: Tensor, dtype: Optional[torch.dtype] = None) -> bool:
    """True when maps on ``like``'s device, computed in ``dtype`` (default ``like.dtype``), should use Triton."""
    backend = _settings["backend"]
    if backend not in BACKENDS:
        raise ValueError(f"MAMBA_CAPTUM_KERNELS must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (dtype or like.dtype) != torch.float32:
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend 'triton' was asked for but Triton is not installed: pip install triton")
        if not like.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 (slow; for tests)")
        return True
    return like.is_cuda and triton_available()


def precision() -> str:
    """The tl.dot input precision of the Triton kernels: "ieee" or "tf32"."""
    if _settings["precision"] not in PRECISIONS:
        raise ValueError(f"MAMBA_CAPTUM_PRECISION must be one of {PRECISIONS}, got {_settings['precision']!r}")
    return _settings["precision"]

