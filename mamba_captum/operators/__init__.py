"""The operator of one layer -> its implicit-attention maps.

Each operator holds the data-controlled pieces of one token mixer (Δ, A, B, C, gate, activation gain, conv taps,
norm scale, or softmax probabilities) rebuilt by a family adapter, and turns them into maps through
:mod:`mamba_captum.kernels`. Shapes: B batch, L tokens, D channels, N state size, H heads, P head dim, K conv taps.

``maps(reduce, rows)`` returns (B, L, L) for a reduced map, (B, C, L, L) with ``reduce=None``; with ``rows`` the
L query rows become R. Rows and columns of padding tokens are zero.

For gradient rules an operator also carries what it acts on and what it produces: ``values`` (its input x),
``output`` (H x, the part of the layer that comes from tokens) and ``readout`` (output -> the mixer's output,
float64), so that a gradient of the mixer output becomes a gradient of the operator output
(:func:`operator_output_grad`), and ``contributions(grad, rows)`` = ``Σ_c g_c[i] · H_c[i, j] · x_c[j]``: the
channel-summed first-order contribution of token j to the target through row i (rows of it sum to
``Σ_c g_c[i] · y_c[i]``). ``value_channels`` is the number of channels c in that sum.

The package, one module per kind of operator:

- ``common``: the pad mask on rebuilt tensors and on maps, the cast to a work dtype, :func:`operator_output_grad`;
- ``selective``: Mamba-1 (:class:`SelectiveOperator`), Vim (:class:`BidirectionalOperator`), Mamba-2
  (:class:`SSDOperator`);
- ``decay``: diagonal-decay recurrences, RWKV-4 and Griffin (:class:`DecayOperator`);
- ``softmax``: softmax attention (:class:`SoftmaxOperator`);
- ``heads``: one core per head (:class:`HeadOperator`) and its cores (delta rule, gated scores, gated linear, DPLR,
  dense, a gated core beside a band);
- ``composite``: operators of operators (:class:`SumOperator`, :class:`ChannelBlocksOperator`,
  :class:`ComposedOperator`);
- ``routed``: a sum of per-memory operators over routed sub-sequences (:class:`RoutedMemoriesOperator`,
  :class:`RoutedCore`).

The banded maps and the convolutions (``banded_maps``, ``band_entries``, ``causal_band``, ...) are kernels,
:mod:`mamba_captum.kernels.bands`, re-exported here with every operator.
"""
from __future__ import annotations

from ..kernels.bands import band_entries, banded_maps, causal_band, causal_neighbours, skip_taps, sparse_conv
from ..kernels.reductions import REDUCTIONS, reduce_channels
from .common import masked_tokens, operator_output_grad, select_channels
from .channel_conv import ChannelConvOperator
from .composite import ChannelBlocksOperator, ComposedOperator, SumOperator
from .decay import DecayOperator
from .heads import (DeltaProductCore, DeltaRuleCore, DenseCore, DPLRCore, GatedLinearCore, GatedScoresCore,
                    HeadOperator, ParallelBandCore, gate_norm_rows)
from .routed import RoutedCore, RoutedMemoriesOperator, gather_slots, scatter_slots
from .selective import BidirectionalOperator, SelectiveOperator, SSDOperator
from .softmax import SoftmaxOperator
from .windowed import WindowedOperator

__all__ = ["REDUCTIONS", "BidirectionalOperator", "ChannelBlocksOperator", "ChannelConvOperator", "ComposedOperator",
           "DecayOperator", "DPLRCore", "DeltaProductCore", "DeltaRuleCore", "DenseCore", "GatedLinearCore", "GatedScoresCore",
           "HeadOperator", "ParallelBandCore", "RoutedCore", "RoutedMemoriesOperator", "SSDOperator",
           "SelectiveOperator", "SoftmaxOperator", "SumOperator", "WindowedOperator",
           "band_entries", "banded_maps", "causal_band", "causal_neighbours", "gate_norm_rows", "gather_slots",
           "masked_tokens", "operator_output_grad", "reduce_channels", "scatter_slots", "select_channels", "skip_taps",
           "sparse_conv"]
