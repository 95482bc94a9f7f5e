"""RWKV-4 and Griffin / RecurrentGemma: exact operators (DESIGN.md §3), independent references, padding and reset
rules, the Captum classes, and no side effects (RWKV's in-place rescaling, RecurrentGemma's cached states)."""
import copy

import pytest
import torch
import transformers.models.recurrent_gemma.modeling_recurrent_gemma as hf_griffin
import transformers.models.rwkv.modeling_rwkv as hf_rwkv
from conftest import relative_error
from test_engine import assert_untouched, model_state
from tiny_models import VOCAB, make_model

import mamba_captum as mc
from mamba_captum.families import rwkv as rwkv_family
from mamba_captum.kernels.decay import decay_maps_naive

TOL = 1e-5
FAMILIES = ("rwkv", "recurrent_gemma")
# A reset (position_ids == 0) inside the sequence: RecurrentGemma's RG-LRU starts a new state at token 5.
RESET_POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])


def mixers(model):
    return [m for m in model.modules() if type(m).__name__ in ("RwkvSelfAttention", "RecurrentGemmaRecurrentBlock")]


def liven(model):
    """Spread the random init so that every factor (keys, decay, gates, conv) matters in the identities."""
    torch.manual_seed(1)
    with torch.no_grad():
        for mixer in mixers(model):
            if hasattr(mixer, "time_decay"):
                mixer.key.weight.mul_(6.0)
                mixer.value.weight.mul_(4.0)
                mixer.time_decay.copy_(torch.linspace(-3.0, 1.0, mixer.time_decay.numel()))
            else:
                mixer.linear_x.weight.mul_(4.0)
                mixer.rg_lru.recurrent_gate_weight.normal_(0.0, 0.5)
                mixer.rg_lru.input_gate_weight.normal_(0.0, 0.5)
                mixer.conv_1d.bias.normal_(0.0, 0.5)
    return model


def model_and_inputs(family, length=12, batch=2):
    model = liven(make_model(family))
    ids = torch.randint(3, VOCAB, (batch, length))
    kwargs = {"position_ids": RESET_POSITIONS[:, :length]} if family == "recurrent_gemma" else {}
    return model, ids, kwargs


class Recorder:
    """Independent hooks (not the library's): each mixer's values, the input of its output projection, and its own
    recurrence's inputs and outputs (RWKV: HF's rwkv_linear_attention; Griffin: the rg_lru module)."""

    def __init__(self, model, monkeypatch):
        self.records, self.handles = {}, []
        for mixer in mixers(model):
            record = self.records.setdefault(mixer, {})
            if hasattr(mixer, "time_decay"):
                self.handles.append(mixer.value.register_forward_hook(
                    lambda m, a, out, record=record: record.__setitem__("values", out.detach())))
                self.handles.append(mixer.output.register_forward_hook(
                    lambda m, a, out, record=record: record.update(out_in=a[0].detach(), out=out.detach())))
            else:
                self.handles.append(mixer.linear_x.register_forward_hook(
                    lambda m, a, out, record=record: record.__setitem__("values", out.detach())))
                self.handles.append(mixer.rg_lru.register_forward_hook(
                    lambda m, a, out, record=record: record.update(scan_in=a[0].detach(), scan=out.detach())))
                self.handles.append(mixer.linear_out.register_forward_hook(
                    lambda m, a, out, record=record: record.update(out_in=a[0].detach(), out=out.detach())))
        calls = self.wkv_calls = []
        real = hf_rwkv.rwkv_linear_attention

        def recording(time_decay, time_first, key, value, state=None, return_state=False):
            out = real(time_decay, time_first, key, value, state=state, return_state=return_state)
            calls.append((time_decay.detach(), time_first.detach(), key.detach(), value.detach(), out[0].detach()))
            return out

        monkeypatch.setattr(hf_rwkv, "rwkv_linear_attention", recording)
        self.scans = scans = []
        real_scan = hf_griffin.RecurrentGemmaRglru._rnn_scan

        def recording_scan(module, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
            scans.append((hidden_states.detach(), recurrent_gate.detach(), reset))
            return real_scan(module, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)

        monkeypatch.setattr(hf_griffin.RecurrentGemmaRglru, "_rnn_scan", recording_scan)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def record_hfs_wkv(model, ids):
    """A plain forward, so that the Recorder sees HF's own WKV: the library's forward runs inside fast_scans(),
    whose dispatcher sends the calls to the fast scan, past the recording wrapper. (This first eval forward also
    does RWKV's one-time rescaling, so the library's forward then computes exactly the same.)"""
    with torch.no_grad():
        model(ids, use_cache=False)


def per_channel_product(maps, values):
    """Σ_j H_c[i, j] x_c[j]: (B, C, L, L) × (B, L, C) -> (B, L, C)."""
    return torch.einsum("bcij,bjc->bic", maps.double(), values.double())


# -- identities --------------------------------------------------------------------------------------------------
def _recurrent_keys(model):
    return [i for i, layer in enumerate(mc.families.decoder_layers(model))
            if any(type(m).__name__ in ("RwkvSelfAttention", "RecurrentGemmaRecurrentBlock") for m in layer.modules())]


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_identity_reproduces_the_recurrence(family, monkeypatch):
    model, ids, kwargs = model_and_inputs(family)
    recorder = Recorder(model, monkeypatch)
    if family == "rwkv":
        record_hfs_wkv(model, ids)
    maps = mc.implicit_attention(model, ids, formulation="hidden", reduce=None, **kwargs)
    recorder.remove()
    keys = _recurrent_keys(model)
    for number, (mixer, key) in enumerate(zip(mixers(model), keys)):
        if family == "rwkv":  # α v = HF's WKV output, and every row of α sums to 1
            *_, values, wkv = recorder.wkv_calls[number]
            assert relative_error(per_channel_product(maps[key], values), wkv) < TOL
            assert (maps[key].double().sum(-1) - 1).abs().max() < 1e-6
        else:  # over the conv output, which is rg_lru's input
            record = recorder.records[mixer]
            assert relative_error(per_channel_product(maps[key], record["scan_in"]), record["scan"]) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_unified_identity_reproduces_the_output_projection_input(family, monkeypatch):
    model, ids, kwargs = model_and_inputs(family)
    if family == "recurrent_gemma":  # the conv bias is not attributed to tokens: the identity holds without it
        with torch.no_grad():
            for mixer in mixers(model):
                mixer.conv_1d.bias.zero_()
    recorder = Recorder(model, monkeypatch)
    maps = mc.implicit_attention(model, ids, reduce=None, **kwargs)
    recorder.remove()
    keys = _recurrent_keys(model)
    for mixer, key in zip(mixers(model), keys):
        record = recorder.records[mixer]
        assert relative_error(per_channel_product(maps[key], record["values"]), record["out_in"]) < TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("formulation", ["unified", "hidden"])
def test_operator_output_and_readout_give_the_mixer_output(family, formulation, monkeypatch):
    model, ids, kwargs = model_and_inputs(family)
    recorder = Recorder(model, monkeypatch)
    operators, _, errors = mc.build_operators(model, ids, formulation=formulation, **kwargs)
    recorder.remove()
    for mixer, key in zip(mixers(model), _recurrent_keys(model)):
        op = operators[key]
        assert errors[key] < 1e-6
        # (the real output, as the forward computed it: RWKV's weights were rescaled during that forward)
        assert relative_error(op.readout(op.output), recorder.records[mixer]["out"]) < TOL
        # the operator's output is H x, per channel
        assert relative_error(per_channel_product(op.maps(None), op.values), op.output) < TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("formulation", ["unified", "hidden"])
def test_contribution_rows_sum_to_the_first_order_contribution(family, formulation):
    model, ids, kwargs = model_and_inputs(family)
    operators, _, _ = mc.build_operators(model, ids, formulation=formulation, **kwargs)
    for key in _recurrent_keys(model):
        op = operators[key]
        grad = torch.randn(op.output.shape, dtype=torch.float64)
        contributions = op.contributions(grad)
        assert relative_error(contributions.double().sum(-1), (grad * op.output).sum(-1)) < TOL
        assert relative_error(op.contributions(grad, rows=[3, 11]), contributions[:, [3, 11]]) < TOL


# -- independent references ---------------------------------------------------------------------------------------
def test_rwkv_maps_equal_the_jacobian_of_hfs_wkv(monkeypatch):
    model, ids, _ = model_and_inputs("rwkv")
    recorder = Recorder(model, monkeypatch)
    record_hfs_wkv(model, ids)
    maps = mc.implicit_attention(model, ids, formulation="hidden", reduce=None)
    recorder.remove()
    for number, key in enumerate(_recurrent_keys(model)):
        decay, first, k, v, _ = recorder.wkv_calls[number]
        jacobian = torch.func.jacrev(lambda values: hf_rwkv.rwkv_linear_attention_cpu(
            decay.double(), first.double(), k.double(), values)[0])(v.double())  # (B, L, C, B, L, C)
        batch, length, channels = v.shape
        b, c = torch.arange(batch), torch.arange(channels)
        expected = jacobian[b[:, None], :, c[None, :], b[:, None], :, c[None, :]]  # (B, C, i, j)
        assert relative_error(maps[key], expected) < TOL


def test_griffin_maps_equal_the_jacobian_of_hfs_scan(monkeypatch):
    model, ids, kwargs = model_and_inputs("recurrent_gemma")
    maps = mc.implicit_attention(model, ids, formulation="hidden", reduce=None, **kwargs)
    # HF's own scan inputs, recorded in a plain forward (the library's rebuild, which runs inside its forward pass,
    # calls the scan too)
    recorder = Recorder(model, monkeypatch)
    with torch.no_grad():
        model(ids, use_cache=False, **kwargs)
    recorder.remove()
    lru = mixers(model)[0].rg_lru
    for number, (mixer, key) in enumerate(zip(mixers(model), _recurrent_keys(model))):
        normalised, gate, reset = recorder.scans[number]  # HF's scan input (conv out · input gate · √(1 − a²))
        decays = torch.func.jacrev(lambda x: hf_griffin.RecurrentGemmaRglru._rnn_scan(
            lru, x, gate.double(), reset, None, torch.float64)[0])(normalised.double())
        batch, length, channels = normalised.shape
        b, c = torch.arange(batch), torch.arange(channels)
        decays = decays[b[:, None], :, c[None, :], b[:, None], :, c[None, :]]  # Π a, zero across the reset
        conv_out = recorder.records[mixer]["scan_in"].double().transpose(1, 2)[:, :, None, :]  # (B, C, 1, j)
        # α[i, j] · c[j] = Π a · (c · i · mult)[j], with no division by anything
        expected = decays * normalised.double().transpose(1, 2)[:, :, None, :]
        assert relative_error(maps[key].double() * conv_out, expected) < TOL


# -- padding, resets, batching ------------------------------------------------------------------------------------
def test_rwkv_right_padding_gives_the_unpadded_result_and_left_padding_is_refused():
    model, ids, _ = model_and_inputs("rwkv")
    mask = torch.ones_like(ids)
    mask[0, -3:], ids[0, -3:] = 0, 0  # right padding in the first example
    maps = mc.implicit_attention(model, ids, mask, reduce=None)
    alone = mc.implicit_attention(model, ids[:1, :-3], reduce=None)
    for key in alone:
        assert relative_error(maps[key][0, :, :-3, :-3], alone[key][0]) < TOL
        assert maps[key][0, :, -3:].abs().max() == 0 and maps[key][0, :, :, -3:].abs().max() == 0
    relevance = mc.RWKVAttribution(model).attribute(ids, target=5, attention_mask=mask)
    single = mc.RWKVAttribution(model).attribute(ids[:1, :-3], target=5)
    assert relative_error(relevance[0, :-3], single[0]) < TOL and relevance[0, -3:].abs().max() == 0

    left = torch.ones_like(ids)
    left[1, :2] = 0
    for call in (lambda: mc.implicit_attention(model, ids, left),
                 lambda: mc.RWKVAttribution(model).attribute(ids, target=5, attention_mask=left),
                 lambda: mc.MambaRollout(model).attribute(ids, attention_mask=left)):
        with pytest.raises(ValueError, match="RwkvSelfAttention ignores attention_mask.*Pad on the right"):
            call()


def test_griffin_left_padding_is_refused():
    model, ids, _ = model_and_inputs("recurrent_gemma")
    left = torch.ones_like(ids)
    left[0, :3] = 0
    with pytest.raises(ValueError, match="RecurrentGemmaRecurrentBlock ignores attention_mask.*Pad on the right"):
        mc.implicit_attention(model, ids, left)


def test_griffin_reset_cuts_the_recurrence_but_not_the_conv():
    model, ids, kwargs = model_and_inputs("recurrent_gemma")
    hidden = mc.implicit_attention(model, ids, formulation="hidden", reduce=None, **kwargs)
    unified = mc.implicit_attention(model, ids, reduce=None, **kwargs)
    taps = model.config.conv1d_width
    for key in _recurrent_keys(model):
        assert hidden[key][:, :, 5:, :5].abs().max() == 0  # no state crosses the reset at token 5
        assert hidden[key][:, :, 5:, 5].abs().min() > 0
        # the conv reads the K − 1 tokens before the reset (HF's conv does not reset)
        assert unified[key][:, :, 5:, :5 - (taps - 1)].abs().max() == 0
        assert unified[key][:, :, 5, 5 - (taps - 1):5].abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_single_examples(family):
    model, ids, kwargs = model_and_inputs(family)
    batched = mc.implicit_attention(model, ids, **kwargs)
    relevance = mc.MambaAttribution(model).attribute(ids, target=[4, 9], **kwargs)
    for b in range(2):
        single = mc.implicit_attention(model, ids[b:b + 1], **kwargs)
        assert all(relative_error(batched[k][b], single[k][0]) < TOL for k in single)
        alone = mc.MambaAttribution(model).attribute(ids[b:b + 1], target=[4, 9][b], **kwargs)
        assert relative_error(relevance[b], alone[0]) < TOL


def test_captum_target_forms_are_equivalent():
    model, ids, _ = model_and_inputs("rwkv")
    method = mc.RWKVAttribution(model)
    by_int = method.attribute(ids, target=7)
    for target in ([7, 7], torch.tensor([7, 7]), (7,)):
        assert torch.equal(method.attribute(ids, target=target), by_int)
    argmax = model(ids).logits[:, -1].argmax(-1)
    assert torch.equal(method.attribute(ids), method.attribute(ids, target=argmax))
    with pytest.raises(IndexError, match="classes"):
        method.attribute(ids, target=VOCAB)
    with pytest.raises(TypeError, match="RWKVAttribution explains RWKV models"):
        mc.RWKVAttribution(make_model("mamba"))


def test_rwkv_keys_of_magnitude_50_at_length_1024_do_not_overflow():
    """The WKV normaliser and the maps in log space: finite, rows summing to 1, equal to the direct formula."""
    torch.manual_seed(0)
    batch, length, channels = 2, 1024, 8
    k = torch.randn(batch, length, channels, dtype=torch.float64) * 50
    decay = torch.exp(torch.linspace(-4.0, 2.0, channels, dtype=torch.float64))
    first = torch.linspace(-1.0, 1.0, channels, dtype=torch.float64)
    log_z = rwkv_family.log_normaliser(k, decay, first)
    pieces = dict(log_q=-log_z, log_k=k + decay, log_diag=first + k - log_z)
    maps = mc.kernels.decay.decay_maps(decay.expand_as(k), reduce=None, out_dtype=torch.float64, **pieces)
    assert torch.isfinite(maps).all() and maps.min() >= 0
    assert (maps.sum(-1) - 1).abs().max() < 1e-6
    mean = mc.kernels.decay.decay_maps(decay.expand_as(k), out_dtype=torch.float32, **pieces)
    assert torch.isfinite(mean).all() and (mean.double().sum(-1) - 1).abs().max() < 1e-6
    # the direct formula on a short prefix (its rows do not depend on later tokens)
    short = decay_maps_naive(decay.expand_as(k)[:, :64], **{n: t[:, :64] for n, t in pieces.items()}, reduce=None)
    assert relative_error(maps[:, :, :64, :64], short) < 1e-12


# -- no side effects ----------------------------------------------------------------------------------------------
def _run_every_entry_point(model, ids, kwargs):
    mc.implicit_attention(model, ids, **kwargs)
    mc.build_operators(model, ids, formulation="hidden", **kwargs)
    mc.MambaAttribution(model).attribute(ids, target=3, **kwargs)
    mc.MambaAttribution(model).attribute(ids, target=3, recipe="official", **kwargs)
    mc.MambaRollout(model).attribute(ids, **kwargs)
    mc.MambaRawAttention(model).attribute(ids, **kwargs)


@pytest.mark.parametrize("history", ["fresh", "rescaled", "rescaled_then_train"])
def test_rwkv_rescaling_is_neither_repeated_nor_left_behind(history):
    model, ids, _ = model_and_inputs("rwkv")
    if history != "fresh":
        with torch.no_grad():
            model(ids)  # the user's own first eval forward rescales the weights
    if history == "rescaled_then_train":
        model.train()
    twin = copy.deepcopy(model)
    before, rescaled = model_state(model), model.rwkv.layers_are_rescaled
    _run_every_entry_point(model, ids, {})
    mc.RWKVAttribution(model).attribute(ids, target=3)
    mc.MambaRollout(model).attribute_generation(ids[:1], gen_args={"max_new_tokens": 2})
    assert_untouched(model, before)
    assert model.rwkv.layers_are_rescaled == rescaled
    with torch.no_grad():  # the user's next forward does exactly what it would have done without the library
        assert torch.equal(model(ids).logits, twin(ids).logits)
    assert_untouched(model, model_state(twin))


def test_griffin_cached_states_are_restored():
    model, ids, kwargs = model_and_inputs("recurrent_gemma")
    sentinels = {}
    for block in mixers(model):
        block.conv1d_state, block.rg_lru.recurrent_states = torch.ones(1), torch.zeros(1)
        sentinels[block] = (block.conv1d_state, block.rg_lru.recurrent_states)
    before = model_state(model)
    _run_every_entry_point(model, ids, kwargs)
    assert_untouched(model, before)
    for block, (conv_state, recurrent_states) in sentinels.items():
        assert block.conv1d_state is conv_state and block.rg_lru.recurrent_states is recurrent_states


def test_continuing_a_cached_prefix_is_refused():
    model, ids, _ = model_and_inputs("rwkv")
    state = model(ids[:, :4], use_cache=True).state
    with pytest.raises(ValueError, match="state= continues a cached prefix"):
        mc.implicit_attention(model, ids[:, 4:], state=state)
    with pytest.raises(ValueError, match="state= continues a cached prefix"):
        mc.MambaRollout(model).attribute(ids[:, 4:], additional_forward_args={"state": state})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,maps_dtype", [(torch.float64, torch.float64), (torch.bfloat16, torch.float32)])
def test_model_dtypes(family, dtype, maps_dtype):
    model = make_model(family, dtype=dtype)
    ids = torch.randint(3, VOCAB, (2, 10))
    _, _, errors = mc.build_operators(model, ids)
    assert max(errors.values()) < (1e-6 if dtype == torch.float64 else 5e-2)
    maps = mc.implicit_attention(model, ids)
    assert all(m.dtype == maps_dtype for m in maps.values())
    assert mc.MambaAttribution(model).attribute(ids, target=3).dtype == maps_dtype
