"""The delta rule with states (kernels.delta_rule: recurrent and chunked_states) as a stand-in for
flash-linear-attention 0.6.0's delta-rule ops: the per-token recurrence equals fla's torch references
(``fla/ops/{delta_rule,gated_delta_rule,kda}/naive.py``) with initial and final states; the chunked WY form equals
the recurrence in outputs, final states and the gradients of every input, for no decay, one decay per head and one
per key channel, strong decays included; and it agrees with the existing ``delta_rule_output_chunked``.

fla's references cast to float32; they are run here in float64 (:class:`Float64`) so that the comparisons are exact
to rounding. Their ``naive.py`` files are loaded by path from the installed fla package: ``import fla`` imports its
layers and models (about 7 s) and the references need only torch and einops."""
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from torch.overrides import TorchFunctionMode

from mamba_captum.kernels.delta_rule import (delta_rule_chunked_states, delta_rule_output_chunked,
                                             delta_rule_recurrent)

FLA_ROOT = Path(importlib.util.find_spec("fla").origin).parent  # the package is located, not imported
EXACT = 1e-12  # float64 against float64, relative to the largest entry


def fla_naive(op: str):
    """fla's ``fla/ops/<op>/naive.py`` module."""
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", FLA_ROOT / "ops" / op / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Float64(TorchFunctionMode):
    """While active, casts to float32 (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float32``) give float64:
    fla's references then run their own code in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def make_inputs(decay, *, batch=2, length=37, heads=2, value_heads=None, dim=5, value_dim=3, strength=1.0, seed=0):
    """float64 (q, k, v, beta, log_decay, initial_state): keys l2-normalised, beta in (0, 1), log decays uniform in
    (−strength, 0]; decay None, "head" (B, L, HV) or "channel" (B, L, HV, K)."""
    gen = torch.Generator().manual_seed(seed)
    value_heads = value_heads or heads
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q = randn(batch, length, heads, dim)
    k = F.normalize(randn(batch, length, heads, dim), dim=-1)
    v = randn(batch, length, value_heads, value_dim)
    beta = torch.rand(batch, length, value_heads, generator=gen, dtype=torch.float64)
    decay_shape = {None: None, "head": (batch, length, value_heads), "channel": (batch, length, value_heads, dim)}
    shape = decay_shape[decay]
    log_decay = None if shape is None else -strength * torch.rand(*shape, generator=gen, dtype=torch.float64)
    initial_state = randn(batch, value_heads, dim, value_dim)
    return q, k, v, beta, log_decay, initial_state


def test_recurrent_equals_fla_delta_rule_recurrence():
    q, k, v, beta, _, state = make_inputs(None)
    head_first = lambda x: x.transpose(1, 2)  # noqa: E731  fla's delta_rule_recurrence takes (B, H, L, ·)
    with Float64():
        expected, expected_state = fla_naive("delta_rule").delta_rule_recurrence(
            head_first(q), head_first(k), head_first(v), head_first(beta), initial_state=state,
            output_final_state=True)
    assert expected.dtype == expected_state.dtype == torch.float64
    output, final = delta_rule_recurrent(q, k, v, beta, initial_state=state, output_final_state=True)
    assert relative_error(output, head_first(expected)) <= EXACT
    assert relative_error(final, expected_state) <= EXACT


@pytest.mark.parametrize("scale", [None, 0.7])
def test_recurrent_equals_fla_gated_delta_rule(scale):
    q, k, v, beta, g, state = make_inputs("head", strength=2.0)
    with Float64():
        expected, expected_state = fla_naive("gated_delta_rule").naive_recurrent_gated_delta_rule(
            q, k, v, beta, g, scale=scale, initial_state=state, output_final_state=True)
    assert expected.dtype == torch.float64
    output, final = delta_rule_recurrent(q, k, v, beta, g, scale=scale, initial_state=state, output_final_state=True)
    assert relative_error(output, expected) <= EXACT and relative_error(final, expected_state) <= EXACT
    assert delta_rule_recurrent(q, k, v, beta, g, scale=scale, initial_state=state)[1] is None


def test_recurrent_equals_fla_kda_with_grouped_value_heads():
    # one decay per key channel; four value heads read two query / key heads (fla's GVA)
    q, k, v, beta, g, state = make_inputs("channel", heads=2, value_heads=4)
    with Float64():
        expected, expected_state = fla_naive("kda").naive_recurrent_kda(
            q, k, v, g, beta, scale=0.4, initial_state=state, output_final_state=True)
    assert expected.dtype == torch.float64
    output, final = delta_rule_recurrent(q, k, v, beta, g, scale=0.4, initial_state=state, output_final_state=True)
    assert output.shape == v.shape and final.shape == state.shape
    assert relative_error(output, expected) <= EXACT and relative_error(final, expected_state) <= EXACT
    chunked, chunked_final = delta_rule_chunked_states(q, k, v, beta, g, scale=0.4, initial_state=state,
                                                       output_final_state=True, chunk_size=8)
    assert relative_error(chunked, expected) <= EXACT and relative_error(chunked_final, expected_state) <= EXACT


def outputs_and_gradients(function, inputs, projections):
    """(o, final state, gradients of ⟨o, P_o⟩ + ⟨S, P_S⟩ w.r.t. every tensor input)."""
    inputs = [None if x is None else x.clone().requires_grad_() for x in inputs]
    q, k, v, beta, g, state = inputs
    output, final = function(q, k, v, beta, g, initial_state=state, output_final_state=True)
    loss = (output * projections[0]).sum() + (final * projections[1]).sum()
    leaves = [x for x in inputs if x is not None]
    return (output, final, *torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("decay", [None, "head", "channel"])
@pytest.mark.parametrize("chunk_size", [1, 8, 16, 64, None])
def test_chunked_equals_recurrent_with_gradients(decay, chunk_size):
    # L = 37: the last chunk is partial (and the only one for C = 64); None: the default sizes (64, 8 per channel)
    inputs = make_inputs(decay)
    gen = torch.Generator().manual_seed(1)
    projections = (torch.randn(inputs[2].shape, generator=gen, dtype=torch.float64),
                   torch.randn(inputs[5].shape, generator=gen, dtype=torch.float64))
    expected = outputs_and_gradients(delta_rule_recurrent, inputs, projections)
    chunked = lambda *a, **kw: delta_rule_chunked_states(*a, chunk_size=chunk_size, **kw)  # noqa: E731
    got = outputs_and_gradients(chunked, inputs, projections)
    assert len(got) == len(expected) == (8 if decay else 7)
    for name, actual, reference in zip(["o", "final state", "dq", "dk", "dv", "dbeta", "d decay", "d state"]
                                       if decay else ["o", "final state", "dq", "dk", "dv", "dbeta", "d state"],
                                       got, expected):
        assert actual.shape == reference.shape and relative_error(actual, reference) <= EXACT, name


@pytest.mark.parametrize("decay", ["head", "channel"])
def test_chunked_is_stable_for_strong_decays(decay):
    # log decays down to −30 per token: e^{Γ} over a chunk of 16 reaches e^{−480}, far below float64's range
    inputs = make_inputs(decay, strength=30.0, length=40)
    gen = torch.Generator().manual_seed(2)
    projections = (torch.randn(inputs[2].shape, generator=gen, dtype=torch.float64),
                   torch.randn(inputs[5].shape, generator=gen, dtype=torch.float64))
    expected = outputs_and_gradients(delta_rule_recurrent, inputs, projections)
    chunked = lambda *a, **kw: delta_rule_chunked_states(*a, chunk_size=16, **kw)  # noqa: E731
    for actual, reference in zip(outputs_and_gradients(chunked, inputs, projections), expected):
        assert torch.isfinite(actual).all() and relative_error(actual, reference) <= EXACT
    # float32 too: no overflow, no ∞ · 0
    single = [None if x is None else x.float() for x in inputs]
    output, final = delta_rule_chunked_states(*single[:5], initial_state=single[5], output_final_state=True,
                                              chunk_size=16)
    assert torch.isfinite(output).all() and relative_error(output, expected[0]) <= 1e-5
    assert relative_error(final, expected[1]) <= 1e-5


@pytest.mark.parametrize("decay", [None, "head", "channel"])
def test_existing_output_chunked_agrees_for_a_zero_initial_state(decay):
    q, k, v, beta, g, _ = make_inputs(decay)
    scale = q.shape[-1] ** -0.5
    # delta_rule_output_chunked takes q already scaled and always a decay
    existing = delta_rule_output_chunked(q * scale, k, beta, torch.zeros_like(beta) if g is None else g, v,
                                         chunk_size=16)
    output, _ = delta_rule_chunked_states(q, k, v, beta, g, chunk_size=8)
    assert relative_error(output, existing) <= EXACT
    zero = torch.zeros(*v.shape[:1], v.shape[2], q.shape[-1], v.shape[-1], dtype=torch.float64)
    assert relative_error(delta_rule_chunked_states(q, k, v, beta, g, initial_state=zero, chunk_size=8)[0],
                          existing) <= EXACT


@pytest.mark.parametrize("function", [delta_rule_recurrent, delta_rule_chunked_states])
def test_final_state_carries_the_sequence_on(function):
    # the state after the first 20 tokens, as initial state of the last 17, gives the whole sequence's outputs
    q, k, v, beta, g, state = make_inputs("head")
    whole, whole_final = function(q, k, v, beta, g, initial_state=state, output_final_state=True)
    first = [x[:, :20] for x in (q, k, v, beta, g)]
    second = [x[:, 20:] for x in (q, k, v, beta, g)]
    head, middle = function(*first, initial_state=state, output_final_state=True)
    tail, final = function(*second, initial_state=middle, output_final_state=True)
    assert relative_error(torch.cat([head, tail], dim=1), whole) <= EXACT
    assert relative_error(final, whole_final) <= EXACT


def test_float32_follows_float64():
    q, k, v, beta, g, state = make_inputs("head", length=200, dim=16, value_dim=8)
    expected, expected_final = delta_rule_recurrent(q, k, v, beta, g, initial_state=state, output_final_state=True)
    single = [x.float() for x in (q, k, v, beta, g)]
    output, final = delta_rule_chunked_states(*single, initial_state=state.float(), output_final_state=True)
    assert output.dtype == final.dtype == torch.float32
    assert relative_error(output, expected) <= 1e-5 and relative_error(final, expected_final) <= 1e-5


def test_shapes_are_checked():
    q, k, v, beta, g, state = make_inputs("head")
    for function in (delta_rule_recurrent, delta_rule_chunked_states):
        with pytest.raises(ValueError, match="beta"):
            function(q, k, v, beta[..., :1], g)
        with pytest.raises(ValueError, match="log_decay"):
            function(q, k, v, beta, g[:, :-1])
        with pytest.raises(ValueError, match="initial_state"):
            function(q, k, v, beta, g, initial_state=state[:, :, :-1])
