"""The gradient × operator pieces: contributions Σ_c g_c[i] H_c[i,j] x_c[j] and operator-output gradients."""
import pytest
import torch
from conftest import relative_error
from test_identities import liven, padded_batch, zero_bias_and_skip
from tiny_models import CONFIGS, make_model

import mamba_captum as mc
from mamba_captum.operators import SelectiveOperator, SoftmaxOperator, SSDOperator, SumOperator

TOL = 1e-5


def leaf_operators(operators):
    for key, op in operators.items():
        for part in ([p for _, p in op.parts] if isinstance(op, SumOperator) else [op]):
            yield key, part


def per_channel_contributions(op, grad):
    """The direct formula from the per-channel maps (reduce=None)."""
    maps = op.maps(reduce=None).double()  # (B, C, L, L)
    grad, values = grad.double(), op.values.double()
    if isinstance(op, SoftmaxOperator):  # maps per head; grad (B, L, H, d), values (B, H, L, d)
        return torch.einsum("bihd,bhij,bhjd->bij", grad, maps, values)
    if isinstance(op, SSDOperator) and not op.per_channel:  # hidden: one map per head, shared by its P channels
        return torch.einsum("bihp,bhij,bjhp->bij", grad, maps, values)
    return torch.einsum("bic,bcij,bjc->bij", grad.flatten(2), maps, values.flatten(2))


@pytest.mark.parametrize("formulation", ["unified", "hidden"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_contributions_equal_the_per_channel_formula(family, formulation):
    model = liven(make_model(family))
    ids, mask = padded_batch(length=10)
    operators, _, _ = mc.build_operators(model, ids, mask, formulation=formulation)
    for key, op in leaf_operators(operators):
        grad = torch.randn_like(op.output)
        got = op.contributions(grad)
        assert got.shape == (2, 10, 10)
        assert relative_error(got, per_channel_contributions(op, grad)) < TOL, (family, key)
        rows = torch.tensor([9, 4])
        assert relative_error(op.contributions(grad, rows=rows), got[:, rows]) < TOL


@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_h1"])
def test_ablated_operators_use_the_same_formula(family):
    model = liven(make_model(family))
    ids, mask = padded_batch(length=9)
    for components in (["gate", "act", "conv", "norm"], ["s6", "act"], ["s6", "gate", "norm"]):
        operators, _, _ = mc.build_operators(model, ids, mask, components=components)
        for key, op in leaf_operators(operators):
            if isinstance(op, SoftmaxOperator):
                continue
            grad = torch.randn_like(op.output)
            assert relative_error(op.contributions(grad), per_channel_contributions(op, grad)) < TOL, components


@pytest.mark.parametrize("formulation", ["unified", "hidden"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_rows_of_contributions_sum_to_the_first_order_term(family, formulation):
    """With the conv bias and D at 0 the operator output is exactly H x, so Σ_j contributions[i, j] = g[i]·y[i]."""
    model = zero_bias_and_skip(liven(make_model(family)))
    ids, mask = padded_batch(length=10)
    operators, _, _ = mc.build_operators(model, ids, mask, formulation=formulation)
    for key, op in leaf_operators(operators):
        grad = torch.randn_like(op.output)
        first_order = (grad * op.output).flatten(2).sum(-1) * mask
        assert relative_error(op.contributions(grad).sum(-1), first_order) < TOL, (family, key)


@pytest.mark.parametrize("formulation", ["unified", "hidden"])
@pytest.mark.parametrize("family", ["mamba", "mamba2", "bamba", "falcon_h1"])
def test_readout_reproduces_the_mixer_output_and_its_gradient(family, formulation):
    """readout(output) is the mixer output, and operator_output_grad is autograd through the real mixer."""
    model = liven(make_model(family))
    ids, mask = padded_batch(length=8)
    operators, _, _ = mc.build_operators(model, ids, mask, formulation=formulation)
    trace_outputs = {}
    handles = [m.register_forward_hook(lambda mod, a, out, m=m: trace_outputs.__setitem__(m, out))
               for m in model.modules() if type(m).__name__ in mc.SUPPORTED_MIXERS]
    with torch.no_grad():
        model(ids, attention_mask=mask)
    for h in handles:
        h.remove()
    real = [out for out in trace_outputs.values()]
    ssm = [op for _, op in leaf_operators(operators) if isinstance(op, (SelectiveOperator, SSDOperator))]
    assert len(ssm) == len(real)
    for op, out in zip(ssm, real):
        assert relative_error(op.readout(op.output.double()), out) < TOL
        grad_out = torch.randn_like(out)
        y = op.output.double().requires_grad_()
        (expected,) = torch.autograd.grad(op.readout(y), y, grad_out)
        assert relative_error(mc.operators.operator_output_grad(op, grad_out), expected) < 1e-12
