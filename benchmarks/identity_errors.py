"""Print the exactness figures per mixer: the DESIGN.md §3 identities on the tiny random models of the tests.

For every family (batch 2, first example left-padded, float32, L = 12):
  unified   max |out_proj input − Σ_s H_c[i,s] x_c[s]| / max |out_proj input|  (conv bias and D set to 0)
  hidden    max |scan output without D and gate − α u| / max |…|  (HF's own scan function, patched to record)
  impulses  max |α − α from unit impulses through HF's scan| / max |α|
  check     the relative error of the layer output rebuilt by the library (its built-in check)
RWKV-4 and RecurrentGemma (batch 2; RWKV: first example right-padded by 3; Griffin: a position_ids reset at
token 5; L = 12): the same columns, the unified identity over the values (RWKV) / the conv input with the conv bias
set to 0 (Griffin), the hidden identity against HF's own WKV / RG-LRU output, and α against the Jacobian of HF's
own WKV function / RG-LRU scan (torch.func.jacrev, float64).
Run:  python benchmarks/identity_errors.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import relative_error  # noqa: E402
from test_identities import (MAMBA1, ScanRecorder, liven, make_model, padded_batch,  # noqa: E402
                             record_conv_inputs_and_out_proj_inputs, ssm_mixers, ssm_operators, zero_bias_and_skip)
from tiny_models import CONFIGS  # noqa: E402

import mamba_captum as mc  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


def family_errors(family):
    torch.manual_seed(0)
    ids, mask = padded_batch()
    model = zero_bias_and_skip(liven(make_model(family)))
    records, handles = record_conv_inputs_and_out_proj_inputs(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for handle in handles:
        handle.remove()
    unified = 0.0
    for mixer, op in zip(ssm_mixers(model), ssm_operators(model, ids, mask, "unified").values()):
        H = op.maps(reduce=None).double()
        got = torch.einsum("bcis,bcs->bci", H, records[mixer]["x"].transpose(1, 2).double())
        unified = max(unified, relative_error(got, records[mixer]["out_in"].transpose(1, 2)))

    model = liven(make_model(family))
    with ScanRecorder(family) as recorder, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    hidden = impulses = 0.0
    for op, call in zip(ssm_operators(model, ids, mask, "hidden").values(), recorder.calls):
        alpha = op.maps(reduce=None).double()
        equation = "bcij,bcj->bci" if family in MAMBA1 else "bhij,bjhp->bihp"
        hidden = max(hidden, relative_error(torch.einsum(equation, alpha, call[0][0].double()), call[2]))
        reference = recorder.impulse_alpha(call) * (mask[:, None, :, None] * mask[:, None, None, :])
        impulses = max(impulses, relative_error(alpha, reference))
    _, _, errors = mc.build_operators(model, ids, mask)
    return unified, hidden, impulses, max(errors.values())


def recurrent_errors(family):
    import pytest
    from test_rwkv_griffin import Recorder, _recurrent_keys, hf_griffin, hf_rwkv, mixers, model_and_inputs

    def per_channel(maps, values):
        return torch.einsum("bcij,bjc->bic", maps.double(), values.double())

    def diagonal(jacobian, batch, channels):
        b, c = torch.arange(batch), torch.arange(channels)
        return jacobian[b[:, None], :, c[None, :], b[:, None], :, c[None, :]]

    torch.manual_seed(0)
    model, ids, kwargs = model_and_inputs(family)
    mask = torch.ones_like(ids)
    if family == "rwkv":
        mask[0, -3:], ids[0, -3:] = 0, 0
    keys = _recurrent_keys(model)
    unified = hidden = jacobian = check = 0.0
    with pytest.MonkeyPatch.context() as patch:
        if family == "recurrent_gemma":
            with torch.no_grad():
                for mixer in mixers(model):
                    mixer.conv_1d.bias.zero_()
        recorder = Recorder(model, patch)
        maps = mc.implicit_attention(model, ids, mask, reduce=None, **kwargs)
        recorder.remove()
        real = mask[:, None, :, None].double()
        for mixer, key in zip(mixers(model), keys):
            record = recorder.records[mixer]
            unified = max(unified, relative_error(per_channel(maps[key], record["values"]) * mask[..., None],
                                                  record["out_in"] * mask[..., None]))
    with pytest.MonkeyPatch.context() as patch:
        model, ids_again, kwargs = model_and_inputs(family)
        recorder = Recorder(model, patch)
        maps = mc.implicit_attention(model, ids, mask, formulation="hidden", reduce=None, **kwargs)
        recorder.remove()
        for number, (mixer, key) in enumerate(zip(mixers(model), keys)):
            if family == "rwkv":
                decay, first, k, v, wkv = recorder.wkv_calls[number]
                hidden = max(hidden, relative_error(per_channel(maps[key], v) * mask[..., None], wkv * mask[..., None]))
                jac = torch.func.jacrev(lambda x: hf_rwkv.rwkv_linear_attention_cpu(
                    decay.double(), first.double(), k.double(), x)[0])(v.double())
                reference = diagonal(jac, *v.shape[::2]) * real * mask[:, None, None, :]
                jacobian = max(jacobian, relative_error(maps[key], reference))
            else:
                record = recorder.records[mixer]
                hidden = max(hidden, relative_error(per_channel(maps[key], record["scan_in"]), record["scan"]))
                normalised, gate, reset = recorder.scans[number]
                jac = torch.func.jacrev(lambda x: hf_griffin.RecurrentGemmaRglru._rnn_scan(
                    mixer.rg_lru, x, gate.double(), reset, None, torch.float64)[0])(normalised.double())
                reference = diagonal(jac, *normalised.shape[::2]) * normalised.double().transpose(1, 2)[:, :, None, :]
                conv_out = record["scan_in"].double().transpose(1, 2)[:, :, None, :]
                jacobian = max(jacobian, relative_error(maps[key].double() * conv_out, reference))
        _, _, errors = mc.build_operators(model, ids, mask, **kwargs)
        check = max(errors[key] for key in keys)
    return unified, hidden, jacobian, check


if __name__ == "__main__":
    print("| family | mixer | unified identity | hidden identity | hidden vs impulses | rebuilt layer output |")
    print("|---|---|---|---|---|---|")
    for family in CONFIGS:
        mixer = type(ssm_mixers(make_model(family))[0]).__name__
        print(f"| {family} | {mixer} | " + " | ".join(f"{e:.1e}" for e in family_errors(family)) + " |", flush=True)
    for family, mixer in (("rwkv", "RwkvSelfAttention"), ("recurrent_gemma", "RecurrentGemmaRecurrentBlock")):
        print(f"| {family} | {mixer} | " + " | ".join(f"{e:.1e}" for e in recurrent_errors(family)) + " |",
              flush=True)
