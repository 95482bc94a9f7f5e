"""``fast_scans`` on Mamba-2 and its hybrids: HF's ``mamba2_chunk_scan`` (in each of the six model files) runs on
:func:`mamba_captum.kernels.scans.ssd_scan_reference` for CPU tensors, equal to HF's function — output, final state,
the gradient of every input — and the models' logits and gradients do not change."""
import importlib
import sys

import pytest
import torch
from conftest import relative_error
from tiny_models import VOCAB, make_model

import mamba_captum as mc
from mamba_captum import scan_swaps  # the dispatchers look the fast scans up there

fast_scans_module = sys.modules["mamba_captum.fast_scans"]  # the package attribute is the function
HF_MAMBA2 = importlib.import_module(fast_scans_module.SSD_MODULES["Mamba2Mixer"])
FAMILIES = {"mamba2": 2, "bamba": 2, "zamba2": 3, "nemotron_h": 2, "falcon_h1": 2, "granitemoehybrid": 2}  # SSD layers


def scan_inputs(length, groups=2, heads=4, with_state=True, dtype=torch.float32):
    """HF's arguments (x, dt, A, B, C, D, dt_bias, initial state), all requiring grad, and loss weights."""
    g = torch.Generator().manual_seed(length)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    head_dim, state = 3, 5
    tensors = dict(hidden_states=r(2, length, heads, head_dim), dt=r(2, length, heads), A=-torch.rand(heads, generator=g,
                   dtype=dtype) * 3, B=r(2, length, groups, state), C=r(2, length, groups, state), D=r(heads),
                   dt_bias=r(heads), initial_states=r(2, heads, head_dim, state) if with_state else None)
    tensors = {k: None if v is None else v.requires_grad_() for k, v in tensors.items()}
    weights = r(2, length, heads, head_dim), r(2, heads, head_dim, state)
    return tensors, weights


def results(scan, tensors, weights, **options):
    """[output, final state, then the gradient of a weighted sum of both w.r.t. every input]."""
    y, final = scan(**tensors, chunk_size=8, dt_softplus=True, dt_limit=(0.01, 5.0), return_final_states=True,
                    **options)
    loss = (y * weights[0]).sum() + (final * weights[1]).sum()
    inputs = [t for t in tensors.values() if t is not None]
    return [y, final] + list(torch.autograd.grad(loss, inputs))


@pytest.mark.parametrize("length", [1, 7, 8, 21, 70])  # the fast scan's chunks are 64 tokens, HF's here 8
@pytest.mark.parametrize("with_state", [True, False])
def test_the_swapped_scan_equals_hfs_output_state_and_gradients(length, with_state):
    tensors, weights = scan_inputs(length, with_state=with_state)
    expected = results(HF_MAMBA2.mamba2_chunk_scan, tensors, weights)
    calls = []
    real = scan_swaps.ssd_scan_reference
    with pytest.MonkeyPatch.context() as patch, mc.fast_scans():
        patch.setattr(scan_swaps, "ssd_scan_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = results(HF_MAMBA2.mamba2_chunk_scan, tensors, weights)
    assert calls == [1]
    for a, b in zip(got, expected):  # two float32 paths, each ≤ 7e-7 from a float64 evaluation (measured)
        assert a.dtype == b.dtype and relative_error(a, b) < 1e-5


def test_hfs_function_stays_for_other_keywords_outside_the_context_and_without_a_final_state():
    tensors, _ = scan_inputs(9, with_state=False)
    expected = HF_MAMBA2.mamba2_chunk_scan(**tensors, chunk_size=8, dt_softplus=True)
    with mc.fast_scans():  # the once-per-process swap checks, which call the fast scan too, before the count
        pass
    calls = []
    real = scan_swaps.ssd_scan_reference
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scan_swaps, "ssd_scan_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
        with mc.fast_scans():
            seq_idx = torch.zeros(2, 9, dtype=torch.int32)  # packed sequences: HF's function (which refuses them)
            with pytest.raises(ValueError, match="packed sequences"):
                HF_MAMBA2.mamba2_chunk_scan(**tensors, chunk_size=8, dt_softplus=True, seq_idx=seq_idx)
            z = torch.randn(2, 9, 4, 3)  # a gate: HF's function, bit for bit
            assert torch.equal(HF_MAMBA2.mamba2_chunk_scan(**tensors, chunk_size=8, dt_softplus=True, z=z), expected)
            assert not calls
            dropped = HF_MAMBA2.mamba2_chunk_scan(**tensors, chunk_size=8, dt_softplus=True, output_router_logits=True)
            assert calls == [1] and relative_error(dropped, expected) < 1e-5  # a keyword HF drops: ours
            calls.clear()
            fast = HF_MAMBA2.mamba2_chunk_scan(**tensors, chunk_size=8, dt_softplus=True)  # y alone
            assert calls == [1] and relative_error(fast, expected) < 1e-5
    assert not hasattr(HF_MAMBA2.mamba2_chunk_scan, "original")  # restored


@pytest.mark.parametrize("family", FAMILIES)
def test_models_give_hfs_logits_and_gradients_on_the_fast_ssd(family):
    model = make_model(family)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))

    def run():
        model.zero_grad(set_to_none=True)
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings, use_cache=False).logits
        logits[:, -1].logsumexp(-1).sum().backward()
        return [logits.detach(), embeddings.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = run()
    calls = []
    real = scan_swaps.ssd_scan_reference
    with pytest.MonkeyPatch.context() as patch, mc.fast_scans(model):
        patch.setattr(scan_swaps, "ssd_scan_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = run()
    assert len(calls) == FAMILIES[family] and len(got) == len(expected)
    for a, b in zip(got, expected):  # two float32 paths
        assert relative_error(a, b) < 2e-5
