"""Maps of operators with one core per head, weighted per channel: the delta rule, KDA, lightning attention, mLSTM
and softmax with convolved values.

Per channel c = (h, p), with α_h the head's core (computed elsewhere, e.g. :mod:`kernels.delta_rule`)::

    H_c[i, s] = row[i, h, p] · Σ_j α_h[i, j] · col[j, h, p] · M_{h,p}[j, s]

M the bias-free causal depthwise conv (``M[t, s] = conv_weight[h, p, K−1−(t−s)]``). With no weight at all the maps
are the per-head cores (C = H channels), otherwise per channel (C = H·P, a missing weight meaning 1 / identity), as
for Mamba-2 (:mod:`kernels.ssd`).

- :func:`head_maps_naive`: the (B, C, L, L) stack from the whole α, float64; the test reference.
- :func:`head_maps_blocked`: row tiles of α from a callable, weighted tap by tap; reduced maps never hold more
  than (H, K, T, L) at once (T rows per tile) and nothing of size C × L × L.
"""
from __future__ import annotations

from .blocked import head_maps_blocked
from .naive import head_maps_naive

__all__ = ["head_maps_blocked", "head_maps_naive"]
