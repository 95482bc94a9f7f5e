"""Mamba-2 (SSD) implicit-attention map kernels: blocked vs naive, hand-computed cases, scan and conv identities."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mamba_captum.kernels import ssd
from mamba_captum.kernels.ssd import blocked as blocked_module
from mamba_captum.kernels.ssd import ssd_maps, ssd_maps_blocked, ssd_maps_naive
from mamba_captum.kernels.taps import post_conv_columns

BATCH, HEADS, HEAD_DIM, STATE, TAPS = 2, 4, 3, 5, 4
WEIGHT_NAMES = ("row_weight", "col_weight", "conv_weight")
WEIGHT_SETS = {"hidden": (), "row": ("row_weight",), "col": ("col_weight",), "conv": ("conv_weight",),
               "all": WEIGHT_NAMES}
REDUCES = ("mean", "sum", "abs_mean", None)
IMPLEMENTATIONS = {"naive": ssd_maps_naive, "blocked": ssd_maps_blocked}


def make_inputs(length, groups=2, *, heads=HEADS, head_dim=HEAD_DIM, large=False, dtype=torch.float32, seed=0):
    """Random SSD operator pieces: delta, A, B, C and the three weights, all in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    if large:  # strong decay: exp(A·seg) spans far beyond float32's range across a sequence
        delta, A = 5 * rand(BATCH, length, heads), -16 * rand(heads)
    else:
        delta, A = 0.05 + 0.45 * rand(BATCH, length, heads), -(0.1 + 1.9 * rand(heads))
    pieces = dict(delta=delta, A=A, B=randn(BATCH, length, groups, STATE), C=randn(BATCH, length, groups, STATE),
                  row_weight=randn(BATCH, length, heads, head_dim), col_weight=rand(BATCH, length, heads, head_dim),
                  conv_weight=randn(heads, head_dim, TAPS))
    return {name: t.to(dtype) for name, t in pieces.items()}


def call(fn, pieces, weights=WEIGHT_NAMES, dtype=None, **kwargs):
    """fn(delta, A, B, C, <the named weights>, **kwargs), optionally casting every input to dtype."""
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    named = {name: cast(pieces[name]) for name in weights}
    return fn(*(cast(pieces[name]) for name in ("delta", "A", "B", "C")), **named, **kwargs)


def relative_error(out, ref):
    """max |out - ref| / max |ref|."""
    ref = ref.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiny tiles and channel slabs so that short sequences go through every path of the blocked kernel."""
    monkeypatch.setattr(blocked_module, "TILE_SIZE", 4)
    monkeypatch.setattr(blocked_module, "CHANNEL_BLOCK_ELEMENTS", 64)


# ---------------------------------------------------------------------------------------------------------------
# blocked vs naive


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("weights", WEIGHT_SETS)
@pytest.mark.parametrize("with_rows", [False, True], ids=["all_rows", "rows"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("length", [1, 2, 9, 40])
def test_blocked_matches_naive(small_blocks, length, groups, with_rows, weights, reduce):
    pieces = make_inputs(length, groups, seed=length * 10 + groups)
    rows = torch.tensor([0, length - 1, length // 2, length // 2]) if with_rows else None
    ref = call(ssd_maps_naive, pieces, WEIGHT_SETS[weights], dtype=torch.float64, rows=rows, reduce=reduce)
    out = call(ssd_maps_blocked, pieces, WEIGHT_SETS[weights], rows=rows, reduce=reduce)
    channels = HEADS if weights == "hidden" else HEADS * HEAD_DIM
    n_rows = length if rows is None else len(rows)
    expected_shape = (BATCH, n_rows, length) if reduce else (BATCH, channels, n_rows, length)
    assert out.shape == ref.shape == expected_shape
    assert out.dtype == torch.float32
    assert relative_error(out, ref) <= 1e-5


@pytest.mark.parametrize("weights", ["all", "row+conv", "row+col"])
@pytest.mark.parametrize("with_rows", [False, True], ids=["all_rows", "rows"])
@pytest.mark.parametrize("length", [1, 3, 9])
def test_value_weight_is_the_conv_tap_by_tap(small_blocks, length, with_rows, weights):
    """A column weight after the conv (gradient x operator x input in one call) equals the general tap-by-tap
    fallback over the naive kernel, float64, to rounding."""
    names = {"all": WEIGHT_NAMES, "row+conv": ("row_weight", "conv_weight"), "row+col": ("row_weight", "col_weight")}
    pieces = make_inputs(length, 2, dtype=torch.float64, seed=length)
    values = torch.randn(BATCH, length, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    rows = torch.tensor([length - 1, 0, length - 1]) if with_rows else None
    given = {name: pieces[name] for name in names[weights]}
    ones = torch.ones_like(values)
    ref = post_conv_columns(
        lambda r, c: ssd_maps_naive(*(pieces[n] for n in ("delta", "A", "B", "C")), row_weight=r, col_weight=c,
                                    rows=rows, reduce="sum"),
        given["row_weight"], given.get("col_weight", ones), values, given.get("conv_weight"), length)
    for reduce, scale in (("sum", 1.0), ("mean", HEADS * HEAD_DIM)):
        out = call(ssd_maps_blocked, pieces, names[weights], rows=rows, reduce=reduce, value_weight=values)
        assert relative_error(out * scale, ref) <= 1e-12


def test_value_weight_needs_a_channel_sum():
    pieces = make_inputs(4)
    with pytest.raises(ValueError, match="value_weight needs reduce"):
        call(ssd_maps_blocked, pieces, reduce=None, value_weight=pieces["row_weight"])


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("weights", ["hidden", "all"])
def test_large_delta_stays_finite_and_exact(small_blocks, weights, reduce):
    length = 40
    pieces = make_inputs(length, groups=2, large=True, seed=7)
    for rows in (None, torch.tensor([0, length - 1, length // 2, length // 2])):
        ref = call(ssd_maps_naive, pieces, WEIGHT_SETS[weights], dtype=torch.float64, rows=rows, reduce=reduce)
        out = call(ssd_maps_blocked, pieces, WEIGHT_SETS[weights], rows=rows, reduce=reduce)
        assert torch.isfinite(out).all()
        assert relative_error(out, ref) <= 1e-5


@pytest.mark.parametrize("weights", ["hidden", "all"])
def test_blocked_default_tiles_long_sequence(weights):
    """Ragged multi-tile run with the production tile size (300 = 2·128 + 44)."""
    pieces = make_inputs(300, groups=2, seed=3)
    for reduce in ("mean", "abs_mean"):
        ref = call(ssd_maps_naive, pieces, WEIGHT_SETS[weights], dtype=torch.float64, reduce=reduce)
        out = call(ssd_maps_blocked, pieces, WEIGHT_SETS[weights], reduce=reduce)
        assert relative_error(out, ref) <= 1e-5


def test_rows_select_rows_of_the_full_map(small_blocks):
    pieces = make_inputs(23, seed=5)
    rows = torch.tensor([22, 3, 3, 0, 11])
    for fn in IMPLEMENTATIONS.values():
        for reduce in ("mean", None):
            full = call(fn, pieces, reduce=reduce)
            picked = call(fn, pieces, rows=rows, reduce=reduce)
            torch.testing.assert_close(picked, full[..., rows, :], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------------
# Independent references


@pytest.mark.parametrize("fn", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
def test_hand_computed_two_tokens(fn):
    # one head, one group, N = 1: alpha = [[c0 b0 d0, 0], [c1 b0 exp(a d1) d0, c1 b1 d1]]
    delta = torch.tensor([[[0.5], [2.0]]])  # (1, 2, 1)
    A = torch.tensor([-1.0])
    B = torch.tensor([2.0, 3.0]).view(1, 2, 1, 1)
    C = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    alpha = torch.tensor([[1.0, 0.0], [-math.exp(-2.0), -6.0]])
    torch.testing.assert_close(fn(delta, A, B, C, reduce=None), alpha.view(1, 1, 2, 2))
    torch.testing.assert_close(fn(delta, A, B, C, reduce="mean"), alpha.view(1, 2, 2))

    # P = 1, K = 2: H = diag(row) · alpha · diag(col) · M with M = [[w1, 0], [w0, w1]]
    row = torch.tensor([2.0, 3.0]).view(1, 2, 1, 1)
    col = torch.tensor([1.0, 0.5]).view(1, 2, 1, 1)
    conv = torch.tensor([0.25, 1.0]).view(1, 1, 2)  # (w0, w1)
    # alpha·diag(col) = [[1, 0], [-e^-2, -3]]; ·M = [[1, 0], [-e^-2 - 0.75, -3]]; diag(row)· = below
    expected = torch.tensor([[2.0, 0.0], [3 * (-math.exp(-2.0) - 0.75), -9.0]])
    out = fn(delta, A, B, C, row_weight=row, col_weight=col, conv_weight=conv, reduce=None)
    torch.testing.assert_close(out, expected.view(1, 1, 2, 2))
    out = fn(delta, A, B, C, row_weight=row, col_weight=col, conv_weight=conv, rows=torch.tensor([1]), reduce="sum")
    torch.testing.assert_close(out, expected[1].view(1, 1, 2))


def test_naive_hidden_maps_match_a_sequential_scan():
    """Column s of alpha_h is the scan's response to a unit impulse at token s."""
    length, groups = 9, 2
    pieces = make_inputs(length, groups, dtype=torch.float64, seed=11)
    delta, A, B, C = (pieces[name] for name in ("delta", "A", "B", "C"))
    group_of_head = torch.arange(HEADS) // (HEADS // groups)
    B_heads, C_heads = B[:, :, group_of_head], C[:, :, group_of_head]  # (B, L, H, N)
    impulses = torch.eye(length, dtype=torch.float64)  # impulses[t, s] = x_t for the impulse at s
    state = torch.zeros(BATCH, HEADS, STATE, length, dtype=torch.float64)  # one state per impulse position s
    responses = torch.zeros(BATCH, HEADS, length, length, dtype=torch.float64)
    for t in range(length):  # h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t,  y_t = C_t · h_t
        decay = torch.exp(delta[:, t] * A)[:, :, None, None]
        inject = (delta[:, t, :, None] * B_heads[:, t])[..., None] * impulses[t]
        state = decay * state + inject
        responses[:, :, t] = torch.einsum("bhn,bhns->bhs", C_heads[:, t], state)
    maps = ssd_maps_naive(delta, A, B, C, reduce=None)
    torch.testing.assert_close(maps, responses, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("fn", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
def test_conv_identity(fn, dtype):
    """H_c x_c == row ⊙ alpha_h (col ⊙ conv(x)) with conv = F.conv1d depthwise, causal, bias-free."""
    length, groups = 17, 2
    channels = HEADS * HEAD_DIM
    pieces = make_inputs(length, groups, dtype=dtype, seed=13)
    x = torch.randn(BATCH, length, channels, generator=torch.Generator().manual_seed(17), dtype=dtype)
    conv_weight = pieces["conv_weight"].reshape(channels, 1, TAPS)
    conv_x = F.conv1d(x.transpose(1, 2), conv_weight, padding=TAPS - 1, groups=channels)[..., :length]
    gated = pieces["col_weight"] * conv_x.transpose(1, 2).reshape(BATCH, length, HEADS, HEAD_DIM)
    alpha = call(ssd_maps_naive, pieces, (), reduce=None)  # (B, H, L, L)
    expected = pieces["row_weight"] * torch.einsum("bhij,bjhp->bihp", alpha, gated)

    maps = call(fn, pieces, reduce=None)  # (B, H·P, L, L), channel c = h·P + p
    out = torch.einsum("bcis,bsc->bic", maps, x).reshape(BATCH, length, HEADS, HEAD_DIM)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert relative_error(out, expected) <= tolerance


# ---------------------------------------------------------------------------------------------------------------
# dtypes, reductions, dispatch, memory, validation


@pytest.mark.parametrize("weights", ["hidden", "all"])
@pytest.mark.parametrize("fn", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
def test_float64_in_float64_out_and_mean_of_channels(small_blocks, fn, weights):
    pieces = make_inputs(12, dtype=torch.float64, seed=19)
    per_channel = call(fn, pieces, WEIGHT_SETS[weights], reduce=None)
    assert per_channel.dtype == torch.float64
    for reduce, reduced in (("mean", per_channel.mean(1)), ("sum", per_channel.sum(1)),
                            ("abs_mean", per_channel.abs().mean(1))):
        out = call(fn, pieces, WEIGHT_SETS[weights], reduce=reduce)
        assert out.dtype == torch.float64
        assert relative_error(out, reduced) <= 1e-6


def test_dispatcher_uses_blocked():
    pieces = make_inputs(10, seed=23)
    assert set(ssd.__all__) >= {"ssd_maps", "ssd_maps_blocked", "ssd_maps_naive"}
    torch.testing.assert_close(call(ssd_maps, pieces, rows=torch.tensor([9, 2])),
                               call(ssd_maps_blocked, pieces, rows=torch.tensor([9, 2])), rtol=0, atol=0)


class LargestStorage(TorchDispatchMode):
    """Records the largest storage (in elements) of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.untyped_storage().nbytes() // leaf.element_size())
        return out


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_blocked_channel_sum_never_builds_a_channel_stack(monkeypatch, reduce):
    length, heads, head_dim = 64, 4, 8
    monkeypatch.setattr(blocked_module, "TILE_SIZE", 16)
    pieces = make_inputs(length, groups=1, heads=heads, head_dim=head_dim, seed=29)
    one_head_stack = head_dim * length * length  # far below the (B, H·P, L, L) a naive version needs
    with LargestStorage() as probe:
        call(ssd_maps_blocked, pieces, reduce=reduce)
    assert probe.largest < one_head_stack
    with LargestStorage() as probe:  # the probe does see such stacks
        call(ssd_maps_naive, pieces, reduce=reduce)
    assert probe.largest >= heads * head_dim * length * length


def _bad_inputs():
    good = make_inputs(6, groups=2)
    cases = {
        "unknown reduce": (good, {"reduce": "max"}, "reduce"),
        "delta not 3-D": ({**good, "delta": good["delta"][0]}, {}, "delta"),
        "A wrong size": ({**good, "A": good["A"][:3]}, {}, "A must be"),
        "C shape": ({**good, "C": good["C"][:, :5]}, {}, "C must"),
        "B not 4-D": ({**good, "B": good["B"][..., 0]}, {}, "B must"),
        "heads not a multiple of groups": ({**good, "B": torch.zeros(BATCH, 6, 3, STATE),
                                            "C": torch.zeros(BATCH, 6, 3, STATE)}, {}, "multiple"),
        "row weight shape": ({**good, "row_weight": good["row_weight"][:, :, :2]}, {}, "row_weight"),
        "head dim mismatch": ({**good, "conv_weight": torch.zeros(HEADS, HEAD_DIM + 1, TAPS)}, {}, "P ="),
        "dtype mismatch": ({**good, "A": good["A"].double()}, {}, "dtype"),
        "rows out of range": (good, {"rows": torch.tensor([0, 6])}, "rows"),
        "rows not integer": (good, {"rows": torch.tensor([0.0, 1.0])}, "rows"),
    }
    return [pytest.param(pieces, kwargs, match, id=name) for name, (pieces, kwargs, match) in cases.items()]


@pytest.mark.parametrize("fn", IMPLEMENTATIONS.values(), ids=IMPLEMENTATIONS.keys())
@pytest.mark.parametrize("pieces, kwargs, match", _bad_inputs())
def test_bad_inputs_raise_value_error(fn, pieces, kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(fn, pieces, **kwargs)
