"""The per-head cores of the linear mixers and their weighted maps: the delta rule (chunked WY form == the
recurrence, hand-computed case), decayed-score attention (rows == the formula), and head_maps_blocked == naive on
every option."""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error

from mamba_captum.kernels.delta_rule import (delta_rule_alpha_chunked, delta_rule_alpha_naive,
                                             delta_rule_output_chunked)
from mamba_captum.kernels.gated_scores import gated_scores_alpha_naive, gated_scores_alpha_rows
from mamba_captum.kernels.heads import blocked as heads_blocked
from mamba_captum.kernels.heads import head_maps_blocked, head_maps_naive


def delta_inputs(batch=2, length=21, heads=3, dim=6, per_channel=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dim, generator=g, dtype=torch.float64) * dim ** -0.5
    k = F.normalize(torch.randn(batch, length, heads, dim, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.rand(batch, length, heads, generator=g, dtype=torch.float64)
    shape = (batch, length, heads, dim) if per_channel else (batch, length, heads)
    log_decay = -torch.rand(*shape, generator=g, dtype=torch.float64) * 0.7
    return q, k, beta, log_decay


def test_delta_rule_hand_computed_case():
    # one head, K = 1: S_t = (1 − β_t k_t²) e^{g_t} S_{t−1} + β_t k_t v_t, o_t = q_t S_t
    q = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64).view(1, 3, 1, 1)
    k = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64).view(1, 3, 1, 1)
    beta = torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64).view(1, 3, 1)
    g = torch.tensor([0.0, -1.0, -0.5], dtype=torch.float64).view(1, 3, 1)
    keep = lambda t: (1 - beta[0, t, 0]) * math.exp(g[0, t, 0])  # noqa: E731  the state's factor at step t
    expected = torch.tensor([
        [0.5 * 0.5, 0.0, 0.0],
        [2.0 * keep(1) * 0.5, 2.0 * 0.25, 0.0],
        [-1.0 * keep(2) * keep(1) * 0.5, -1.0 * keep(2) * 0.25, -1.0 * 1.0]], dtype=torch.float64)
    assert torch.allclose(delta_rule_alpha_naive(q, k, beta, g)[0, 0], expected, rtol=1e-14, atol=0)
    assert torch.allclose(delta_rule_alpha_chunked(q, k, beta, g, chunk_size=2)[0, 0], expected, rtol=1e-14,
                          atol=1e-16)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])
def test_delta_rule_chunked_equals_the_recurrence(per_channel, chunk_size):
    q, k, beta, g = delta_inputs(per_channel=per_channel)
    reference = delta_rule_alpha_naive(q, k, beta, g)
    assert relative_error(delta_rule_alpha_chunked(q, k, beta, g, chunk_size=chunk_size), reference) <= 1e-13
    assert torch.equal(reference.triu(1), torch.zeros_like(reference))
    values = torch.randn(*q.shape[:3], 5, dtype=torch.float64)
    output = delta_rule_output_chunked(q, k, beta, g, values, chunk_size=chunk_size)
    assert relative_error(output, torch.einsum("bhts,bshv->bthv", reference, values)) <= 1e-13
    # last_row: the rows up to it are computed, later rows stay zero
    part = delta_rule_alpha_chunked(q, k, beta, g, chunk_size=chunk_size, last_row=9)
    assert relative_error(part[:, :, :10], reference[:, :, :10]) <= 1e-13


def test_delta_rule_float32_follows_float64():
    q, k, beta, g = delta_inputs(length=200, dim=16)
    reference = delta_rule_alpha_naive(q, k, beta, g)
    single = delta_rule_alpha_chunked(q.float(), k.float(), beta.float(), g)
    assert single.dtype == torch.float32 and relative_error(single, reference) <= 1e-5


def test_gated_scores_rows_equal_the_formula():
    g = torch.Generator().manual_seed(1)
    batch, length, heads, dim = 2, 9, 3, 4
    q, k = (torch.randn(batch, length, heads, dim, generator=g, dtype=torch.float64) for _ in range(2))
    cumulative = -torch.rand(batch, length, heads, generator=g, dtype=torch.float64).cumsum(1)
    log_col, log_row = (torch.randn(batch, length, heads, generator=g, dtype=torch.float64) for _ in range(2))
    for cols, row_logs in ((None, None), (log_col, log_row)):
        reference = gated_scores_alpha_naive(q, k, cumulative, cols, row_logs)
        rows = torch.tensor([0, 3, 8])
        for b in range(batch):
            got = gated_scores_alpha_rows(q[b], k[b], cumulative[b], None if cols is None else cols[b],
                                          None if row_logs is None else row_logs[b], rows)
            assert relative_error(got, reference[b][:, rows]) <= 1e-14
    # a hand-computed entry: (q_2 · k_0) e^{G_2 − G_0 + a_0 + b_2}
    entry = (q[0, 2, 1] * k[0, 0, 1]).sum() * torch.exp(cumulative[0, 2, 1] - cumulative[0, 0, 1] + log_col[0, 0, 1]
                                                         + log_row[0, 2, 1])
    assert torch.isclose(gated_scores_alpha_naive(q, k, cumulative, log_col, log_row)[0, 1, 2, 0], entry)


WEIGHTS = {
    "none": {},
    "row": {"row_weight"},
    "col": {"col_weight"},
    "conv": {"conv_weight"},
    "row+conv": {"row_weight", "conv_weight"},
    "all": {"row_weight", "col_weight", "conv_weight"},
}


@pytest.mark.parametrize("weights", list(WEIGHTS))
@pytest.mark.parametrize("reduce", ["mean", "sum", "abs_mean", None])
def test_head_maps_blocked_equals_naive(weights, reduce, monkeypatch):
    monkeypatch.setattr(heads_blocked, "TILE_SIZE", 5)  # several row tiles
    monkeypatch.setattr(heads_blocked, "CHANNEL_BLOCK_ELEMENTS", 150)
    g = torch.Generator().manual_seed(2)
    batch, length, heads, head_dim, taps = 2, 17, 3, 4, 3
    alpha = torch.randn(batch, heads, length, length, generator=g, dtype=torch.float64).tril()
    given = {"row_weight": torch.randn(batch, length, heads, head_dim, generator=g, dtype=torch.float64),
             "col_weight": torch.randn(batch, length, heads, head_dim, generator=g, dtype=torch.float64),
             "conv_weight": torch.randn(heads, head_dim, taps, generator=g, dtype=torch.float64)}
    kwargs = {name: given[name] for name in WEIGHTS[weights]}
    for rows in (None, torch.tensor([16, 2, 2, 0])):
        expected = head_maps_naive(alpha, rows=rows, reduce=reduce, **kwargs)
        got = head_maps_blocked(lambda b, r: alpha[b][:, r], batch=batch, length=length, heads=heads, rows=rows,
                                reduce=reduce, dtype=torch.float64, **kwargs)
        assert got.shape == expected.shape and relative_error(got, expected) <= 1e-13
