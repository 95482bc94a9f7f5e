"""flash-linear-attention's linear layers (mamba_captum.families.fla_*), run on CPU through fla_on_cpu(): the
unified operator reproduces the layer (y = H x against the test's own hooks on the value projection and o_proj),
the hidden maps equal an impulse reference through fla's own naive op (one-hot values through the op's recorded
inputs), batches equal single examples, left padding equals no padding, and nothing is left on the model."""
from __future__ import annotations

import pytest
import torch
from conftest import relative_error
from fla_models import (FLA_SPECS, OpRecorder, assert_batch_equals_single_examples, fla_mixers, make_fla_model,
                        padded_batch, run_hooked)
from test_engine import assert_untouched, model_state

import mamba_captum as mc
FLA = list(FLA_SPECS)


def unified_records(name, model, ids, mask):
    """(x: the values before any conv (B, L, H·P), o_proj's input (B, L, H·P)) of each mixer, by the test's hooks."""
    records, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.get_submodule(FLA_SPECS[name]["values"]).register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=out.detach())))
        handles.append(mixer.o_proj.register_forward_pre_hook(
            lambda mod, args, mixer=mixer: records.setdefault(mixer, {}).update(out_in=args[0].detach())))
    run_hooked(model, ids, mask, handles)
    return records


def head_operators(model, ids, mask, formulation):
    operators, _, _ = mc.build_operators(model, ids, mask, formulation=formulation)
    return list(operators.values())


@pytest.mark.parametrize("name", FLA)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unified_identity_out_proj_input_equals_H_x(name, dtype):
    model = make_fla_model(name, dtype)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    operators = head_operators(model, ids, mask, "unified")
    records = unified_records(name, model, ids, mask)
    mixers = fla_mixers(model)
    assert len(operators) == len(mixers) > 0
    for mixer, op in zip(mixers, operators):
        real_rows = mask.bool()
        # fla unpads the batch: the hooks see the real tokens packed as (1, T_real, ·)
        x = torch.zeros(*ids.shape, records[mixer]["x"].shape[-1], dtype=torch.float64)
        x[real_rows] = records[mixer]["x"].double().reshape(-1, x.shape[-1])
        expected = torch.zeros_like(x)
        expected[real_rows] = records[mixer]["out_in"].double().reshape(-1, x.shape[-1])
        H = op.maps(reduce=None).double()  # (B, C, L, L)
        got = torch.einsum("bcis,bsc->bic", H, x)
        assert relative_error(got, expected) <= (1e-5 if dtype == torch.float64 else 3e-5), name
        assert expected.abs().max() > 1e-3
    assert_untouched(model, before)


@pytest.mark.parametrize("name", FLA)
def test_hidden_maps_equal_the_naive_op_impulse_response(name):
    model = make_fla_model(name, torch.float64)
    ids = padded_batch(length=10)[0]
    spec = FLA_SPECS[name]
    with mc.fla_on_cpu(), OpRecorder(model, spec["ops"]) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators = head_operators(model, ids, None, "hidden")
    assert len(recorder.calls) == len(operators) > 0
    for op, (op_name, kwargs, out) in zip(operators, recorder.calls):
        alpha = op.maps(reduce=None)  # (B, H, L, L): one map per head
        reference = spec["impulse"](kwargs)
        assert relative_error(alpha, reference) <= 1e-6, (name, op_name)
        got = torch.einsum("bhts,bshp->bthp", alpha, kwargs[spec["value_key"]].double())
        assert relative_error(got, out.double()) <= 1e-6


@pytest.mark.parametrize("name", FLA)
def test_batch_equals_single_examples_and_left_padding_equals_none(name):
    model = make_fla_model(name, torch.float64)
    assert_batch_equals_single_examples(model, *padded_batch(length=12))


def test_the_library_enters_fla_on_cpu_by_itself():
    """In a thread of its own (outside the test session's fla_on_cpu(), tests/conftest.py): the model's own forward
    reaches fla's Triton kernels and fails on a CPU; the library's calls run."""
    import threading

    model = make_fla_model("gla", torch.float64)
    ids = padded_batch(length=10)[0]
    outcome = {}

    def in_a_fresh_thread():
        try:
            model(input_ids=ids)
            outcome["plain forward"] = "ran"
        except Exception as error:  # noqa: BLE001 (Triton without a GPU: its own error)
            outcome["plain forward"] = type(error).__name__
        outcome["maps"] = mc.implicit_attention(model, ids)

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    assert outcome["plain forward"] != "ran"
    assert set(outcome["maps"]) == {0, 1} and outcome["maps"][0].shape == (2, 10, 10)


def test_a_gap_in_the_mask_is_named_and_the_librarys_own_hooks_are_not_blamed():
    """fla packs a padded batch into sequences, so a 0 between real tokens is dropped, not run as a zeroed token: the
    rebuild cannot follow it and says why (and not that the user's hooks might: the capture's own are not theirs)."""
    from mamba_captum.verification import ReconstructionError

    model = make_fla_model("gla", torch.float64)
    ids, _ = padded_batch(length=10)
    mask = torch.ones_like(ids)
    mask[0, 4] = 0
    with pytest.raises(ReconstructionError, match="has a gap") as error:
        mc.implicit_attention(model, ids, attention_mask=mask)
    assert "hooks" not in str(error.value)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
