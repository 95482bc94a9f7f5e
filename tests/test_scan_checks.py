"""The swap check of ``fast_scans``: each fast scan is checked against HF's own function once per process and swap
(outputs, final states, input gradients, the signature); one that no longer agrees is not swapped — HF's function
runs, with one warning — and a function this transformers lacks means nothing to swap."""
import collections
import dataclasses
import re
import importlib
import sys
import threading
import warnings

import pytest
import torch
import transformers
import transformers.models.mamba.modeling_mamba as hf_mamba
from tiny_models import VOCAB, make_model

import mamba_captum as mc
from mamba_captum import scan_checks, scan_swaps

fast_scans_module = importlib.import_module("mamba_captum.fast_scans")  # the package attribute is the function
MAMBA1_KEY = hf_mamba.__name__
SSD_KEY = fast_scans_module.SSD_MODULES["Mamba2Mixer"]
# family -> (its swap key, the fast scan its dispatcher calls on the CPU: the name looked up in scan_swaps)
FAMILIES = {
    "mamba": (MAMBA1_KEY, "selective_scan_chunked"),
    "mamba2": (SSD_KEY, "ssd_scan_reference"),
    "rwkv": (fast_scans_module.RWKV_MODULE, "wkv_scan_chunked"),
    "recurrent_gemma": (f"{fast_scans_module.GRIFFIN_MODULE}.RecurrentGemmaRglru", "rglru_scan_chunked"),
}


@pytest.fixture(autouse=True)
def fresh_swap_checks():
    """Every test starts from an unchecked process and leaves none of its (changed-kernel) outcomes behind."""
    fast_scans_module.reset_swap_checks()
    yield
    fast_scans_module.reset_swap_checks()


def changed(monkeypatch, name, change):
    """Replace the fast scan ``name`` the dispatchers call (mamba_captum.scan_swaps) by ``change`` applied to its
    result; returns the list its calls are counted in."""
    calls, real = [], getattr(scan_swaps, name)

    def scan(*args, **kwargs):
        calls.append(1)
        return change(real(*args, **kwargs))

    monkeypatch.setattr(scan_swaps, name, scan)
    return calls


def one_percent_larger_output(result):
    """The scan's output 1% larger (the first element where it returns (output, state))."""
    if isinstance(result, tuple):
        return (result[0] * 1.01, *result[1:])
    return result * 1.01


def logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_every_swap_passes_its_check_on_this_transformers():
    for key, swap in fast_scans_module.SWAPS.items():
        result = fast_scans_module.check_swap(key)
        assert result.swapped and not result.reason, result
        assert result.difference <= result.tolerance and result.tolerance in swap.tolerances, result
        assert result.milliseconds > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_changed_fast_scan_is_caught_and_hfs_function_runs(family, monkeypatch):
    key, scan_name = FAMILIES[family]
    model = make_model(family)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    logits(model, ids)  # RWKV's first eval forward rescales its weights in place: before both runs
    expected = logits(model, ids)  # HF's own path
    calls = changed(monkeypatch, scan_name, one_percent_larger_output)
    assert key not in fast_scans_module.swap_checks()  # unchecked
    swap = fast_scans_module.SWAPS[key]
    name = re.escape(f"{swap.module}.{swap.owner + '.' if swap.owner else ''}{swap.attribute}")
    warning = rf"{name} of transformers {re.escape(transformers.__version__)} differs from the fast scan by 0\.01"
    with pytest.warns(fast_scans_module.ScanMismatchWarning, match=warning):
        with mc.fast_scans(model):
            got = logits(model, ids)
    assert torch.equal(got, expected)  # HF's function ran: never the changed numbers
    assert len(calls) == 1  # the check's probe alone reached the changed scan, none of the model's layers
    result = fast_scans_module.swap_checks()[key]
    assert not result.swapped and 0.009 < result.difference < 0.011, result  # in the output or a gradient
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second check, no second warning
        with mc.fast_scans(model):
            assert torch.equal(logits(model, ids), expected)
    assert len(calls) == 1


def gradient_only_larger(result):
    """The same forward values, bit for bit; the gradient through the output 1% larger."""
    output, *rest = result
    return (output + 0.01 * (output - output.detach()), *rest)


def final_state_only_larger(result):
    """The final state 1% larger; the output and every gradient unchanged."""
    output, final = result
    return output, final + 0.01 * final.detach()


@pytest.mark.parametrize("key,scan_name,change,part", [
    (MAMBA1_KEY, "selective_scan_chunked", gradient_only_larger, "∂"),
    (SSD_KEY, "ssd_scan_reference", gradient_only_larger, "∂"),
    (MAMBA1_KEY, "selective_scan_chunked", final_state_only_larger, "final state"),
    (SSD_KEY, "ssd_scan_reference", final_state_only_larger, "final state"),
])
def test_a_change_of_only_the_gradients_or_only_the_final_state_is_caught(key, scan_name, change, part, monkeypatch):
    changed(monkeypatch, scan_name, change)
    result = fast_scans_module.check_swap(key)
    assert not result.swapped and result.part.startswith(part) and result.difference > 1e-3, result


def test_a_signature_the_dispatcher_does_not_forward_is_not_swapped(monkeypatch):
    original = hf_mamba.mamba_selective_scan

    def with_initial_state(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False, initial_state=None, **kwargs):
        return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                        return_last_state=return_last_state, **kwargs)

    def softplus_by_default(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=True,
                            return_last_state=False, **kwargs):
        return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                        return_last_state=return_last_state, **kwargs)

    for function in (with_initial_state, softplus_by_default):
        fast_scans_module.reset_swap_checks()
        monkeypatch.setattr(hf_mamba, "mamba_selective_scan", function)
        with pytest.warns(fast_scans_module.ScanMismatchWarning, match=r"mamba_selective_scan of transformers .* "
                          r"has the signature \(hidden_states, .*\), which the fast scan's dispatcher"):
            with mc.fast_scans(make_model("mamba")):
                assert hf_mamba.mamba_selective_scan is function  # not swapped
                assert MAMBA1_KEY not in fast_scans_module._thread_depth()


def test_a_function_or_module_this_transformers_lacks_means_nothing_to_swap(monkeypatch):
    # transformers 5.9 has no modeling_mamba.mamba_selective_scan (its mixer runs its own loop)
    monkeypatch.delattr(hf_mamba, "mamba_selective_scan")
    gone = dataclasses.replace(fast_scans_module.SWAPS[SSD_KEY], module="transformers.models.no_such_model")
    monkeypatch.setitem(fast_scans_module.SWAPS, SSD_KEY, gone)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning, no error
        with mc.fast_scans(make_model("mamba")), mc.fast_scans(make_model("mamba2")):
            assert MAMBA1_KEY not in fast_scans_module._thread_depth()
            assert SSD_KEY not in fast_scans_module._thread_depth()
            assert not hasattr(hf_mamba, "mamba_selective_scan")  # nothing installed in its place
    checks = fast_scans_module.swap_checks()
    assert checks[MAMBA1_KEY].reason == checks[SSD_KEY].reason == fast_scans_module.ABSENT
    assert not checks[MAMBA1_KEY].swapped


def test_each_swap_is_checked_once_per_process_whatever_the_threads(monkeypatch):
    counts, real = collections.Counter(), fast_scans_module.check_swap
    monkeypatch.setattr(scan_checks, "check_swap", lambda key: counts.update([key]) or real(key))
    threads, barrier, seen, errors = 4, threading.Barrier(4), [], []

    def enter():
        try:
            barrier.wait(10)  # all first entries at once
            for _ in range(3):
                with mc.fast_scans(), mc.fast_scans(make_model("mamba")):
                    seen.append(set(fast_scans_module._thread_depth()))
        except Exception as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)

    workers = [threading.Thread(target=enter) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not errors
    assert counts == {key: 1 for key in fast_scans_module.SWAPS}
    assert len(seen) == 3 * threads and all(keys == set(fast_scans_module.SWAPS) for keys in seen)
    fast_scans_module.reset_swap_checks()  # the documented way to check again
    with mc.fast_scans(make_model("mamba")):
        pass
    assert counts[MAMBA1_KEY] == 2 and sum(counts.values()) == len(fast_scans_module.SWAPS) + 1


def test_the_check_finds_hfs_function_behind_an_installed_dispatcher_and_ignores_the_callers_modes():
    original = hf_mamba.mamba_selective_scan
    with mc.fast_scans(make_model("mamba")):
        assert hf_mamba.mamba_selective_scan is not original
        fast_scans_module.reset_swap_checks()
        assert scan_checks._hf_function(MAMBA1_KEY) is original
        with torch.inference_mode():  # the library's own forwards may run without grad
            results = [fast_scans_module.check_swap(key) for key, _ in FAMILIES.values()]
    assert all(result.swapped for result in results), results
    assert hf_mamba.mamba_selective_scan is original
