"""Differentiable scans of Griffin's RG-LRU (``RecurrentGemmaRglru._rnn_scan`` in transformers).

    h_t = a_t h_{t−1} + x_t,   y_t = h_t     per channel; a_t = 0 at a reset (position_ids == 0)

All take ``(x, a, initial_state=None)`` with x, a (B, L, C) and return ``(y, last)``: y (B, L, C) in x's dtype and
the last state (B, C), accumulated in float32 (float64 for float64 inputs).

- :func:`rglru_scan_naive` — the per-token loop under autograd (HF's path): the reference. HF writes each token's
  output into a preallocated tensor, whose backward copies a full (B, L, C) gradient per token: quadratic in L.
- :func:`rglru_scan_chunked` — a two-level blocked scan with an explicit backward (the same scan backwards in
  time); O(√L) Python steps, exact to rounding.
- :func:`rglru_scan_triton` — the same forward and backward as Triton kernels (GPU; float32 accumulation).
"""
from __future__ import annotations

from .chunked import rglru_scan_chunked
from .naive import rglru_scan_naive
from .triton import rglru_scan_triton

__all__ = ["rglru_scan_chunked", "rglru_scan_naive", "rglru_scan_triton"]
