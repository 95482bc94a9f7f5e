"""End-to-end check on a device: one explanation per family, in float32 there, against float64 on the CPU.

For every tiny model of ``tests/tiny_models.py`` (CONFIGS, RECURRENT_CONFIGS, LINEAR_CONFIGS, ZAMBA_CONFIGS, and
the tiny Vision Mamba ``make_vim``) the same weights run twice:

- reference: a float64 copy on the CPU (the blocked torch map kernels, the chunked scans);
- device: a float32 copy on ``--device`` (on CUDA: the Triton map kernels and the Triton scans of ``fast_scans``).

On the device, ``mc.implicit_attention`` (every layer's mean map), ``mc.MambaAttribution`` (``RWKVAttribution`` for
RWKV) and ``mc.MambaLRP`` (where the family has rules: its constructor says) run once on their own and once inside
an outer ``with mc.fast_scans(model)``; each result is compared with the reference (max |Δ| / max |reference|,
per layer for the maps, the largest over both runs). "fwd+bwd" compares the gradient of the explained score with
respect to the input embeddings (pixels for Vim) from HF's own scans (no ``fast_scans``) with the fast scans' one,
each against the reference. Batch 2 of 16 tokens (the selective-SSM families with the first example left-padded),
target 7 (class 2 for Vim).

Prints one table row per family (times in seconds on the device, the first run including Triton's compilation)
and a final PASS / FAIL count; exits 1 on any failure or error, 2 when the device is missing.

Run:  python benchmarks/gpu_end_to_end.py [--device cuda|cpu] [--families mamba rwkv vim ...]
(``bash .ci/gpu`` runs it on CUDA; ``bash .ci/gpu --dry-run`` on the CPU.)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import transformers as tf

import mamba_captum as mc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models  # noqa: E402

LENGTH, PADS, TARGET, VIM_CLASS = 16, 3, 7, 2
# fp32 on the device against fp64: the maps are one float32 rounding of exact products (observed ≤ 1e-6 on CPU);
# gradients and the attributions built on them pass through a whole float32 forward and backward.
TOLERANCE = {"fwd+bwd": 1e-4, "maps": 1e-4, "attribution": 1e-4, "lrp": 1e-4}
TEXT_FAMILIES = [*tiny_models.CONFIGS, *tiny_models.RECURRENT_CONFIGS, *tiny_models.LINEAR_CONFIGS,
                 *tiny_models.ZAMBA_CONFIGS]
FAMILIES = [*TEXT_FAMILIES, "vim"]


@dataclass
class Case:
    """One family's model (float32, CPU), inputs, and how its explained scores are formed."""
    family: str
    model: torch.nn.Module
    inputs: torch.Tensor
    mask: Optional[torch.Tensor]
    target: int
    head: Optional[torch.nn.Module] = None  # a base model without logits (glm5_next): a linear head of our own

    @property
    def image(self) -> bool:
        return self.family == "vim"


def make_case(family: str) -> Case:
    generator = torch.Generator().manual_seed(0)
    if family == "vim":
        pixels = torch.randn(2, 3, tiny_models.VIM["img_size"], tiny_models.VIM["img_size"], generator=generator)
        return Case(family, tiny_models.make_vim(), pixels, None, VIM_CLASS)
    # The families whose tests pad left get a left-padded first example (the others ignore or refuse the mask);
    # their attention layers run sdpa: HF's eager attention gives NaN on fully padded rows in float64.
    padded = family in tiny_models.CONFIGS
    try:
        model = tiny_models.make_model(family, attn_implementation="sdpa" if padded else "eager")
    except ValueError:  # no attention layers, so no sdpa (HF refuses the setting)
        model = tiny_models.make_model(family)
    ids = torch.randint(3, tiny_models.VOCAB, (2, LENGTH), generator=generator)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        ids[0, :PADS], mask[0, :PADS] = 0, 0
    head = None
    if model.get_output_embeddings() is None:  # a base model (make_model's fallback): no logits of its own
        torch.manual_seed(1)
        head = torch.nn.Linear(model.config.hidden_size, TARGET + 1)
    return Case(family, model, ids, mask, TARGET, head)


def on(case: Case, device: str, dtype: torch.dtype) -> Case:
    """A copy of the case on ``device`` in ``dtype`` (the token ids and the mask keep theirs)."""
    move = lambda module: None if module is None else copy.deepcopy(module).to(device=device, dtype=dtype)  # noqa: E731
    inputs = case.inputs.to(device=device, dtype=dtype if case.image else case.inputs.dtype)
    mask = None if case.mask is None else case.mask.to(device)
    return Case(case.family, move(case.model), inputs, mask, case.target, move(case.head))


def forward_func(case: Case) -> Optional[Callable]:
    """The (B, K) scores of a base model through the case's head; None where the library forms them itself."""
    if case.head is None:
        return None
    return lambda ids, attention_mask=None: case.head(
        case.model(ids, attention_mask=attention_mask).last_hidden_state[:, -1])


def score_gradient(case: Case) -> torch.Tensor:
    """d(sum of the explained scores of the target) / d(input embeddings), or / d(pixels) for Vim."""
    if case.image:
        pixels = case.inputs.detach().requires_grad_()
        case.model(pixels)[:, case.target].sum().backward()
        return pixels.grad.detach()
    kept = []

    def keep(module, args, output):  # returns None: the output itself flows on
        output.retain_grad()
        kept.append(output)

    handle = case.model.get_input_embeddings().register_forward_hook(keep)
    try:
        if case.head is not None:
            scores = forward_func(case)(case.inputs, attention_mask=case.mask)
        else:
            scores = case.model(case.inputs, attention_mask=case.mask, use_cache=False).logits[:, -1]
        scores[:, case.target].sum().backward()
    finally:
        handle.remove()
    case.model.zero_grad(set_to_none=True)
    return kept[0].grad.detach()


def explain(case: Case) -> dict:
    """maps (dict layer -> map), attribution (B, L), lrp (B, L) or None where the family has no LRP rules."""
    masked = {} if case.mask is None else {"attention_mask": case.mask}
    maps = mc.implicit_attention(case.model, case.inputs, case.mask)
    attribution_class = mc.RWKVAttribution if case.family == "rwkv" else mc.MambaAttribution
    attribution = attribution_class(case.model, forward_func=forward_func(case)).attribute(
        case.inputs, target=case.target, **masked)
    try:
        lrp_method = mc.MambaLRP(case.model, forward_func=forward_func(case))
    except NotImplementedError:  # no rules for this family (or image models): nothing to compare
        lrp = None
    else:
        lrp = lrp_method.attribute(case.inputs, target=case.target, **masked)
    return {"maps": maps, "attribution": attribution, "lrp": lrp}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the tests' measure), in float64 on the CPU."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if not torch.isfinite(actual).all():
        return float("inf")
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    return error / scale if scale > 0 else error


def compare(got: dict, expected: dict) -> dict:
    errors = {}
    if set(got["maps"]) != set(expected["maps"]):
        raise AssertionError(f"layers differ: {sorted(got['maps'])} vs {sorted(expected['maps'])}")
    errors["maps"] = max(relative_error(got["maps"][k], expected["maps"][k]) for k in expected["maps"])
    errors["attribution"] = relative_error(got["attribution"], expected["attribution"])
    if expected["lrp"] is not None:
        errors["lrp"] = relative_error(got["lrp"], expected["lrp"])
    return errors


def timed(function, device: str):
    start = time.perf_counter()
    result = function()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def check_family(family: str, device: str) -> dict:
    case = make_case(family)
    reference = on(case, "cpu", torch.float64)
    expected = explain(reference)
    expected_gradient = score_gradient(reference)
    run = on(case, device, torch.float32)
    hf_gradient = score_gradient(run)
    with mc.fast_scans(run.model):
        fast_gradient = score_gradient(run)
    errors = {"fwd+bwd": max(relative_error(hf_gradient, expected_gradient),
                             relative_error(fast_gradient, expected_gradient))}
    seconds = []
    for outer in (contextlib.nullcontext(), mc.fast_scans(run.model)):
        with outer:
            got, elapsed = timed(lambda: explain(run), device)
        seconds.append(elapsed)
        for name, error in compare(got, expected).items():
            errors[name] = max(errors.get(name, 0.0), error)
    failed = [name for name, error in errors.items() if not error <= TOLERANCE[name]]
    return {"errors": errors, "seconds": seconds, "failed": failed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_end_to_end: no CUDA device (torch.cuda.is_available() is False); use --device cpu")
        sys.exit(2)
    warnings.filterwarnings("ignore")
    tf.logging.set_verbosity_error()
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    tf32 = (f"; TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, cuDNN {torch.backends.cudnn.allow_tf32}"
            if args.device == "cuda" else "")
    print(f"# {where}; torch {torch.__version__}, transformers {tf.__version__}, mamba_captum from "
          f"{Path(mc.__file__).parent}{tf32}")
    print(f"# float32 on {args.device} vs float64 on the CPU, batch 2 × {LENGTH} tokens; max relative difference, "
          f"tolerance {TOLERANCE['maps']:.0e}; times: the methods on their own (first run: compiles) / inside "
          "mc.fast_scans")
    print("| family | fwd+bwd: HF and fast scans | maps | attribution | LRP | time (s) | result |")
    print("|---|---|---|---|---|---|---|")
    failures, crashes = [], []
    for family in args.families:
        try:
            result = check_family(family, args.device)
        except Exception as error:  # noqa: BLE001 (one family's error is that family's FAIL, the rest still run)
            crashes.append((family, traceback.format_exc()))
            failures.append(family)
            print(f"| {family} | – | – | – | – | – | FAIL: {type(error).__name__}: {str(error)[:100]} |", flush=True)
            continue
        errors, seconds = result["errors"], result["seconds"]
        cell = lambda name: f"{errors[name]:.1e}" if name in errors else "no rules"  # noqa: E731
        verdict = "PASS" if not result["failed"] else "FAIL: " + ", ".join(result["failed"])
        if result["failed"]:
            failures.append(family)
        print(f"| {family} | {cell('fwd+bwd')} | {cell('maps')} | {cell('attribution')} | {cell('lrp')} "
              f"| {seconds[0]:.2f} / {seconds[1]:.2f} | {verdict} |", flush=True)
    for family, trace in crashes:
        print(f"\n## {family}\n{trace}", file=sys.stderr)
    print(f"\nPASS {len(args.families) - len(failures)}, FAIL {len(failures)}"
          + (f" ({', '.join(failures)})" if failures else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
