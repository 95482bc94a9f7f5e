"""The fast differentiable RWKV-4 WKV and Griffin RG-LRU scans: equal to the per-token loops and to HF's own
functions (outputs, states, the gradient of every input), and ``fast_scans`` swaps HF's function (RWKV) and method
(Griffin) only while it is open, only for the thread inside, and only for the mixers a model holds."""
import os
import sys
import threading

import pytest
import torch
import transformers.models.recurrent_gemma.modeling_recurrent_gemma as hf_griffin
import transformers.models.rwkv.modeling_rwkv as hf_rwkv
from conftest import relative_error
from tiny_models import VOCAB, make_model

import mamba_captum as mc
from mamba_captum import scan_swaps  # the dispatchers look the fast scans up there
from mamba_captum.kernels.rglru_scan import rglru_scan_chunked, rglru_scan_naive, rglru_scan_triton
from mamba_captum.kernels.wkv_scan import wkv_scan_chunked, wkv_scan_naive, wkv_scan_triton

fast_scans_module = sys.modules["mamba_captum.fast_scans"]  # the package attribute is the function
RGLRU_KEY = f"{fast_scans_module.GRIFFIN_MODULE}.RecurrentGemmaRglru"
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
CHUNK = 16  # in the chunked-scan tests: the lengths below give a partial chunk, exactly one, one and a bit, four
LENGTHS = [1, 7, 16, 17, 50]


def generator(seed=0):
    return torch.Generator().manual_seed(seed)


# -- RWKV-4 WKV ------------------------------------------------------------------------------------------------------
def wkv_inputs(length, dtype=torch.float64, with_state=True, batch=2, channels=6, key_scale=5.0, key_shift=0.0):
    """(time_decay, time_first, key, value, state or None) requiring grad, and weights for a loss on
    (wkv, num, den, max)."""
    g = generator()
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    tensors = [torch.linspace(-3.0, 2.0, channels, dtype=dtype), r(channels),
               r(batch, length, channels) * key_scale + key_shift, r(batch, length, channels)]
    state = [r(batch, channels), torch.rand(batch, channels, generator=g, dtype=dtype) + 0.5, r(batch, channels) * 3]
    tensors = [t.requires_grad_() for t in tensors]
    state = [t.requires_grad_() for t in state] if with_state else None
    weights = [r(batch, length, channels)] + [r(batch, channels) for _ in range(3)]
    return tensors, state, weights


def wkv_results(scan, tensors, state, weights, **kw):
    """[wkv, num, den, max, then the gradient of a weighted sum of those four w.r.t. every input]."""
    wkv, last = scan(*tensors, state=state, return_state=True, **kw)
    outputs = [wkv, *last]
    loss = sum((out * w.to(out.dtype)).sum() for out, w in zip(outputs, weights))
    return outputs + list(torch.autograd.grad(loss, tensors + (state or [])))


@pytest.mark.parametrize("with_state", [False, True])
def test_wkv_naive_equals_hfs_cpu_function(with_state):
    tensors, state, _ = wkv_inputs(40, torch.float32, with_state)
    for return_state in (False, True):
        hf_wkv, hf_state = hf_rwkv.rwkv_linear_attention_cpu(*tensors, state=state, return_state=return_state)
        wkv, last = wkv_scan_naive(*tensors, state=state, return_state=return_state)
        assert relative_error(wkv, hf_wkv) < 1e-6  # the same float32 operations in the same order
        assert (last is None) == (hf_state is None) == (not with_state and not return_state)
        for a, b in zip(last or [], hf_state or []):
            assert relative_error(a, b) < 1e-6


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_wkv_chunked_equals_the_per_token_loop_in_float64(length, with_state):
    tensors, state, weights = wkv_inputs(length, with_state=with_state)
    expected = wkv_results(wkv_scan_naive, tensors, state, weights)
    got = wkv_results(wkv_scan_chunked, tensors, state, weights, chunk=CHUNK)
    assert len(got) == len(expected) == (11 if with_state else 8)
    for a, b in zip(got, expected):  # measured ≤ 2e-14
        assert a.dtype == torch.float64 and relative_error(a, b) < 1e-12


def test_wkv_chunked_equals_hfs_outputs_and_gradients_in_float32():
    tensors, state, weights = wkv_inputs(100, torch.float32)
    expected = wkv_results(hf_rwkv.rwkv_linear_attention_cpu, tensors, state, weights)
    got = wkv_results(wkv_scan_chunked, tensors, state, weights)
    for a, b in zip(got, expected):  # two float32 paths; measured ≤ 3e-6
        assert relative_error(a, b) < 2e-5


def test_wkv_chunked_does_not_overflow_on_keys_beyond_exps_range():
    # keys around 100 (e^100 overflows float32): HF's max-tracking loop stays finite, and so must the fast scan
    tensors, _, weights = wkv_inputs(70, torch.float32, key_scale=40.0, key_shift=100.0)
    expected = wkv_results(wkv_scan_naive, [t.detach().double().requires_grad_() for t in tensors], None, weights)
    hf = wkv_results(hf_rwkv.rwkv_linear_attention_cpu, tensors, None, weights)
    got = wkv_results(wkv_scan_chunked, tensors, None, weights)
    for a, b, c in zip(got, expected, hf):  # float32 exponents of ~200: HF's own error is up to 6e-5 here
        assert torch.isfinite(a).all() and relative_error(a, b) < 1e-4 and relative_error(c, b) < 1e-4


@pytest.mark.parametrize("with_state", [False, True])
def test_wkv_triton_equals_the_per_token_loop(with_state):
    # 150 channels: a full and a partial block of 128; under TRITON_INTERPRET=1 on CPU (conftest)
    tensors, state, weights = wkv_inputs(23, with_state=with_state, channels=150, key_scale=3.0)
    expected = wkv_results(wkv_scan_naive, tensors, state, weights)
    on_device = lambda t: t.detach().float().to(DEVICE).requires_grad_()  # noqa: E731
    got = wkv_results(wkv_scan_triton, [on_device(t) for t in tensors], state and [on_device(t) for t in state],
                      [w.to(DEVICE) for w in weights])
    for a, b in zip(got, expected):  # float32, as close as HF's own float32 loop (measured ≤ 1e-6)
        assert a.dtype == torch.float32 and relative_error(a.cpu(), b) < 1e-5


# -- Griffin's RG-LRU ------------------------------------------------------------------------------------------------
def rglru_inputs(length, dtype=torch.float64, with_state=True, batch=2, channels=6):
    """x, the gates a (some exactly 0, as after a reset), h0 or None, all requiring grad, a reset mask at token
    length // 3, and weights for a loss on (y, last)."""
    g = generator()
    x = torch.randn(batch, length, channels, generator=g, dtype=dtype)
    a = torch.rand(batch, length, channels, generator=g, dtype=dtype)
    h0 = torch.randn(batch, channels, generator=g, dtype=dtype) if with_state else None
    reset = torch.zeros(batch, length, 1, dtype=torch.bool)
    reset[:, length // 3] = True
    weights = torch.randn(batch, length, channels, generator=g, dtype=dtype), \
        torch.randn(batch, channels, generator=g, dtype=dtype)
    tensors = [t.requires_grad_() for t in (x, a, h0) if t is not None]
    return tensors, reset, weights


def rglru_results(scan, tensors, reset, weights):
    """[y, last, then the gradient of a weighted sum of both w.r.t. x, a (and h0)]; the gates are zeroed at the
    reset as HF's _rnn_scan does."""
    x, a, *h0 = tensors
    y, last = scan(x, a * ~reset, *h0)
    loss = (y * weights[0].to(y.dtype)).sum() + (last * weights[1].to(last.dtype)).sum()
    return [y, last, *torch.autograd.grad(loss, tensors)]


@pytest.mark.parametrize("with_state", [False, True])
def test_rglru_naive_equals_hfs_rnn_scan(with_state):
    (x, a, *h0), reset, _ = rglru_inputs(40, torch.float32, with_state)
    hf_y, hf_last = hf_griffin.RecurrentGemmaRglru._rnn_scan(None, x, a, reset, h0[0] if h0 else None)
    y, last = rglru_scan_naive(x, a * ~reset, *h0)
    assert relative_error(y, hf_y) < 1e-6 and relative_error(last, hf_last) < 1e-6  # the same float32 operations


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_rglru_chunked_equals_the_per_token_loop_in_float64(length, with_state):
    tensors, reset, weights = rglru_inputs(length, with_state=with_state)
    expected = rglru_results(rglru_scan_naive, tensors, reset, weights)
    got = rglru_results(lambda *a: rglru_scan_chunked(*a, chunk=CHUNK), tensors, reset, weights)
    assert len(got) == len(expected) == (5 if with_state else 4)
    for a, b in zip(got, expected):  # measured ≤ 3e-16
        assert a.dtype == torch.float64 and relative_error(a, b) < 1e-13


def test_rglru_chunked_equals_hfs_outputs_and_gradients_in_float32():
    tensors, reset, weights = rglru_inputs(100, torch.float32)
    hf_scan = lambda x, a, h0: hf_griffin.RecurrentGemmaRglru._rnn_scan(None, x, a, reset, h0)  # noqa: E731
    x, a, h0 = tensors
    expected = [*hf_scan(x, a, h0)]
    loss = (expected[0] * weights[0]).sum() + (expected[1] * weights[1]).sum()
    expected += list(torch.autograd.grad(loss, tensors))
    got = rglru_results(rglru_scan_chunked, tensors, reset, weights)
    for a, b in zip(got, expected):  # measured ≤ 2e-7
        assert relative_error(a, b) < 1e-6


@pytest.mark.parametrize("with_state", [False, True])
def test_rglru_triton_equals_the_per_token_loop(with_state):
    tensors, reset, weights = rglru_inputs(23, with_state=with_state, channels=150)  # a full and a partial block
    expected = rglru_results(rglru_scan_naive, tensors, reset, weights)
    got = rglru_results(rglru_scan_triton, [t.detach().float().to(DEVICE).requires_grad_() for t in tensors],
                        reset.to(DEVICE), [w.to(DEVICE) for w in weights])
    for a, b in zip(got, expected):  # measured ≤ 1e-7
        assert a.dtype == torch.float32 and relative_error(a.cpu(), b) < 1e-6


# -- fast_scans on the models ----------------------------------------------------------------------------------------
def count_calls(monkeypatch, name):
    """Count the calls that reach the fast scan ``name`` the dispatchers call (mamba_captum.scan_swaps; the
    once-per-process swap checks, which call it too, run first)."""
    with mc.fast_scans():
        pass
    calls, real = [], getattr(scan_swaps, name)
    monkeypatch.setattr(scan_swaps, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def run_model(model, ids, use_cache, kwargs, backward=True):
    """[logits, then (with backward) the gradients of the input embeddings and of every parameter], and the states
    the forward leaves (RWKV: the returned state; Griffin: the RG-LRU states it stores on its modules)."""
    model.zero_grad(set_to_none=True)
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.set_grad_enabled(backward):
        out = model(inputs_embeds=embeddings, use_cache=use_cache, **kwargs)
    results = [out.logits.detach()]
    if backward:
        out.logits[:, -1].logsumexp(-1).sum().backward()
        results += [embeddings.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    states = out.state if hasattr(out, "state") else [m.recurrent_states for m in model.modules()
                                                       if isinstance(m, hf_griffin.RecurrentGemmaRglru)]
    return results, [s.detach() for s in states or [] if s is not None]


FAMILIES = {"rwkv": ("wkv_scan_chunked", 4), "recurrent_gemma": ("rglru_scan_chunked", 2)}  # recurrent layers


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_cache", [False, True])
def test_models_give_hfs_logits_states_and_gradients_on_the_fast_scans(family, use_cache, monkeypatch):
    model = make_model(family)
    ids = torch.randint(3, VOCAB, (2, 40), generator=generator())
    kwargs = {"position_ids": torch.tensor([[0, 1, 2, 3, 4] + list(range(35))])} if family == "recurrent_gemma" \
        else {}  # Griffin: a reset at token 5
    with torch.no_grad():
        model(ids)  # RWKV's first eval forward rescales its weights in place: before both runs
    expected, expected_states = run_model(model, ids, use_cache, kwargs, backward=False)
    # HF's RWKV cannot differentiate with use_cache=True (it writes each layer's state, in place, into tensors its
    # loop saved): its gradients with use_cache=False, the same function of the inputs
    expected = expected[:1] + run_model(model, ids, use_cache and family != "rwkv", kwargs)[0][1:]
    scan, layers = FAMILIES[family]
    calls = count_calls(monkeypatch, scan)
    with mc.fast_scans(model):
        got, got_states = run_model(model, ids, use_cache, kwargs)
    assert len(calls) == layers
    states = 2 if family == "recurrent_gemma" else 5 if use_cache else 0  # RG-LRU stores its last state always
    assert len(got) == len(expected) and len(got_states) == len(expected_states) == states
    for a, b in zip(got + got_states, expected + expected_states):  # two float32 paths: measured ≤ 4e-6
        assert relative_error(a, b) < 2e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_the_librarys_gradient_methods_run_on_the_fast_scans(family, monkeypatch):
    model = make_model(family)
    scan, layers = FAMILIES[family]
    calls = count_calls(monkeypatch, scan)
    method = mc.RWKVAttribution if family == "rwkv" else mc.MambaAttribution
    method(model).attribute(torch.randint(3, VOCAB, (1, 20), generator=generator()), target=7)
    assert len(calls) == layers  # its one forward, inside fast_scans(model)


def test_fast_scans_swaps_only_the_scans_of_the_models_mixers():
    wkv, rnn_scan = hf_rwkv.rwkv_linear_attention, hf_griffin.RecurrentGemmaRglru._rnn_scan
    with mc.fast_scans(make_model("rwkv")):
        assert hf_rwkv.rwkv_linear_attention.original is wkv
        assert hf_griffin.RecurrentGemmaRglru._rnn_scan is rnn_scan
        with mc.fast_scans(make_model("recurrent_gemma")):
            assert hf_griffin.RecurrentGemmaRglru._rnn_scan.original is rnn_scan
            assert fast_scans_module._thread_depth() == {hf_rwkv.__name__: 1, RGLRU_KEY: 1}
        assert hf_griffin.RecurrentGemmaRglru._rnn_scan is rnn_scan
    assert hf_rwkv.rwkv_linear_attention is wkv and not fast_scans_module._thread_depth()


def small_calls():
    """One call of each swapped function, on 5 tokens and on 1 token (which the dispatchers leave to HF)."""
    tensors, state, _ = wkv_inputs(5, torch.float32)
    (x, a, h0), reset, _ = rglru_inputs(5, torch.float32)
    detached = lambda ts: [t.detach() for t in ts]  # noqa: E731
    tensors, state, x, a, h0 = detached(tensors), detached(state), x.detach(), a.detach(), h0.detach()
    return {
        "wkv": lambda: hf_rwkv.rwkv_linear_attention(*tensors, state=state)[0],
        "wkv one token": lambda: hf_rwkv.rwkv_linear_attention(*tensors[:2], *(t[:, :1] for t in tensors[2:]))[0],
        "rglru": lambda: hf_griffin.RecurrentGemmaRglru._rnn_scan(None, x, a, reset, h0)[0],
        "rglru one token": lambda: hf_griffin.RecurrentGemmaRglru._rnn_scan(None, x[:, :1], a[:, :1],
                                                                             reset[:, :1], h0)[0],
        "rglru float64 accumulation": lambda: hf_griffin.RecurrentGemmaRglru._rnn_scan(None, x, a, reset, h0,
                                                                                        torch.float64)[0],
    }


def test_dispatchers_run_hfs_function_outside_the_context_in_other_threads_and_where_it_is_not_supported(
        monkeypatch):
    wkv, rnn_scan = hf_rwkv.rwkv_linear_attention, hf_griffin.RecurrentGemmaRglru._rnn_scan
    calls = small_calls()
    expected = {name: call() for name, call in calls.items()}  # HF's own functions
    fast = {name: count_calls(monkeypatch, name) for name in ("wkv_scan_chunked", "rglru_scan_chunked")}
    other_thread = {}
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with mc.fast_scans():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    inside.wait(10)
    try:  # the dispatchers are installed for the other thread; this one is outside fast_scans()
        assert hf_rwkv.rwkv_linear_attention is not wkv and hf_griffin.RecurrentGemmaRglru._rnn_scan is not rnn_scan
        other_thread = {name: call() for name, call in calls.items()}
        assert not fast["wkv_scan_chunked"] and not fast["rglru_scan_chunked"]
        with mc.fast_scans():
            inside_results = {name: call() for name, call in calls.items()}
    finally:
        leave.set()
        thread.join(10)
    assert len(fast["wkv_scan_chunked"]) == len(fast["rglru_scan_chunked"]) == 1  # the 5-token calls only
    for name in calls:
        assert torch.equal(other_thread[name], expected[name]), name
        if "one token" in name or "float64" in name:  # left to HF
            assert torch.equal(inside_results[name], expected[name]), name
        else:
            assert relative_error(inside_results[name], expected[name]) < 1e-6, name
    assert hf_rwkv.rwkv_linear_attention is wkv and hf_griffin.RecurrentGemmaRglru._rnn_scan is rnn_scan


def test_swaps_restored_on_an_exception():
    wkv, rnn_scan = hf_rwkv.rwkv_linear_attention, vars(hf_griffin.RecurrentGemmaRglru)["_rnn_scan"]
    with pytest.raises(RuntimeError, match="boom"), mc.fast_scans():
        raise RuntimeError("boom")
    assert hf_rwkv.rwkv_linear_attention is wkv and vars(hf_griffin.RecurrentGemmaRglru)["_rnn_scan"] is rnn_scan
    assert not fast_scans_module._thread_depth()
