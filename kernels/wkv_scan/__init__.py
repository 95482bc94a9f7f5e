"""Differentiable RWKV-4 WKV scans with the signature of HF's ``rwkv_linear_attention``.

    wkv_t = (Σ_{j<t} e^{−(t−1−j) e^{time_decay} + k_j} v_j + e^{u + k_t} v_t) / (the same with v = 1),  u = time_first

All take ``(time_decay, time_first, key, value, state=None, return_state=False)`` with key, value (B, L, C) and
return ``(wkv, state)``: wkv (B, L, C) in key's dtype, and the last state — (num, den, max), each (B, C), the
numerator and denominator over a running max, accumulated in float32 (float64 for float64 inputs) — when a state
was given or asked for, else None. A given state is the one before the first token.

- :func:`wkv_scan_naive` — the per-token loop under autograd (HF's CPU path): the reference. HF writes each token's
  output into a preallocated tensor, whose backward copies a full (B, L, C) gradient per token: quadratic in L.
- :func:`wkv_scan_chunked` — a two-level blocked scan over (num, den, max) states with an explicit backward (the
  adjoints obey the same kind of recurrence backwards in time); O(√L) Python steps, exact to rounding, no overflow.
- :func:`wkv_scan_triton` — the same forward and backward as Triton kernels (GPU; float32).
"""
from __future__ import annotations

from .chunked import wkv_scan_chunked
from .naive import wkv_scan_naive
from .triton import wkv_scan_triton

__all__ = ["wkv_scan_chunked", "wkv_scan_naive", "wkv_scan_triton"]
