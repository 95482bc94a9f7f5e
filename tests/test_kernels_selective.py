"""Mamba-1 (S6) map kernels: the naive reference against independent computations, the blocked kernel against it."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from mamba_captum.kernels import selective as selective_pkg
from mamba_captum.kernels.selective import selective_maps, selective_maps_blocked, selective_maps_naive
from mamba_captum.kernels.selective import blocked as blocked_module

REDUCES = ["mean", "sum", "abs_mean", None]


def make_inputs(batch=2, length=33, channels=6, state=5, taps=4, seed=0, large=False):
    """Random float64 inputs: delta ≥ 0, A ≤ 0; ``large`` is the regime where naive factoring overflows."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.rand(batch, length, channels, generator=g, dtype=torch.float64) * (5.0 if large else 0.5)
    A = -torch.rand(channels, state, generator=g, dtype=torch.float64) * (16.0 if large else 2.0)
    if large:
        A[0, 0] = -16.0  # the extreme corner
        delta[:, :, 0] = 5.0
    B = torch.randn(batch, length, state, generator=g, dtype=torch.float64)
    C = torch.randn(batch, length, state, generator=g, dtype=torch.float64)
    row = torch.randn(batch, length, channels, generator=g, dtype=torch.float64)
    col = torch.randn(batch, length, channels, generator=g, dtype=torch.float64)
    conv = torch.randn(channels, taps, generator=g, dtype=torch.float64)
    return delta, A, B, C, dict(row_weight=row, col_weight=col, conv_weight=conv)


def cast(tensors, dtype):
    if isinstance(tensors, dict):
        return {k: None if v is None else v.to(dtype) for k, v in tensors.items()}
    return [t.to(dtype) for t in tensors]


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-300)).item()


def sequential_scan(u, delta, A, B, C):
    """Plain recurrence h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t, y_t = C_t · h_t. u (B, L, D) -> (B, L, D)."""
    batch, length, channels = u.shape
    h = u.new_zeros(batch, channels, A.shape[1])
    ys = []
    for t in range(length):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t, :, None] * B[:, t, None, :]) * u[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1)


# ---------------------------------------------------------------------------------------------------------------
# The naive reference


def test_naive_hand_computed_two_tokens():
    # delta = [0.5, ln 2], A = -1, B = [2, 3], C = [1, 4]:
    # α[0,0] = C0 δ0 B0 = 1;  α[1,0] = C1 exp(-δ1) δ0 B0 = 4 · 0.5 · 0.5 · 2 = 2;  α[1,1] = C1 δ1 B1 = 12 ln 2.
    ln2 = math.log(2.0)
    delta = torch.tensor([[[0.5], [ln2]]], dtype=torch.float64)
    A = torch.tensor([[-1.0]], dtype=torch.float64)
    B = torch.tensor([[[2.0], [3.0]]], dtype=torch.float64)
    C = torch.tensor([[[1.0], [4.0]]], dtype=torch.float64)
    alpha = selective_maps_naive(delta, A, B, C, reduce=None)
    expected = torch.tensor([[[[1.0, 0.0], [2.0, 12 * ln2]]]], dtype=torch.float64)
    torch.testing.assert_close(alpha, expected, rtol=1e-12, atol=1e-12)

    # row = [2, -1], col = [3, 0.5], conv taps w = [0.25, 2] (K = 2: M = [[w1, 0], [w0, w1]]):
    # H = diag(row) · α · diag(col) · M = [[12, 0], [-12 - 1.5 ln 2, -12 ln 2]].
    row = torch.tensor([[[2.0], [-1.0]]], dtype=torch.float64)
    col = torch.tensor([[[3.0], [0.5]]], dtype=torch.float64)
    conv = torch.tensor([[0.25, 2.0]], dtype=torch.float64)
    H = selective_maps_naive(delta, A, B, C, row_weight=row, col_weight=col, conv_weight=conv, reduce=None)
    expected = torch.tensor([[[[12.0, 0.0], [-12.0 - 1.5 * ln2, -12 * ln2]]]], dtype=torch.float64)
    torch.testing.assert_close(H, expected, rtol=1e-12, atol=1e-12)
    for fn in (selective_maps_blocked, selective_maps):
        torch.testing.assert_close(fn(delta, A, B, C, row_weight=row, col_weight=col, conv_weight=conv, reduce=None),
                                   expected, rtol=1e-12, atol=1e-12)


def test_naive_hidden_map_equals_scan_on_impulses():
    delta, A, B, C, _ = make_inputs(batch=2, length=12, channels=3, state=4)
    alpha = selective_maps_naive(delta, A, B, C, reduce=None)  # (B, D, L, L)
    for j in range(delta.shape[1]):
        impulse = torch.zeros_like(delta)
        impulse[:, j] = 1.0  # a unit impulse at token j in every channel: the scan returns column j of α_c
        column = sequential_scan(impulse, delta, A, B, C)  # (B, L, D)
        torch.testing.assert_close(alpha[:, :, :, j], column.transpose(1, 2), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("fn", [selective_maps_naive, selective_maps_blocked])
def test_operator_applies_conv_then_scan(fn):
    delta, A, B, C, weights = make_inputs(batch=2, length=15, channels=4, state=3, taps=4, seed=1)
    row, col, conv = weights["row_weight"], weights["col_weight"], weights["conv_weight"]
    x = torch.randn(2, 15, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    H = fn(delta, A, B, C, **weights, reduce=None)  # (B, D, L, L)
    Hx = torch.einsum("bcis,bsc->bic", H, x)
    conv_x = F.conv1d(x.transpose(1, 2), conv.unsqueeze(1), padding=conv.shape[1] - 1, groups=4)[..., :15]
    alpha = selective_maps_naive(delta, A, B, C, reduce=None)
    expected = row * torch.einsum("bcij,bjc->bic", alpha, col * conv_x.transpose(1, 2))
    torch.testing.assert_close(Hx, expected, rtol=1e-10, atol=1e-12)
    # The same through the scan itself: y = row ⊙ scan(col ⊙ conv(x)).
    torch.testing.assert_close(Hx, row * sequential_scan(col * conv_x.transpose(1, 2), delta, A, B, C),
                               rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Blocked against naive


@pytest.mark.parametrize("length", [1, 2, 7, 33, 70])
@pytest.mark.parametrize("reduce", REDUCES)
def test_blocked_matches_naive_float32(length, reduce):
    delta, A, B, C, weights = make_inputs(batch=2, length=length, channels=6, state=5, taps=4, seed=length)
    inputs32 = cast((delta, A, B, C), torch.float32)
    for use in itertools.product([False, True], repeat=3):
        kw = {name: w if on else None for (name, w), on in zip(weights.items(), use)}
        for rows in (None, torch.tensor([0, length - 1, length // 2, length // 2])):
            ref = selective_maps_naive(delta, A, B, C, **kw, rows=rows, reduce=reduce)
            out = selective_maps_blocked(*inputs32, **cast(kw, torch.float32), rows=rows, reduce=reduce)
            assert out.dtype == torch.float32 and out.shape == ref.shape
            assert rel_err(out, ref) <= 1e-5, (use, rows, rel_err(out, ref))


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("full_map_rows", [0, 10**9])
def test_blocked_many_rows(monkeypatch, reduce, full_map_rows):
    # Rows through the full map and indexing (reduce=None never does) or the direct path in several row blocks.
    monkeypatch.setitem(blocked_module._FULL_MAP_ROWS, "mean", full_map_rows)
    monkeypatch.setitem(blocked_module._FULL_MAP_ROWS, "sum", full_map_rows)
    monkeypatch.setitem(blocked_module._FULL_MAP_ROWS, "abs_mean", full_map_rows)
    delta, A, B, C, weights = make_inputs(batch=2, length=40, channels=3, state=4, seed=13)
    rows = torch.cat([torch.arange(40).flip(0), torch.tensor([5, 5, 39])])
    ref = selective_maps_naive(delta, A, B, C, **weights, rows=rows, reduce=reduce)
    assert rel_err(selective_maps_blocked(delta, A, B, C, **weights, rows=rows, reduce=reduce), ref) <= 1e-12


@pytest.mark.parametrize("reduce", REDUCES)
def test_blocked_large_delta_is_finite_and_exact(reduce):
    # |A| · Σ delta inside a few tokens reaches hundreds: factoring around a far reference would give inf / NaN.
    delta, A, B, C, weights = make_inputs(batch=2, length=70, channels=6, state=5, taps=4, seed=3, large=True)
    for rows in (None, torch.tensor([0, 69, 35, 35])):
        ref = selective_maps_naive(delta, A, B, C, **weights, rows=rows, reduce=reduce)
        out = selective_maps_blocked(*cast((delta, A, B, C), torch.float32), **cast(weights, torch.float32),
                                     rows=rows, reduce=reduce)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("leaf", [1, 2, 4, 16])
@pytest.mark.parametrize("taps", [1, 3, 6])
def test_blocked_leaf_sizes_and_long_convs(monkeypatch, leaf, taps):
    # Ragged lengths cut the last block of every level; a conv longer than a leaf raises the leaf size.
    monkeypatch.setattr(blocked_module, "LEAF", leaf)
    delta, A, B, C, weights = make_inputs(batch=2, length=45, channels=3, state=4, taps=taps, seed=7)
    for reduce in ("sum", None):
        ref = selective_maps_naive(delta, A, B, C, **weights, reduce=reduce)
        out = selective_maps_blocked(delta, A, B, C, **weights, reduce=reduce)
        assert rel_err(out, ref) <= 1e-12


@pytest.mark.parametrize("chunk", [1, 2])
def test_blocked_channel_chunks(monkeypatch, chunk):
    # One channel per chunk, or two: 5 channels then end in a smaller chunk (buffers of another shape; the
    # per-channel maps' reused block is then sliced, its batch stride that of the full chunk).
    monkeypatch.setattr(blocked_module, "_WORKING_ELEMENTS", 2 * 40 * 3 * chunk)  # B · padded L · N · chunk
    delta, A, B, C, weights = make_inputs(batch=2, length=40, channels=5, state=3, seed=11)
    shape = blocked_module._Blocked(delta, A, B, C, weights["row_weight"], weights["col_weight"],
                                    weights["conv_weight"])
    per_channel_block = 2 * shape.padded * shape.buf_width  # B · padded L · accumulator width
    monkeypatch.setattr(blocked_module, "_CHANNEL_BLOCK_ELEMENTS", chunk * per_channel_block)
    for reduce in REDUCES:
        ref = selective_maps_naive(delta, A, B, C, **weights, reduce=reduce)
        assert rel_err(selective_maps_blocked(delta, A, B, C, **weights, reduce=reduce), ref) <= 1e-12


@pytest.mark.parametrize("fn", [selective_maps_naive, selective_maps_blocked, selective_maps])
def test_dtype_and_reduce_none_consistency(fn):
    delta, A, B, C, weights = make_inputs(batch=2, length=20, channels=4, state=3, seed=2)
    out = fn(delta, A, B, C, **weights, reduce="mean")
    assert out.dtype == torch.float64 and out.shape == (2, 20, 20)
    per_channel = fn(delta, A, B, C, **weights, reduce=None)
    assert per_channel.dtype == torch.float64 and per_channel.shape == (2, 4, 20, 20)
    torch.testing.assert_close(per_channel.mean(1), out, rtol=1e-6, atol=1e-6 * out.abs().max().item())
    torch.testing.assert_close(per_channel.sum(1), fn(delta, A, B, C, **weights, reduce="sum"), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(per_channel.abs().mean(1), fn(delta, A, B, C, **weights, reduce="abs_mean"),
                               rtol=1e-6, atol=1e-9)
    assert torch.equal(out.triu(1), torch.zeros_like(out))  # causal
    rows = torch.tensor([3, 0, 19, 3])
    torch.testing.assert_close(fn(delta, A, B, C, **weights, rows=rows, reduce=None), per_channel[:, :, rows])
    out32 = fn(*cast((delta, A, B, C), torch.float32), **cast(weights, torch.float32), reduce="mean")
    assert out32.dtype == torch.float32


def test_blocked_long_sequence_float32():
    # L = 2048: long fp32 cumsums would lose the segment sums; the kernel keeps them float64 / leaf-local.
    g = torch.Generator().manual_seed(0)
    batch, length, channels, state = 1, 2048, 64, 16
    dt = torch.exp(torch.empty(channels, dtype=torch.float64).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    delta = F.softplus(torch.log(torch.expm1(dt)) + 0.5 * torch.randn(batch, length, channels, generator=g,
                                                                        dtype=torch.float64))
    A = -torch.exp(torch.empty(channels, state, dtype=torch.float64).uniform_(0.0, math.log(16.0), generator=g))
    B = torch.randn(batch, length, state, generator=g, dtype=torch.float64)
    C = torch.randn(batch, length, state, generator=g, dtype=torch.float64)
    weights = dict(row_weight=torch.randn(batch, length, channels, generator=g, dtype=torch.float64),
                   col_weight=torch.rand(batch, length, channels, generator=g, dtype=torch.float64),
                   conv_weight=torch.randn(channels, 4, generator=g, dtype=torch.float64))
    inputs32, weights32 = cast((delta, A, B, C), torch.float32), cast(weights, torch.float32)
    rows = torch.tensor([0, 1, 777, 1500, 2046, 2047])
    ref_rows = selective_maps_naive(delta, A, B, C, **weights, rows=rows)
    full64 = selective_maps_blocked(delta, A, B, C, **weights)
    assert rel_err(full64[:, rows], ref_rows) <= 1e-10
    full32 = selective_maps_blocked(*inputs32, **weights32)
    assert rel_err(full32, full64) <= 1e-5
    assert rel_err(full32[:, rows], ref_rows) <= 1e-5
    assert rel_err(selective_maps_blocked(*inputs32, **weights32, rows=rows), ref_rows) <= 1e-5


def test_bad_inputs_raise():
    delta, A, B, C, weights = make_inputs(batch=1, length=5, channels=2, state=3)
    for fn in (selective_maps_naive, selective_maps_blocked, selective_maps):
        with pytest.raises(ValueError, match="reduce"):
            fn(delta, A, B, C, reduce="max")
        with pytest.raises(ValueError, match="delta"):
            fn(delta[0], A, B, C)
        with pytest.raises(ValueError, match="A must be"):
            fn(delta, A[:1], B, C)
        with pytest.raises(ValueError, match="B must be"):
            fn(delta, A, B[:, :4], C)
        with pytest.raises(ValueError, match="C must be"):
            fn(delta, A, B, C[..., :2])
        with pytest.raises(ValueError, match="row_weight"):
            fn(delta, A, B, C, row_weight=weights["row_weight"][..., :1])
        with pytest.raises(ValueError, match="conv_weight"):
            fn(delta, A, B, C, conv_weight=weights["conv_weight"][None])
        with pytest.raises(ValueError, match="rows"):
            fn(delta, A, B, C, rows=torch.tensor([0, 5]))
        with pytest.raises(ValueError, match="rows"):
            fn(delta, A, B, C, rows=torch.tensor([[0]]))
        with pytest.raises(ValueError, match="float32 or float64"):
            fn(delta.half(), A, B, C)


def test_package_exports():
    assert set(selective_pkg.__all__) == {"selective_maps", "selective_maps_blocked", "selective_maps_naive",
                                          "selective_maps_triton"}


# ---------------------------------------------------------------------------------------------------------------
# A column weight after the conv (gradient × operator × input in one call)


def test_value_weight_is_a_column_scaling_after_the_conv():
    delta, A, B, C, weights = make_inputs(batch=2, length=15, channels=4, state=3, taps=4, seed=2)
    values = torch.randn(2, 15, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    H = selective_maps_naive(delta, A, B, C, **weights, reduce=None)  # (B, D, L, L)
    expected = H * values.permute(0, 2, 1)[:, :, None, :]
    got = selective_maps_naive(delta, A, B, C, **weights, value_weight=values, reduce=None)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # summed over channels it is Σ_c g_c[i] H_c[i, j] x_c[j], whose rows sum to Σ_c g_c[i] (H_c x_c)[i]
    summed = selective_maps_naive(delta, A, B, C, **weights, value_weight=values, reduce="sum")
    torch.testing.assert_close(summed.sum(-1), torch.einsum("bcij,bjc->bi", H, values), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length", [1, 7, 33, 70])
@pytest.mark.parametrize("reduce", REDUCES)
def test_blocked_value_weight_matches_naive(length, reduce):
    delta, A, B, C, weights = make_inputs(batch=2, length=length, channels=6, state=5, taps=4, seed=length + 1)
    values = torch.randn(2, length, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    for conv in (weights["conv_weight"], None):
        kw = dict(weights, conv_weight=conv, value_weight=values)
        for rows in (None, torch.tensor([0, length - 1, length // 2, length // 2])):
            ref = selective_maps_naive(delta, A, B, C, **kw, rows=rows, reduce=reduce)
            assert rel_err(selective_maps_blocked(delta, A, B, C, **kw, rows=rows, reduce=reduce), ref) <= 1e-12
            out = selective_maps_blocked(*cast((delta, A, B, C), torch.float32), **cast(kw, torch.float32),
                                         rows=rows, reduce=reduce)
            assert rel_err(out, ref) <= 1e-5, (conv is None, rows, reduce)
