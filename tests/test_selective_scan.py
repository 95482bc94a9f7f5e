"""The fast differentiable Mamba-1 scan: equal to the per-token loop and to HF's own torch path (outputs and every
gradient), and ``fast_scans`` swaps HF's module-level scans only while it is open."""
import os
import sys

import pytest
import torch
import transformers.models.falcon_mamba.modeling_falcon_mamba as hf_falcon_mamba
import transformers.models.jamba.modeling_jamba as hf_jamba
import transformers.models.mamba.modeling_mamba as hf_mamba
import transformers.models.recurrent_gemma.modeling_recurrent_gemma as hf_griffin
import transformers.models.rwkv.modeling_rwkv as hf_rwkv
import transformers.models.zamba.modeling_zamba as hf_zamba
from conftest import relative_error
from test_identities import liven
from tiny_models import MAMBA1, VOCAB, make_model

import mamba_captum as mc
from mamba_captum.kernels.selective_scan import selective_scan_chunked, selective_scan_naive

SCAN_MODULES = (hf_mamba, hf_falcon_mamba, hf_jamba, hf_zamba)
SSD_MODULE_PATHS = sys.modules["mamba_captum.fast_scans"].SSD_MODULES.values()
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
# The Triton scan runs compiled on CUDA (TRITON_INTERPRET=0, .ci/gpu), else interpreted on CPU (conftest).
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def scan_inputs(length, dtype, batch=2, channels=6, state=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    tensors = dict(u=r(batch, channels, length), delta=r(batch, channels, length),
                   A=-torch.rand(channels, state, generator=g, dtype=dtype) * 4, B=r(batch, state, length),
                   C=r(batch, state, length), D=r(channels), z=r(batch, channels, length), delta_bias=r(channels))
    return {k: v.requires_grad_() for k, v in tensors.items()}, r(batch, channels, length), r(batch, channels, state)


def outputs_and_grads(fn, length, dtype, options, **kw):
    tensors, grad_y, grad_last = scan_inputs(length, dtype)
    used = {k: v for k, v in tensors.items() if k in ("u", "delta", "A", "B", "C") or k in options}
    y, last = fn(used.pop("u"), used.pop("delta"), used.pop("A"), used.pop("B"), used.pop("C"), **used,
                 delta_softplus="softplus" in options, return_last_state=True, **kw)
    loss = (y * grad_y).sum() + (last * grad_last.to(last.dtype)).sum()
    inputs = [tensors[k] for k in NAMES if k in ("u", "delta", "A", "B", "C") or k in options]
    return [y, last, *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("length", [1, 31, 32, 33, 150])
@pytest.mark.parametrize("options", [(), ("D", "z", "delta_bias", "softplus")])
def test_chunked_equals_the_per_token_loop_in_float64(length, options):
    expected = outputs_and_grads(selective_scan_naive, length, torch.float64, options)
    got = outputs_and_grads(selective_scan_chunked, length, torch.float64, options, chunk=32)
    for a, b in zip(got, expected):
        assert relative_error(a, b) < 1e-12


def test_chunked_equals_hfs_torch_path():
    options = ("D", "z", "delta_bias", "softplus")
    expected = outputs_and_grads(hf_mamba.mamba_selective_scan, 100, torch.float32, options)
    got = outputs_and_grads(selective_scan_chunked, 100, torch.float32, options)
    for a, b in zip(got, expected):
        assert relative_error(a, b) < 1e-5


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids, use_cache=False).logits
    logits[:, -1].logsumexp(-1).sum().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", MAMBA1)
def test_models_give_hfs_outputs_and_gradients_on_the_fast_scan(family):
    model = liven(make_model(family))
    ids = torch.randint(3, VOCAB, (2, 40))
    expected = logits_and_grads(model, ids)
    with mc.fast_scans(model):
        got = logits_and_grads(model, ids)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):  # two float32 paths, every parameter's gradient: 1.03e-5 seen on one CPU
        assert relative_error(a, b) < 3e-5


def test_swapped_only_inside_and_restored_on_every_exit():
    originals = [m.mamba_selective_scan for m in SCAN_MODULES]
    depth = sys.modules["mamba_captum.fast_scans"]._thread_depth
    with mc.fast_scans():
        assert all(m.mamba_selective_scan.original is o for m, o in zip(SCAN_MODULES, originals))
        dispatchers = [m.mamba_selective_scan for m in SCAN_MODULES]
        with mc.fast_scans(make_model("mamba")):  # nested: one dispatcher per module, the thread counted twice
            assert [m.mamba_selective_scan for m in SCAN_MODULES] == dispatchers
            assert depth() == {hf_mamba.__name__: 2, hf_falcon_mamba.__name__: 1, hf_jamba.__name__: 1,
                               hf_zamba.__name__: 1, hf_rwkv.__name__: 1,  # RWKV, Griffin: test_recurrent_scans
                               f"{hf_griffin.__name__}.RecurrentGemmaRglru": 1,
                               **{path: 1 for path in SSD_MODULE_PATHS}}  # Mamba-2's: test_ssd_fast_scan
        assert all(count == 1 for count in depth().values())
    assert [m.mamba_selective_scan for m in SCAN_MODULES] == originals and not depth()
    with pytest.raises(RuntimeError, match="boom"), mc.fast_scans():
        raise RuntimeError("boom")
    assert [m.mamba_selective_scan for m in SCAN_MODULES] == originals and not depth()


def test_dispatch_keeps_mamba_ssm_on_cuda_then_triton_then_the_chunked_scan(monkeypatch):
    from types import SimpleNamespace

    from mamba_captum import scan_swaps  # the dispatchers, and the fast scans they look up

    calls = []
    monkeypatch.setattr(scan_swaps, "selective_scan_chunked", lambda *a, **k: calls.append("chunked"))
    monkeypatch.setattr(scan_swaps, "selective_scan_triton", lambda *a, **k: calls.append("triton"))
    dispatch = scan_swaps._dispatcher(hf_mamba.__name__, lambda *a, **k: calls.append("original"))
    others = [torch.zeros(1)] * 4  # dt, A, B, C: unread by the dispatch
    dispatch(torch.zeros(1), *others)  # a thread outside fast_scans(): HF's own function
    assert calls == ["original"]
    calls.clear()
    monkeypatch.setitem(scan_swaps.thread_depth(), hf_mamba.__name__, 1)
    cuda = lambda dtype: SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=dtype)  # noqa: E731
    for has_mamba_ssm in (True, False):
        monkeypatch.setattr(scan_swaps, "_has_mamba_ssm", lambda: has_mamba_ssm)
        dispatch(cuda(torch.float32), *others)
    dispatch(cuda(torch.float64), *others)
    dispatch(torch.zeros(1), *others)
    assert calls == ["original", "triton", "chunked", "chunked"]


def test_triton_scan_equals_the_per_token_loop_with_gradients(monkeypatch):
    # On DEVICE (interpreted on CPU, compiled on CUDA); 16-token chunks so that 45 tokens cross chunk borders.
    import mamba_captum.kernels.selective_scan.triton as scan_triton

    monkeypatch.setattr(scan_triton, "CHUNK", 16)
    batch, channels, state, length = 2, 21, 3, 45  # 21 channels: a full and a partial block of 16
    make = lambda *shape: torch.randn(*shape, dtype=torch.float64).requires_grad_()  # noqa: E731
    u, delta, B, C, z = make(batch, channels, length), make(batch, channels, length), make(batch, state, length), \
        make(batch, state, length), make(batch, channels, length)
    A = (-torch.rand(channels, state, dtype=torch.float64) * 2).requires_grad_()
    skip, bias = make(channels), make(channels)
    inputs = (u, delta, A, B, C, skip, bias, z)

    def run(scan, tensors):
        u, delta, A, B, C, skip, bias, z = tensors
        y, last = scan(u, delta, A, B, C, D=skip, z=z, delta_bias=bias, delta_softplus=True, return_last_state=True)
        loss = (y * weights_y.to(y)).sum() + (last * weights_last.to(last)).sum()  # y's dtype and device
        return [y, last, *torch.autograd.grad(loss, tensors)]

    weights_y, weights_last = torch.randn(batch, channels, length), torch.randn(batch, channels, state)
    expected = run(selective_scan_naive, inputs)
    got = run(scan_triton.selective_scan_triton, [t.detach().float().to(DEVICE).requires_grad_() for t in inputs])
    for name, a, b in zip(["y", "last", "u", "delta", "A", "B", "C", "D", "delta_bias", "z"], got, expected):
        assert a.dtype == torch.float32 and relative_error(a.cpu(), b) < 1e-5, name
