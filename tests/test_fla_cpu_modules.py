"""The torch versions of fla's fused modules (mamba_captum.fla_cpu.modules) against fla's own torch references
(``*_ref``) and hand-computed cases, in float64; and the swap machinery (mamba_captum.fla_cpu.swaps): installed only
inside ``fla_on_cpu()``, per thread, for CPU tensors, restored on exit; a moved signature refuses the swap."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from fla.modules import layernorm as fla_layernorm
from fla.modules import rotary as fla_rotary
from fla.modules import token_shift as fla_token_shift
from fla.modules.norm import layernorm_gated as fla_layernorm_gated

import mamba_captum as mc
from mamba_captum.fla_cpu import SWAPS, modules, refused_swaps, signature_gap, usable
from mamba_captum.fla_cpu.swaps import FlaSwap

torch.manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norms_equal_fla_references(is_rms_norm, with_residual):
    x, weight, bias = rand(2, 5, 8), rand(8), rand(8)
    residual = rand(2, 5, 8) if with_residual else None
    reference = (fla_layernorm.rms_norm_ref if is_rms_norm else fla_layernorm.layer_norm_ref)(
        x, weight, bias, residual=residual, eps=1e-5, prenorm=True)
    ours = modules.layer_norm(x, weight, bias, residual=residual, eps=1e-5, prenorm=True, is_rms_norm=is_rms_norm)
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], reference[1], rtol=1e-12, atol=1e-12)


def test_group_norm_equals_fla_reference():
    x, weight, bias = rand(3, 12), rand(12), rand(12)
    reference = fla_layernorm.group_norm_ref(x, weight, bias, num_groups=3, eps=1e-5)
    torch.testing.assert_close(modules.group_norm(x, weight, bias, eps=1e-5, num_groups=3), reference,
                               rtol=1e-12, atol=1e-12)


def test_gated_rms_norm_is_norm_then_swish_gate():
    x, g, weight = rand(2, 4, 6), rand(2, 4, 6), rand(6).float().double()  # fla's reference casts the weight
    expected = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight * F.silu(g)
    torch.testing.assert_close(modules.rms_norm_gated(x, g, weight, None), expected, rtol=1e-12, atol=1e-12)
    reference = fla_layernorm_gated.rms_norm_ref(x, weight, None, z=g, eps=1e-6, norm_before_gate=True,
                                                   upcast=False)
    torch.testing.assert_close(modules.rms_norm_gated(x, g, weight, None), reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_grouped_gated_rms_norm_equals_fla_reference(norm_before_gate):
    x, z, weight = rand(2, 3, 8), rand(2, 3, 8), rand(8).float().double()  # fla's reference casts the weight
    reference = fla_layernorm_gated.rms_norm_ref(x, weight, None, z=z, eps=1e-6, group_size=4,
                                                 norm_before_gate=norm_before_gate, upcast=False)
    torch.testing.assert_close(modules.rmsnorm_fn(x, weight, None, z=z, group_size=4,
                                                  norm_before_gate=norm_before_gate), reference,
                               rtol=1e-12, atol=1e-12)


def test_l2norm_keeps_eps_inside_the_root():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    torch.testing.assert_close(modules.l2norm(x, eps=11.0), x / 6.0)


def test_token_shift_equals_fla_reference_plain_and_packed():
    x = rand(2, 6, 4)
    torch.testing.assert_close(modules.token_shift(x), fla_token_shift.token_shift_ref(x))
    packed, cu = rand(1, 9, 4), torch.tensor([0, 4, 5, 9])
    torch.testing.assert_close(modules.token_shift(packed, cu_seqlens=cu),
                               fla_token_shift.token_shift_ref(packed, cu_seqlens=cu))
    out, last = modules.token_shift(x, cache=x[:, -1], output_cache=True)
    torch.testing.assert_close(out[:, 0], x[:, -1] - x[:, 0])
    torch.testing.assert_close(last, x[:, -1])


@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv_equals_conv1d_and_continues_from_its_state(activation):
    x, weight, bias = rand(2, 9, 5), rand(5, 4), rand(5)
    y, state = modules.causal_conv1d(x, weight, bias, activation=activation, output_final_state=True)
    expected = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), weight[:, None], bias, groups=5).transpose(1, 2)
    expected = expected if activation is None else F.silu(expected)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    first, mid = modules.causal_conv1d(x[:, :4], weight, bias, activation=activation, output_final_state=True)
    second, end = modules.causal_conv1d(x[:, 4:], weight, bias, activation=activation, initial_state=mid,
                                         output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(end, state)
    cache = mid.clone()  # one decoding step at a time continues the same way
    step, _ = modules.causal_conv1d_update(x[:, 4:5], cache, weight=weight, bias=bias, activation=activation)
    torch.testing.assert_close(step, y[:, 4:5], rtol=1e-12, atol=1e-12)
    packed, _ = modules.causal_conv1d(torch.cat([x[:1], x[1:]], 1), weight, bias, activation=activation,
                                      cu_seqlens=torch.tensor([0, 9, 18]))
    torch.testing.assert_close(packed, torch.cat([y[:1], y[1:]], 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_equals_fla_reference(interleaved):
    x = rand(2, 7, 3, 8)
    angles = torch.arange(7, dtype=torch.float64)[:, None] * rand(3).abs()[None]
    cos, sin = angles.cos(), angles.sin()
    reference = fla_rotary.rotary_embedding_ref(x, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(modules.rotary_embedding(x, cos, sin, interleaved=interleaved), reference,
                               rtol=1e-12, atol=1e-12)


def test_cross_entropy_with_ignored_rows_and_z_loss():
    logits, target = rand(5, 7), torch.tensor([1, -100, 3, 0, 6])
    loss, z_loss = modules.cross_entropy_loss(logits, target, lse_square_scale=0.1)
    lse = torch.logsumexp(logits, -1)
    expected = F.cross_entropy(logits, target, reduction="none") + 0.1 * lse.square() * (target != -100)
    torch.testing.assert_close(loss, expected)
    assert z_loss[1] == 0


def in_a_fresh_thread(function):
    """``function()`` in a thread of its own: outside every fla_on_cpu() (the test session holds one on the main
    thread, tests/conftest.py). Returns what it returned, or the name of what it raised."""
    seen = {}

    def run():
        try:
            seen["outcome"] = function()
        except Exception as error:  # noqa: BLE001 (Triton without a GPU fails; the point is that it was called)
            seen["outcome"] = type(error).__name__

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen["outcome"]


def test_a_swap_is_installed_where_fla_holds_the_function_and_undone_by_the_last_user():
    import fla.modules.token_shift as where
    from mamba_captum.fla_cpu.swaps import SwapSet

    original = where.token_shift_ref

    def doubled(x, cu_seqlens=None):
        return 2 * original(x, cu_seqlens)

    swaps = SwapSet(lambda: [FlaSwap("fla.modules.token_shift", "token_shift_ref", doubled)])
    x = rand(1, 4, 2)
    with swaps.entered(False):
        with swaps.entered(False):  # nested users share one installation
            assert where.token_shift_ref is not original
            torch.testing.assert_close(where.token_shift_ref(x), 2 * original(x))
            # another thread is not inside: fla's own function
            torch.testing.assert_close(in_a_fresh_thread(lambda: where.token_shift_ref(x)), original(x))
        assert where.token_shift_ref is not original  # the outer user is still inside
    assert where.token_shift_ref is original


def test_the_session_context_swaps_for_its_thread_only():
    import fla.modules.norm.layernorm as where
    x, weight = rand(2, 3), rand(3)
    with mc.fla_on_cpu():
        torch.testing.assert_close(where.rms_norm(x, weight, None), modules.rms_norm(x, weight, None))
        assert in_a_fresh_thread(lambda: where.rms_norm(x, weight, None)) == "RuntimeError"  # Triton, no GPU


def test_every_swap_takes_every_parameter_of_the_installed_fla():
    good, bad = usable(SWAPS())
    assert bad == {}, bad
    with mc.fla_on_cpu():
        assert refused_swaps() == {}


def test_a_moved_signature_is_refused():
    def fla_function(x, weight, new_option=None):  # fla gained a parameter
        return x

    def ours(x, weight):
        return x

    assert signature_gap(fla_function, ours) == ["new_option"]
    assert usable([FlaSwap("fla.modules.norm.layernorm", "no_such_function", ours)])[1] == {
        "fla.modules.norm.layernorm.no_such_function": ["<absent>"]}


def test_bad_devices_argument_is_refused():
    with pytest.raises(ValueError, match="devices"):
        with mc.fla_on_cpu(devices="gpu"):
            pass


def test_every_op_probe_passes_and_a_wrong_op_is_not_swapped():
    from mamba_captum.fla_cpu import ops
    from mamba_captum.fla_cpu.checks import PROBES, FlaSwapMismatchWarning, check_swaps, probe_difference

    swaps = {swap.key: swap for swap in SWAPS()}
    assert set(PROBES) <= set(swaps)
    for key in PROBES:
        assert probe_difference(key, swaps[key].replacement) <= 1e-5, key

    def off_by_a_scale(*args, **kwargs):  # what a changed default scale in a new fla release would look like
        o, state = ops.chunk_gla(*args, **kwargs)
        return o * 1.01, state

    wrong = FlaSwap("fla.ops.gla.chunk", "chunk_gla", off_by_a_scale)
    with pytest.warns(FlaSwapMismatchWarning, match="chunk_gla"):
        assert check_swaps([wrong, swaps["fla.ops.gla.chunk.chunk_gla"]]) == [swaps["fla.ops.gla.chunk.chunk_gla"]]


def test_an_activation_kept_in_an_attribute_runs_in_torch_inside_and_fla_outside():
    from fla.modules.activations import ACT2FN

    act = ACT2FN["swish"]  # what a layer keeps at construction (Mamba.act, a gate_fn)
    x = rand(3, 4).requires_grad_()
    with mc.fla_on_cpu():
        y = act(x)
    torch.testing.assert_close(y, torch.nn.functional.silu(x))
    (grad,) = torch.autograd.grad(y.sum(), x)  # the backward, after the context closed
    torch.testing.assert_close(grad, torch.autograd.grad(torch.nn.functional.silu(x).sum(), x)[0])
    # outside fla_on_cpu(): fla's own (Triton) kernel, which a CPU cannot run
    assert isinstance(in_a_fresh_thread(lambda: act(x.detach())), str)
