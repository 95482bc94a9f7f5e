"""fla's own Triton ops against the torch versions ``mc.fla_on_cpu()`` swaps in, on a device.

For every op with a run-time probe (``mamba_captum.fla_cpu.checks.PROBES``), its probe's inputs are built at a
working size (T = 128 tokens, key / value widths 64, 32 slots: the probes' own 12 tokens and widths 3-6 are below
the tile sizes of fla's chunked kernels) and run twice on the same float32 tensors:

- ``--device cuda``: fla's function itself (its Triton kernel) and the torch version, on CUDA;
- ``--device cpu`` (the dry run of ``bash .ci/gpu``): fla's torch reference named by the probe and the torch version.

Each row compares the outputs and final states (max |Δ| / max |fla's|) and, where fla's function is differentiable
there, the gradients of every floating input through one random cotangent on the output. Prints one row per op and
a PASS / FAIL count; exits 1 on a failure or an error, 2 without fla or without the device.

Run:  python benchmarks/fla_gpu_check.py [--device cuda|cpu] [--ops chunk_gla chunk_kda ...]
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback
import warnings

import torch

TOLERANCE = 2e-3  # relative, float32 (fla's kernels use TF32 products on Hopper for some ops)
# the probes' tiny sizes -> working sizes (12 tokens, 24 = 12 tokens × 2 Householder steps, widths 3-6)
SIZES = {12: 128, 24: 256, 3: 64, 4: 64, 5: 32, 6: 64}


def _sized(shape):
    return tuple(SIZES.get(int(n), int(n)) if i > 0 else int(n) for i, n in enumerate(shape))


class _WorkingSizes:
    """Inside: the probe builders' random tensors take the working sizes (their batch dimension kept)."""

    def __enter__(self):
        from mamba_captum.fla_cpu import checks
        self.checks, self.saved = checks, (checks._randn, checks._log_decay, torch.rand)
        randn, log_decay, rand = self.saved
        checks._randn = lambda generator, *shape: randn(generator, *_sized(shape))
        checks._log_decay = lambda generator, *shape: log_decay(generator, *_sized(shape))
        torch.rand = lambda *shape, **kwargs: rand(*_sized(shape), **kwargs)
        return self

    def __exit__(self, *exc):
        self.checks._randn, self.checks._log_decay, torch.rand = self.saved


def _flat(result):
    if result is None or isinstance(result, torch.Tensor):
        return [result]
    return [item for part in result for item in _flat(part)]


def _moved(value, device, grad):
    if isinstance(value, torch.Tensor):
        moved = value.detach().to(device)
        return moved.requires_grad_(grad and moved.is_floating_point())
    if isinstance(value, dict):
        return {k: _moved(v, device, grad) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device, grad) for v in value)
    return value


def _leaves(value, path="") -> dict:
    """{path: tensor} of the tensors requiring grad in a nest of dicts, tuples and lists (other values passed over)."""
    if isinstance(value, torch.Tensor):
        return {path: value} if value.requires_grad else {}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (tuple, list)) else ()
    return {k: v for name, item in items for k, v in _leaves(item, f"{path}/{name}").items()}


def _relative(got, want) -> float:
    scale = want.detach().double().abs().max().item()
    error = (got.detach().double().cpu() - want.detach().double().cpu()).abs().max().item()
    return error / scale if scale > 0 else error


def compare(name, theirs_fn, ours_fn, theirs_kwargs, ours_kwargs, device):
    """(forward error, gradient error or None) of one op on one set of inputs."""
    theirs_in, ours_in = _moved(theirs_kwargs, device, True), _moved(ours_kwargs, device, True)
    theirs, ours = _flat(theirs_fn(**theirs_in)), _flat(ours_fn(**ours_in))
    pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    forward = max(_relative(a, b) for a, b in pairs)
    cotangent = torch.randn(theirs[0].shape, generator=torch.Generator().manual_seed(1)).to(device)
    if not theirs[0].requires_grad:
        return forward, None
    # the inputs both take under the same name (a probe may rename one for fla's reference: g / gk, a / alpha)
    leaves_theirs, leaves_ours = _leaves(theirs_in), _leaves(ours_in)
    names = [name for name in leaves_theirs if name in leaves_ours]
    grads_theirs = torch.autograd.grad((theirs[0].float() * cotangent).sum(), [leaves_theirs[n] for n in names],
                                       allow_unused=True)
    grads_ours = torch.autograd.grad((ours[0].float() * cotangent).sum(), [leaves_ours[n] for n in names],
                                     allow_unused=True)
    gradient = max((_relative(a, b) for a, b in zip(grads_ours, grads_theirs) if a is not None and b is not None),
                   default=None)
    return forward, gradient


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--ops", nargs="*", default=None, help="op names (the last part of a probe's key)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    try:
        from mamba_captum.fla_cpu import SWAPS, import_fla_models
        from mamba_captum.fla_cpu.checks import PROBES, _HeadFirst
        import_fla_models()
    except ImportError as error:
        print(f"fla is not installed ({error}): nothing to check")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    swaps = {swap.key: swap for swap in SWAPS()}
    failures = 0
    print(f"{'op':<48} {'forward':>10} {'gradient':>10}  verdict  (against fla's "
          f"{'Triton kernel' if args.device == 'cuda' else 'torch reference'})")
    for key, (where, build) in PROBES.items():
        op = key.rpartition(".")[2]
        if args.ops and op not in args.ops:
            continue
        try:
            with _WorkingSizes():
                ours_kwargs, reference_kwargs = build(torch.Generator().manual_seed(0))
            sizes = "working"
            try:  # an op whose probe does not scale this way (its widths tied together) keeps the probe's sizes
                _flat(swaps[key].replacement(**_moved(ours_kwargs, "cpu", False)))
            except Exception:  # noqa: BLE001
                ours_kwargs, reference_kwargs = build(torch.Generator().manual_seed(0))
                sizes = "probe"
            if args.device == "cuda":  # fla's own function (the Triton kernel), on the op's own arguments
                theirs_fn = getattr(importlib.import_module(swaps[key].module), swaps[key].name)
                theirs_kwargs = ours_kwargs
            else:  # the probe's reference, as the run-time check calls it
                names = None
                if isinstance(where, tuple):
                    where, names = where
                module, _, function = where.partition(":")
                theirs_fn = getattr(importlib.import_module(module), function)
                if names is not None:
                    theirs_fn = _HeadFirst(theirs_fn, names)
                theirs_kwargs = reference_kwargs
            forward, gradient = compare(op, theirs_fn, swaps[key].replacement, theirs_kwargs, ours_kwargs,
                                        args.device)
        except Exception as error:  # noqa: BLE001 (a row per op, whatever fails)
            failures += 1
            print(f"{op:<48} ERROR {type(error).__name__}: {str(error)[:200]}")
            traceback.print_exc(limit=2, file=sys.stdout)
            continue
        # on the CPU only the forward is judged: some of fla's torch references normalise or rescale their inputs
        # themselves (an L2 norm, a fixed scale), so their gradients with respect to the given inputs differ by
        # construction; on CUDA fla's kernel takes the op's own arguments, and the gradients are judged too
        ok = forward <= TOLERANCE and (args.device == "cpu" or gradient is None or gradient <= TOLERANCE)
        failures += not ok
        shown = "-" if gradient is None else f"{gradient:.2e}"
        print(f"{op:<48} {forward:>10.2e} {shown:>10}  {'PASS' if ok else 'FAIL'}  ({sizes} sizes)")
    checked = sum(1 for key in PROBES if not args.ops or key.rpartition(".")[2] in args.ops)
    print(f"{'FAIL' if failures else 'PASS'}: {failures} of {checked} ops failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
