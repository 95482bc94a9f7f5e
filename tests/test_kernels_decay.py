"""The diagonal-decay map kernel (RWKV-4 WKV, RG-LRU): a hand-computed case, blocked == naive on every option,
the scan reference, and input validation."""
import math

import pytest
import torch
from conftest import relative_error

from mamba_captum.kernels.decay import decay_maps, decay_maps_blocked, decay_maps_naive
from mamba_captum.kernels.decay.blocked import TILE
from mamba_captum.kernels.scans import decay_scan_reference, reset_decay_scan


def test_hand_computed_case():
    # one channel, decays d = (·, 1, 2), log_q = (0, 0, -1), log_k = (0.5, 0, 0), diagonal 0; reset-free
    d = torch.tensor([[[0.0], [1.0], [2.0]]], dtype=torch.float64)
    log_q = torch.tensor([[[0.0], [0.0], [-1.0]]], dtype=torch.float64)
    log_k = torch.tensor([[[0.5], [0.0], [0.0]]], dtype=torch.float64)
    diag = torch.zeros_like(d)
    maps = decay_maps_naive(d, log_q, log_k, log_diag=diag, reduce=None)[0, 0]
    expected = torch.tensor([[1.0, 0.0, 0.0],
                             [math.exp(0.5 - 1.0), 1.0, 0.0],
                             [math.exp(-1.0 + 0.5 - 3.0), math.exp(-1.0 - 2.0), 1.0]], dtype=torch.float64)
    assert torch.allclose(maps, expected, rtol=1e-15, atol=0)
    assert torch.allclose(decay_maps_blocked(d, log_q, log_k, log_diag=diag, reduce=None)[0, 0], expected,
                          rtol=1e-15, atol=0)
    # a reset at token 2 (segments 0, 0, 1) removes the two entries of row 2 before it
    segments = torch.tensor([[0, 0, 1]])
    cut = decay_maps_blocked(d, log_q, log_k, log_diag=diag, segments=segments, reduce=None)[0, 0]
    assert torch.equal(cut[2, :2], torch.zeros(2, dtype=torch.float64)) and torch.equal(cut[:2], expected[:2])


def random_inputs(batch, length, channels, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(
        log_decay=torch.rand(batch, length, channels, generator=g, dtype=torch.float64) * 0.5,
        log_q=r(batch, length, channels) - 4.0, log_k=r(batch, length, channels),
        log_diag=r(batch, length, channels) - 1.0, row_weight=r(batch, length, channels),
        col_weight=torch.rand(batch, length, channels, generator=g, dtype=torch.float64),
        conv_weight=r(channels, 4),
        segments=torch.cumsum(torch.rand(batch, length, generator=g) < 0.05, 1),
    )


@pytest.mark.parametrize("length", [1, 5, TILE, TILE + 1, 2 * TILE + 22])
@pytest.mark.parametrize("reduce", ["mean", "sum", "abs_mean", None])
@pytest.mark.parametrize("options", [(), ("row_weight", "col_weight", "log_diag"), ("conv_weight", "segments"),
                                     ("log_q", "log_k", "log_diag", "row_weight", "col_weight", "conv_weight",
                                      "segments")])
def test_blocked_equals_naive(length, reduce, options):
    inputs = random_inputs(2, length, 5)
    kwargs = {name: inputs[name] for name in options}
    naive = decay_maps_naive(inputs["log_decay"], reduce=reduce, **kwargs)
    assert relative_error(decay_maps_blocked(inputs["log_decay"], reduce=reduce, **kwargs), naive) < 1e-12
    rows = [length - 1, 0, length // 2, length - 1]
    expected = naive[:, :, rows] if reduce is None else naive[:, rows]
    assert relative_error(decay_maps(inputs["log_decay"], reduce=reduce, rows=rows, **kwargs), expected) < 1e-12


@pytest.mark.parametrize("rows", [None, [0, 7, 40]])
def test_abs_mean_without_conv_takes_absolute_weights_on_the_mean_path(rows):
    inputs = random_inputs(2, 45, 4, seed=3)
    inputs.pop("conv_weight")
    inputs["col_weight"] = inputs["col_weight"] - 0.5  # signed rows and columns: |row α col| = |row| α |col|
    expected = decay_maps_naive(**inputs, reduce="abs_mean", rows=rows)
    assert relative_error(decay_maps_blocked(**inputs, reduce="abs_mean", rows=rows), expected) < 1e-12
    assert (expected > 0).any() and (expected >= 0).all()


@pytest.mark.parametrize("length", [1, 3, TILE, TILE + 2, 3 * TILE + 5])
@pytest.mark.parametrize("options", [("conv_weight",), ("conv_weight", "row_weight", "col_weight", "log_q", "log_k",
                                                          "log_diag", "one_segment")])
@pytest.mark.parametrize("reduce", ["abs_mean", "mean", "sum"])
def test_a_conv_without_resets_is_rank_one_below_the_band(length, options, reduce):
    inputs = random_inputs(2, length, 5, seed=4)
    inputs["col_weight"] = inputs["col_weight"] - 0.5  # signed
    kwargs = {name: inputs[name] for name in options if name != "one_segment"}
    if "one_segment" in options:  # a segment id that never changes: no reset, the fast path
        kwargs["segments"] = torch.full((2, length), 3)
    expected = decay_maps_naive(**kwargs, log_decay=inputs["log_decay"], reduce=reduce)
    got = decay_maps_blocked(**kwargs, log_decay=inputs["log_decay"], reduce=reduce)
    assert relative_error(got, expected) < 1e-12
    rows = list(range(0, length, 2)) * 10  # more rows than _FULL_MAP_ROWS: the full map, indexed
    assert relative_error(decay_maps_blocked(**kwargs, log_decay=inputs["log_decay"], reduce=reduce, rows=rows),
                          expected[:, rows]) < 1e-12


@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("options", [(), ("conv_weight",), ("conv_weight", "segments"),
                                     ("log_q", "log_k", "log_diag", "row_weight", "col_weight", "conv_weight")])
@pytest.mark.parametrize("rows", [None, [3, 0, 40], list(range(45))])
def test_value_weight_weighs_the_columns_after_the_conv(reduce, options, rows):
    # the conv'd keys carry it without resets, the taps one by one with them, a column weight without a conv
    inputs = random_inputs(2, 45, 4, seed=5)
    kwargs = {name: inputs[name] for name in options}
    value = torch.randn(2, 45, 4, dtype=torch.float64)
    expected = decay_maps_naive(inputs["log_decay"], **kwargs, value_weight=value, reduce=reduce, rows=rows)
    got = decay_maps(inputs["log_decay"], **kwargs, value_weight=value, reduce=reduce, rows=rows)
    assert relative_error(got, expected) < 1e-12
    assert relative_error(expected, decay_maps_naive(inputs["log_decay"], **kwargs, reduce=reduce, rows=rows)) > 0.1


def test_value_weight_needs_a_channel_sum():
    d = torch.rand(1, 4, 2)
    with pytest.raises(ValueError, match="value_weight applies to reduce='mean' or 'sum'"):
        decay_maps(d, value_weight=torch.rand(1, 4, 2), reduce="abs_mean")
    with pytest.raises(ValueError, match="value_weight must be a floating"):
        decay_maps(d, value_weight=torch.rand(1, 3, 2))


def test_many_rows_take_the_full_map_and_agree():
    inputs = random_inputs(1, 90, 3)
    rows = list(range(0, 90, 2))
    full = decay_maps_blocked(**inputs)
    assert relative_error(decay_maps_blocked(**inputs, rows=rows), full[:, rows]) < 1e-12


def test_output_dtype_and_float32_inputs():
    inputs = random_inputs(1, 70, 4)
    out = decay_maps(**{k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()})
    assert out.dtype == torch.float32
    assert decay_maps(**inputs, out_dtype=torch.float32).dtype == torch.float32
    assert relative_error(out, decay_maps_naive(**inputs)) < 1e-6


def test_scan_reference_applies_the_maps():
    inputs = random_inputs(2, 40, 3, seed=1)
    inputs.pop("conv_weight")
    x = torch.randn(2, 40, 3, dtype=torch.float64)
    maps = decay_maps_naive(reduce=None, **inputs)
    expected = torch.einsum("bcij,bjc->bic", maps, x)
    scanned = decay_scan_reference(x, inputs["log_decay"], inputs["log_q"], inputs["log_k"], inputs["log_diag"],
                                   inputs["row_weight"], inputs["col_weight"], inputs["segments"])
    assert relative_error(scanned, expected) < 1e-12


@pytest.mark.parametrize("length", [1, 31, 32, 100])  # the chunked scan's chunk is 32 tokens
def test_reset_decay_scan_is_the_token_loop_without_query_and_key_terms(length):
    inputs = random_inputs(2, length, 3, seed=2)
    x = torch.randn(2, length, 3, dtype=torch.float64, requires_grad=True)
    loop = decay_scan_reference(x, inputs["log_decay"], col_weight=inputs["col_weight"],
                                segments=inputs["segments"])
    chunked = reset_decay_scan(x, inputs["log_decay"], inputs["col_weight"], inputs["segments"])
    assert chunked.dtype == torch.float64 and relative_error(chunked, loop) < 1e-13
    assert relative_error(reset_decay_scan(x.float(), inputs["log_decay"]), decay_scan_reference(
        x, inputs["log_decay"])) < 1e-6  # float32 inputs are scanned in float64
    weights = torch.randn_like(loop)
    (expected,) = torch.autograd.grad((loop * weights).sum(), x)
    (got,) = torch.autograd.grad((chunked * weights).sum(), x)
    assert relative_error(got, expected) < 1e-13


def test_bad_inputs_are_clear_errors():
    d = torch.rand(1, 4, 2)
    with pytest.raises(ValueError, match="reduce must be one of"):
        decay_maps(d, reduce="max")
    with pytest.raises(ValueError, match="log_q must be a floating"):
        decay_maps(d, torch.rand(1, 3, 2))
    with pytest.raises(ValueError, match="conv_weight must be"):
        decay_maps(d, conv_weight=torch.rand(3, 4))
    with pytest.raises(ValueError, match="segments must be an integer"):
        decay_maps(d, segments=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="rows must lie in"):
        decay_maps(d, rows=[4])
