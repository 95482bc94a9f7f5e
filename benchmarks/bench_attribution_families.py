"""Benchmark: MambaAttribution against one forward + backward and against Captum's LayerIntegratedGradients-50,
for every supported text family, in one run.

Models: the tests' tiny random models (``tests/tiny_models.py``: d_model 32, 2-4 layers, fixed seed), every family,
batch 1, fp32, L tokens. Tiny models are the hard case for the "≤ 2× forward + backward" target: the library's fixed
costs per layer (the float64 rebuild and check, the maps) weigh most next to a cheap forward.

For each family, in one process:
  fwd_bwd      one forward and backward of the target logit inside ``mc.fast_scans(model)`` (best of 3);
  attribution  ``MambaAttribution(model).attribute(ids, target=t)`` (``RWKVAttribution`` for RWKV), best of 2;
  lig          Captum's ``LayerIntegratedGradients`` on the input embeddings, n_steps = 50, internal batch 10,
               inside ``mc.fast_scans(model)`` (once).
Ratios: attribution / fwd_bwd (target ≤ 2) and lig / attribution (target ≥ 20).

Run:  python benchmarks/bench_attribution_families.py [--length 512] [--families mamba rwkv ...]
"""
from __future__ import annotations

import argparse
import platform
import sys
import warnings
from pathlib import Path

import torch
import transformers as tf
from captum.attr import LayerIntegratedGradients

import mamba_captum as mc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models  # noqa: E402
from bench_linear_families import best_of  # noqa: E402 (this folder is on sys.path when a script of it runs)

BASE_MODEL_ONLY = ("glm5_next",)  # no logits to explain without a forward_func of the user's
FAMILIES = [*tiny_models.CONFIGS, *tiny_models.RECURRENT_CONFIGS, *tiny_models.LINEAR_CONFIGS,
            *tiny_models.ZAMBA_CONFIGS]


def last_logits(model, ids, **kwargs):
    out = model(ids, use_cache=False, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return logits[:, -1]


def measure(family: str, length: int) -> dict:
    model = tiny_models.make_model(family)
    ids = torch.randint(3, tiny_models.VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    target = 7

    def fwd_bwd():
        with mc.fast_scans(model):
            last_logits(model, ids)[0, target].backward()
        model.zero_grad(set_to_none=True)

    method = mc.RWKVAttribution(model) if family == "rwkv" else mc.MambaAttribution(model)
    embeddings = model.get_input_embeddings()
    lig = LayerIntegratedGradients(lambda x: last_logits(model, x), embeddings)

    def integrated_gradients():
        with mc.fast_scans(model):
            lig.attribute(ids, target=target, n_steps=50, internal_batch_size=10)

    fwd_bwd()  # warm-up
    result = {"family": family, "params": sum(p.numel() for p in model.parameters())}
    result["fwd_bwd"] = best_of(3, fwd_bwd)
    result["attribution"] = best_of(2, lambda: method.attribute(ids, target=target))
    result["lig"] = best_of(1, integrated_gradients)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    tf.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {tf.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; tiny random models, L = {args.length}, batch 1, fp32")
    print("| family | params | fwd + bwd (s) | MambaAttribution (s) | LIG-50 (s) | attribution / fwd+bwd "
          "| LIG-50 / attribution |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families:
        if family in BASE_MODEL_ONLY:
            print(f"| {family} | – | – | – | – | no causal-LM class in transformers (base model) | – |", flush=True)
            continue
        r = measure(family, args.length)
        print(f"| {family} | {r['params'] / 1e3:.0f}k | {r['fwd_bwd']:.2f} | {r['attribution']:.2f} | {r['lig']:.1f} "
              f"| {r['attribution'] / r['fwd_bwd']:.2f}× | {r['lig'] / r['attribution']:.0f}× |", flush=True)


if __name__ == "__main__":
    main()
