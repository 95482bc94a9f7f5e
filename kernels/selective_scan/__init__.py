"""Differentiable Mamba-1 selective scans with mamba-ssm's ``selective_scan_fn`` signature.

    h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,   y_t = C_t · h_t (+ D u_t) (· silu(z_t))     per channel d, state n

- :func:`selective_scan_naive` — the per-token loop under autograd (HF's torch path): the reference. Its backward
  writes a full-size gradient for every token's slice, so it grows faster than L.
- :func:`selective_scan_chunked` — an explicit forward and backward (a reverse-time scan for the adjoint), linear
  in L, memory O(B·D·N·L / chunk) beyond the inputs (states are recomputed chunk by chunk in the backward).
- :func:`selective_scan_triton` — the same forward and backward as Triton kernels (GPU; float32).
- :func:`selective_scan` — the fastest exact one for the inputs' device (mamba-ssm's CUDA kernel when installed).
"""
from __future__ import annotations

from .chunked import selective_scan_chunked
from .fastest import selective_scan
from .naive import selective_scan_naive
from .triton import selective_scan_triton

__all__ = ["selective_scan", "selective_scan_chunked", "selective_scan_naive", "selective_scan_triton"]
