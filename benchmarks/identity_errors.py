"""Print the exactness figures per mixer: the DESIGN.md §3 identities on the tiny random models of the tests.

For every family (batch 2, first example left-padded, float32, L = 12):
  unified   max |out_proj input − Σ_s H_c[i,s] x_c[s]| / max |out_proj input|  (conv bias and D set to 0)
  hidden    max |scan output without D and gate − α u| / max |…|  (HF's own scan function, patched to record)
  impulses  max |α − α from unit impulses through HF's scan| / max |α|
  check     the relative error of the layer output rebuilt by the library (its built-in check)
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


if __name__ == "__main__":
    print("| family | mixer | unified identity | hidden identity | hidden vs impulses | rebuilt layer output |")
    print("|---|---|---|---|---|---|")
    for family in CONFIGS:
        mixer = type(ssm_mixers(make_model(family))[0]).__name__
        print(f"| {family} | {mixer} | " + " | ".join(f"{e:.1e}" for e in family_errors(family)) + " |", flush=True)
