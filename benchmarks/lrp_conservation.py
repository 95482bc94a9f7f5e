"""Print MambaLRP's conservation errors per family, on the tiny random models of the tests (tests/test_lrp.py).

For every covered family (batch 1, L = 12, every bias drawn in [−0.5, 0.5], 3 seeds, the worst reported):
  with biases   |Σ relevance + the biases' share − f̃| / scale, f̃ the explained logit of the modified forward and
                scale = max(1, |f̃|, |share|, Σ|relevance|) (the terms whose rounding the sums carry), float64
  no biases     |Σ relevance − f̃| / scale, every bias set to 0, float64
  |f̃ − f|       the modified forward's logit against the model's own (absolute; HF runs some float64 steps in
                float32, e.g. Mamba's RMS norms and scan inputs, the RG-LRU's accumulation)
  float32       |Σ relevance − f̃| / scale for the float32 model, biases set to 0
  Σ|R| / |f̃|   how much the token relevances cancel (float64, with biases)
The logits are the head's (the float64 ``lm_head`` on the last hidden state: HF's causal LMs cast theirs to float32).

With ``--guard``: the run-time conservation guard's own comparisons (mamba_captum.conservation.ConservationLedger), the
worst relative gap over 3 seeds × {no biases; biases in [−0.5, 0.5] with a left-padded example}, B = 2, L = 12, the
model's own logits, per model dtype: "module" (relevance out − in − biases' share, over the relevance through the
module) and "model" (Σ relevance + biases' share − the explained score, over the largest of those terms). These are the
measurements behind CONSERVATION_TOLERANCE (docs/methods/lrp.md, "The conservation guard").
Run:  python benchmarks/lrp_conservation.py [--guard] [families ...]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_lrp import CONSERVING, EXACT, SOFTMAX, explain_with_share, spread_biases, zero_biases  # noqa: E402
from tiny_models import make_model  # noqa: E402

import mamba_captum as mc  # noqa: E402
import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


def errors(family, seed):
    overrides = {**EXACT, **CONSERVING[family]}
    model = make_model(family, dtype=torch.float64, seed=seed, **overrides)
    spread_biases(model, seed=seed + 1)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
    relevance, delta, share, modified, real = explain_with_share(model, ids)
    mass = float(relevance.abs().sum())
    scale = max(1.0, abs(float(modified)), abs(share), mass)
    with_biases = abs(float(delta) + share) / scale
    versus_model = abs(float(modified) - float(real))
    zero_biases(model)
    relevance, delta, _, modified, _ = explain_with_share(model, ids)
    no_biases = abs(float(delta)) / max(1.0, abs(float(modified)), float(relevance.abs().sum()))
    model32 = make_model(family, dtype=torch.float32, seed=seed, **overrides)
    zero_biases(model32)
    relevance32, delta32, _, modified32, _ = explain_with_share(model32, ids)
    single = abs(float(delta32)) / max(1.0, abs(float(modified32)), float(relevance32.abs().sum()))
    return with_biases, no_biases, versus_model, single, mass / max(abs(float(modified)), 1e-30)


def main(families):
    print("| family | with biases (f64) | no biases (f64) | \\|f̃ − f\\| | float32 | Σ\\|R\\| / \\|f̃\\| |")
    print("|---|---|---|---|---|---|")
    for family in families:
        rows = [errors(family, seed) for seed in range(3)]
        worst = [max(column) for column in zip(*rows)]
        print(f"| {family} | {worst[0]:.1e} | {worst[1]:.1e} | {worst[2]:.1e} | {worst[3]:.1e} | {worst[4]:.2g} |")


GUARD_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
HALF_UNSUPPORTED = {"xlstm"}  # HF's xLSTM forward mixes float32 and half-precision matmuls: it does not run


def guard_gaps(family, dtype):
    """(worst module gap, its module, worst model gap), relative, over the seeds and bias settings."""
    worst_module, where, worst_model = 0.0, "", 0.0
    for seed in range(3):
        for biases in (False, True):
            padded = biases and family not in ("rwkv", "recurrent_gemma", "xlstm")  # these pad on the right only
            model = make_model(family, dtype=dtype, seed=seed, **(CONSERVING[family] if biases else {}),
                               attn_implementation="sdpa" if padded and family in SOFTMAX else "eager")
            if biases:
                spread_biases(model, seed=seed + 1)
            ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
            mask = None
            if padded:
                mask = torch.ones(2, 12, dtype=torch.long)
                mask[1, :3] = 0
            measured = []
            mc.MambaLRP(model)._relevance_and_gap(ids, 5, None, mask, None, {}, measured=measured)
            for gap in measured:
                if gap.where == "the whole model":
                    worst_model = max(worst_model, gap.relative)
                elif gap.relative > worst_module:
                    worst_module, where = gap.relative, gap.where
    return worst_module, where, worst_model


def main_guard(families):
    print("| family | " + " | ".join(f"{name} module / model" for name in GUARD_DTYPES) + " |")
    print("|---|" + "---|" * len(GUARD_DTYPES))
    for family in families:
        cells = []
        for name, dtype in GUARD_DTYPES.items():
            if family in HALF_UNSUPPORTED and dtype in (torch.float16, torch.bfloat16):
                cells.append("–")
                continue
            module, _, model = guard_gaps(family, dtype)
            cells.append(f"{module:.1e} / {model:.1e}")
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a != "--guard"]
    (main_guard if "--guard" in sys.argv[1:] else main)(arguments or list(CONSERVING))
