"""``fast_scans``: run HF's recurrent scans on fast, exact, differentiable implementations.

HF's torch paths for Mamba-1's selective scan, RWKV-4's WKV and Griffin's RG-LRU are per-token Python loops under
autograd whose backward grows faster than L (each token's output is written into a preallocated tensor, and the
backward of every such write copies a full-size gradient); gradient methods (ours, and Captum's own baselines)
spend nearly all their time there. Inside ``fast_scans()`` the functions the mixers look up at call time are
replaced by dispatchers:

- Mamba-1: the module-level ``mamba_selective_scan`` of ``modeling_mamba``, ``modeling_falcon_mamba``,
  ``modeling_jamba`` and ``modeling_zamba``. CUDA tensors go to the function that was there when mamba-ssm is
  installed (its fused CUDA kernel), else float32 CUDA tensors to
  :func:`mamba_captum.kernels.selective_scan.selective_scan_triton`, everything else to
  :func:`mamba_captum.kernels.selective_scan.selective_scan_chunked`.
- RWKV-4: the module-level ``rwkv_linear_attention`` of ``modeling_rwkv`` (``RwkvSelfAttention.forward`` calls it
  with the layer's state). HF's own function where HF would run its hub CUDA kernel (fused already) and for a
  single token (one step, no loop); else CUDA tensors (not float64) go to
  :func:`mamba_captum.kernels.wkv_scan.wkv_scan_triton`, everything else to
  :func:`mamba_captum.kernels.wkv_scan.wkv_scan_chunked`.
- Mamba-2 and its hybrids (Bamba, Zamba2, NemotronH, FalconH1, GraniteMoeHybrid): the module-level
  ``mamba2_chunk_scan`` of each model file, HF's torch SSD (no Python loop over tokens, but it repeats C·Bᵀ for
  every head of a group, and its einsums run slowly on CPU). CPU tensors go to
  :func:`mamba_captum.kernels.scans.ssd_scan_reference` (C·Bᵀ once per group, batched matmuls, float64
  exponents; float32 as HF's: one 130m-shaped layer runs its forward 2.8-4.3× and its forward + backward 2.3-2.8×
  faster, ``benchmarks/bench_ssd_scan.py``); CUDA tensors, a gate ``z`` and
  packed sequences (``seq_idx`` / ``cu_seqlens``) stay on HF's function (on CUDA it is mamba-ssm's kernel when
  installed).
- Griffin / RecurrentGemma: the method ``RecurrentGemmaRglru._rnn_scan``, swapped on the class. HF's own method
  for a single token (its one-step decode branch) and for an ``acc_dtype`` other than its default float32; else
  CUDA tensors (not float64) go to :func:`mamba_captum.kernels.rglru_scan.rglru_scan_triton`, everything else to
  :func:`mamba_captum.kernels.rglru_scan.rglru_scan_chunked`.

Each fast scan equals HF's path to float rounding — outputs, returned states and caches, and the gradients of
every input — with a linear-in-L backward (float64 inputs accumulate in float64, where HF's loops use float32).
The library enters it around its own forward passes.

The swap is per thread: a dispatcher is installed while any thread is inside ``fast_scans()`` (a
:class:`mamba_captum.session.SharedPatch`, restored when the last thread leaves, in any interleaving), and it
sends a call to the fast scan only when the calling thread itself is inside ``fast_scans()``; other threads get
HF's own function.

The swap check: a new transformers release may change what one of these functions computes, and a swapped one
would then give other numbers without a word. So the first ``fast_scans()`` of the process that needs a swap checks
it (:func:`check_swap`; once per swap key, under a lock, the result cached for the process):

- HF's function missing (an older or newer transformers, a model file gone): nothing to swap, HF's code runs, no
  warning;
- its ``inspect.signature`` must be the parameters the dispatcher forwards (names, order, kinds, defaults), plus
  only known keywords that leave the result unchanged or that the dispatcher sends to HF;
- a probe (a few tokens, float64, on the CPU, with every argument the mixers pass: initial states, D skip, Δ bias
  and softplus, Δ limits, resets) runs through HF's function and through the dispatcher's fast path: the outputs,
  returned final states and, by one vector-Jacobian product, the gradients of every input must agree to a relative
  1e-10 where HF computes in float64, 1e-6 for the gradients HF rounds to float32 (Mamba-1, RWKV-4) and 1e-5 for
  the SSD, which HF computes in float32 (the measured floors are 10-40 times smaller; docs/kernels.md).

A swap that fails stays unswapped for the process, with one :class:`ScanMismatchWarning` naming the function, the
transformers version and the difference (or the signature, or the error). The check adds 5-11 ms (one CPU thread)
to the first ``fast_scans()`` of a model, once per swap and process (docs/kernels.md); :func:`swap_checks` lists the
outcomes, :func:`reset_swap_checks` forgets them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import math
import threading
import time
import warnings
from typing import Callable, Optional

import torch

from .kernels.rglru_scan import rglru_scan_chunked, rglru_scan_triton
from .kernels.scans import ssd_scan_reference
from .kernels.selective_scan import selective_scan_chunked, selective_scan_triton
# selective_scan: the library's own models' scan, kept importable from here (it lives with the kernels)
from .kernels.selective_scan import selective_scan  # noqa: F401
from .kernels.selective_scan.fastest import has_mamba_ssm as _has_mamba_ssm  # the dispatchers' (tests replace it)
from .kernels.triton_maps import triton_available
from .kernels.wkv_scan import wkv_scan_chunked, wkv_scan_triton
from .session import SharedPatch, thread_state

SCAN_MODULES = {
    "MambaMixer": "transformers.models.mamba.modeling_mamba",
    "FalconMambaMixer": "transformers.models.falcon_mamba.modeling_falcon_mamba",
    "JambaMambaMixer": "transformers.models.jamba.modeling_jamba",
    "ZambaMambaMixer": "transformers.models.zamba.modeling_zamba",  # one call per head
}
SSD_MODULES = {
    "Mamba2Mixer": "transformers.models.mamba2.modeling_mamba2",
    "BambaMixer": "transformers.models.bamba.modeling_bamba",
    "Zamba2MambaMixer": "transformers.models.zamba2.modeling_zamba2",
    "NemotronHMamba2Mixer": "transformers.models.nemotron_h.modeling_nemotron_h",
    "FalconH1Mixer": "transformers.models.falcon_h1.modeling_falcon_h1",
    "GraniteMoeHybridMambaLayer": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
}
RWKV_MODULE = "transformers.models.rwkv.modeling_rwkv"
GRIFFIN_MODULE = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"


def _thread_depth() -> dict:
    """swap key -> how many ``fast_scans()`` contexts of this thread have it swapped."""
    return thread_state("fast_scans", dict)


def _fast_scan_for(u: torch.Tensor, mamba_ssm_scan):
    """The fastest exact scan for ``u``'s device and dtype: mamba-ssm's (``mamba_ssm_scan``) on CUDA when installed,
    else Triton on CUDA (not float64), else the chunked torch scan."""
    if u.device.type == "cuda":
        if _has_mamba_ssm():
            return mamba_ssm_scan()
        if triton_available() and u.dtype != torch.float64:
            return selective_scan_triton
    return selective_scan_chunked


def _on_triton(x: torch.Tensor) -> bool:
    """Triton for CUDA tensors that are not float64 (the kernels accumulate in float32)."""
    return x.device.type == "cuda" and triton_available() and x.dtype != torch.float64


def _dispatcher(path, original):
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             return_last_state=False, **kwargs):
        # a thread outside fast_scans(): HF's own function; HF's other keywords (use_mambapy, use_associative_scan:
        # other algorithms for the same scan) go to HF's function, and the fast scans ignore them
        scan = original if not _thread_depth().get(path) else _fast_scan_for(hidden_states, lambda: original)
        return scan(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                    return_last_state=return_last_state, **kwargs)

    mamba_selective_scan.original = original
    return mamba_selective_scan


def _wkv_dispatcher(name, original):
    hf_rwkv = importlib.import_module(RWKV_MODULE)

    def rwkv_linear_attention(time_decay, time_first, key, value, state=None, return_state=False):
        on_cuda = all(t.device.type == "cuda" for t in (time_decay, time_first, key, value))
        # HF's own function: a thread outside fast_scans(), a single token (one step, no loop to speed up), or the
        # tensors HF sends to its hub CUDA kernel (fused already)
        if not _thread_depth().get(name) or key.shape[1] == 1 or (on_cuda and hf_rwkv.rwkv_cuda_kernel is not None):
            return original(time_decay, time_first, key, value, state=state, return_state=return_state)
        scan = wkv_scan_triton if on_cuda and _on_triton(key) else wkv_scan_chunked
        return scan(time_decay, time_first, key, value, state=state, return_state=return_state)

    rwkv_linear_attention.original = original
    return rwkv_linear_attention


def _rglru_dispatcher(name, original):
    def _rnn_scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
        # HF's own method: a thread outside fast_scans(), a single token (HF's one-step decode branch, which also
        # returns the input itself when there is no state), or an accumulation dtype other than HF's default
        if not _thread_depth().get(name) or hidden_states.shape[1] == 1 or acc_dtype != torch.float32:
            return original(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
        decay = recurrent_gate * ~reset  # as HF: the state restarts where position_ids == 0
        if recurrent_states is not None:
            recurrent_states = recurrent_states.to(hidden_states.device)
        scan = rglru_scan_triton if _on_triton(hidden_states) else rglru_scan_chunked
        return scan(hidden_states, decay, recurrent_states)

    _rnn_scan.original = original
    return _rnn_scan


def _ssd_dispatcher(name, original):
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        # HF's own function: a thread outside fast_scans(), CUDA tensors (mamba-ssm's kernel where installed), a gate
        # z, or packed sequences (seq_idx / cu_seqlens: HF's torch path refuses them). Other keywords the layers
        # pass down (position_embeddings, output_router_logits ...) HF's wrapper drops before its torch function.
        if (not _thread_depth().get(name) or hidden_states.device.type == "cuda"
                or any(kwargs.get(key) is not None for key in ("z", "seq_idx", "cu_seqlens"))):
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        if dt_bias is not None:  # HF's discretisation, as its function does it
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = torch.nn.functional.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        x = hidden_states.float()  # HF computes the scan in float32, whatever the model's dtype
        y, final = ssd_scan_reference(x, dt.float(), A.float(), B.float(), C.float(), initial_state=initial_states,
                                      return_final_state=True)
        if D is not None:
            y = y + D[..., None] * x
        y = y.contiguous()  # as HF's: FalconH1Mixer calls .view() on it
        return (y, final) if return_final_states else y

    mamba2_chunk_scan.original = original
    return mamba2_chunk_scan


# -- the probes of the swap check: one small float64 call of a scan, its outputs and one vector-Jacobian product ----
def _normal(generator: torch.Generator):
    """Draw (*shape) -> standard normal float64 values that float32 represents exactly: HF's functions round some
    inputs to float32 (RWKV's keys, all of the SSD's), so no input rounding separates the two paths."""
    return lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float32).double()


def _dyadic(generator: torch.Generator):
    """Draw (*shape) -> float64 multiples of 1/2 in [-1, 1]: with decays in {1/4, 1/2, 3/4} and a few tokens every
    product and sum of HF's float32 RG-LRU loop (forward and backward) is exact, so float32 and float64 agree."""
    return lambda *shape: torch.randint(-2, 3, shape, generator=generator).double() / 2


def _with_vjp(outputs: dict, inputs: dict, draw) -> dict:
    """``outputs`` (detached), then the gradient of ``Σ_k <w_k, outputs_k>`` (weights w drawn by ``draw``) with
    respect to every input, named ``∂name``: one backward pass checks the gradients of all inputs at once. An input
    the function does not use gets a zero gradient."""
    weights = [draw(*out.shape) for out in outputs.values()]
    loss = sum((out * weight.to(out.dtype)).sum() for out, weight in zip(outputs.values(), weights))
    grads = torch.autograd.grad(loss, list(inputs.values()), allow_unused=True)
    parts = {name: out.detach() for name, out in outputs.items()}
    parts.update({f"∂{name}": torch.zeros_like(x) if grad is None else grad
                  for (name, x), grad in zip(inputs.items(), grads)})
    return parts


def _leaves(tensors: dict) -> dict:
    return {name: tensor.requires_grad_() for name, tensor in tensors.items()}


def _probe_selective_scan(scan) -> dict:
    """Mamba-1: ``scan(u, dt, A, B, C, D, z, delta_bias, delta_softplus=True, return_last_state=True)`` with u, dt,
    z (2, 3, 6), A (3, 2) < 0, B, C (2, 2, 6), D, delta_bias (3,) -> output (2, 3, 6), final state (2, 3, 2) and the
    gradients of all eight inputs (the arguments the Mamba-1 mixers pass)."""
    draw = _normal(torch.Generator().manual_seed(0))
    batch, channels, state, length = 2, 3, 2, 6
    inputs = _leaves(dict(hidden_states=draw(batch, channels, length), dt=draw(batch, channels, length),
                          A=-draw(channels, state).abs() - 0.25, B=draw(batch, state, length),
                          C=draw(batch, state, length), D=draw(channels), z=draw(batch, channels, length),
                          delta_bias=draw(channels)))
    u, dt, A, B, C, D, z, delta_bias = inputs.values()
    y, last = scan(u, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=True, return_last_state=True)
    return _with_vjp({"output": y, "final state": last}, inputs, draw)


def _probe_ssd(scan) -> dict:
    """Mamba-2 SSD: ``scan(x, dt, A, B, C, chunk_size=4, D, dt_bias, initial_states, dt_softplus=True,
    dt_limit=(0.2, 1.5), return_final_states=True, z=None)`` with x (2, 7, 4, 2) (4 heads of 2), dt (2, 7, 4),
    A (4,) < 0, B, C (2, 7, 2, 3) (2 groups), D, dt_bias (4,), initial states (2, 4, 2, 3) -> output (2, 7, 4, 2),
    final state (2, 4, 2, 3) and the gradients of all eight inputs. 7 tokens in chunks of 4: HF's padding and its
    state passing between chunks; the limits clamp some Δ at both ends; ``z=None`` as the mixers pass it."""
    draw = _normal(torch.Generator().manual_seed(0))
    batch, length, heads, head_dim, groups, state = 2, 7, 4, 2, 2, 3
    inputs = _leaves(dict(hidden_states=draw(batch, length, heads, head_dim), dt=draw(batch, length, heads),
                          A=-draw(heads).abs() - 0.25, B=draw(batch, length, groups, state),
                          C=draw(batch, length, groups, state), D=draw(heads), dt_bias=draw(heads),
                          initial_states=draw(batch, heads, head_dim, state)))
    x, dt, A, B, C, D, dt_bias, initial_states = inputs.values()
    y, final = scan(x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias, initial_states=initial_states,
                    dt_softplus=True, dt_limit=(0.2, 1.5), return_final_states=True, z=None)
    return _with_vjp({"output": y, "final state": final}, inputs, draw)


def _probe_wkv(scan) -> dict:
    """RWKV-4 WKV: ``scan(time_decay, time_first, key, value, state=[num, den, max], return_state=True)`` with
    time_decay, time_first (3,), key, value (2, 6, 3), a state of three (2, 3) -> output (2, 6, 3), the three final
    states and the gradients of all seven inputs (a layer's state, as RwkvSelfAttention passes it with a cache)."""
    draw = _normal(torch.Generator().manual_seed(0))
    batch, length, channels = 2, 6, 3
    inputs = _leaves(dict(time_decay=draw(channels), time_first=draw(channels), key=draw(batch, length, channels) * 2,
                          value=draw(batch, length, channels), numerator=draw(batch, channels),
                          denominator=draw(batch, channels).abs() + 0.5, max=draw(batch, channels)))
    time_decay, time_first, key, value, *state = inputs.values()
    out, (numerator, denominator, running_max) = scan(time_decay, time_first, key, value, state=state,
                                                      return_state=True)
    return _with_vjp({"output": out, "final numerator": numerator, "final denominator": denominator,
                      "final max": running_max}, inputs, draw)


def _probe_rglru(scan) -> dict:
    """Griffin RG-LRU: ``scan(None, x, a, reset, h0)`` (the method, its module unused) with x, a (2, 4, 3), a in
    {1/4, 1/2, 3/4}, reset (2, 4, 1) true at one token, h0 (2, 3) -> output (2, 4, 3), final state (2, 3) and the
    gradients of x, a and h0. Dyadic values (see :func:`_dyadic`): HF accumulates in float32 even for float64
    inputs, and on these values float32 rounds nothing."""
    generator = torch.Generator().manual_seed(0)
    draw = _dyadic(generator)
    batch, length, channels = 2, 4, 3
    decay = torch.randint(1, 4, (batch, length, channels), generator=generator).double() / 4
    inputs = _leaves(dict(hidden_states=draw(batch, length, channels), recurrent_gate=decay,
                          recurrent_states=draw(batch, channels)))
    reset = torch.zeros(batch, length, 1, dtype=torch.bool)
    reset[0, 2] = True  # the state restarts there (position_ids == 0)
    x, a, h0 = inputs.values()
    y, last = scan(None, x, a, reset, h0)
    return _with_vjp({"output": y, "final state": last}, inputs, draw)


@dataclasses.dataclass(frozen=True)
class Swap:
    """``attribute`` of ``module`` (or of its class ``owner``), replaced by ``dispatcher(key, original)`` for models
    holding one of ``mixers``.

    The swap check (:func:`check_swap`) runs ``probe`` on HF's function and on the dispatcher's fast path and
    accepts relative differences up to ``tolerances`` (outputs and final states, input gradients); HF parameters
    beyond the dispatcher's own must be in ``passthrough`` (keywords that do not change the result, or that the
    dispatcher sends to HF's function)."""

    mixers: tuple
    module: str
    owner: Optional[str]
    attribute: str
    dispatcher: Callable
    probe: Callable
    tolerances: tuple
    passthrough: frozenset = frozenset()


# Relative tolerances (max |fast - HF| / max |HF| of each part), from the floors measured on the probes and on 300
# other seeds of their inputs (docs/kernels.md, "The swap check"):
# - float64 where HF computes float64 inputs in float64: Mamba-1's and RWKV-4's outputs and states (floor 7e-16),
#   and all of the RG-LRU probe, whose dyadic values HF's float32 loop computes exactly (floor 0);
# - their gradients where HF's loops cast an input to float32 (Mamba-1: B and u; RWKV-4: the key), so that its
#   gradient is rounded to float32: floor 2.7e-8 / 4.3e-8 on the probes, 2.1e-7 at worst over the seeds;
# - HF's SSD, which computes in float32 whatever the inputs: floor 2.5e-7 on the probe, 1.4e-6 at worst.
# Any change of what a function computes (a term, a discretisation, a state) moves the probe by far more.
FLOAT64 = 1e-10
FLOAT32_CAST_GRADIENTS = 1e-6
FLOAT32 = 1e-5

# key (also the thread-depth key) -> swap
SWAPS = {path: Swap((mixer,), path, None, "mamba_selective_scan", _dispatcher, _probe_selective_scan,
                    (FLOAT64, FLOAT32_CAST_GRADIENTS), frozenset({"use_mambapy", "use_associative_scan"}))
         for mixer, path in SCAN_MODULES.items()}
SWAPS.update({path: Swap((mixer,), path, None, "mamba2_chunk_scan", _ssd_dispatcher, _probe_ssd, (FLOAT32, FLOAT32),
                         frozenset({"z", "seq_idx", "cu_seqlens"}))
              for mixer, path in SSD_MODULES.items()})
SWAPS[RWKV_MODULE] = Swap(("RwkvSelfAttention",), RWKV_MODULE, None, "rwkv_linear_attention", _wkv_dispatcher,
                          _probe_wkv, (FLOAT64, FLOAT32_CAST_GRADIENTS))
SWAPS[f"{GRIFFIN_MODULE}.RecurrentGemmaRglru"] = Swap(("RecurrentGemmaRglru",), GRIFFIN_MODULE, "RecurrentGemmaRglru",
                                                       "_rnn_scan", _rglru_dispatcher, _probe_rglru, (FLOAT64, FLOAT64))


def _install(key):
    swap = SWAPS[key]
    owner = importlib.import_module(swap.module)
    if swap.owner is not None:
        owner = getattr(owner, swap.owner)
    original = getattr(owner, swap.attribute)
    dispatcher = swap.dispatcher(key, original)
    dispatcher.swap_key = key  # check_swap finds HF's function behind an installed dispatcher by it
    setattr(owner, swap.attribute, dispatcher)
    return owner, swap.attribute, original, dispatcher


def _uninstall(token):
    owner, attribute, original, dispatcher = token
    if getattr(owner, attribute) is dispatcher:  # someone patched over it meanwhile: leave theirs in place
        setattr(owner, attribute, original)


PATCHES = {key: SharedPatch(lambda key=key: _install(key), _uninstall) for key in SWAPS}


# -- the swap check: each fast scan against HF's own function, once per process and swap -------------------------------
ABSENT = "absent from this transformers: nothing to swap"


class ScanMismatchWarning(UserWarning):
    """A swapped scan failed its check against HF's function (see :func:`check_swap`): HF's own function runs."""


@dataclasses.dataclass(frozen=True)
class SwapCheck:
    """The outcome of checking one swap against HF's function.

    Attributes:
        key: the swap (a key of ``SWAPS``: the model file's module path; for Griffin the module path + class).
        function: HF's function, by its dotted path.
        swapped: whether ``fast_scans()`` swaps it.
        reason: why not ("" when swapped): :data:`ABSENT` (no warning), or the signature, an error of the probe call,
            or the difference that failed.
        difference: the relative difference ``max |fast - HF| / max |HF|`` of the probe's ``part`` (output, a final
            state, ``∂input``) that came closest to (or furthest past) its ``tolerance``; nan where not measured.
        milliseconds: how long the check took.
    """

    key: str
    function: str
    swapped: bool
    reason: str
    difference: float
    part: str
    tolerance: float
    milliseconds: float


def _hf_function(key: str):
    """HF's function of the swap ``key`` (behind our dispatcher while one is installed), or None where this
    transformers has no such module or function (older releases: HF's own code path runs, nothing to swap)."""
    swap = SWAPS[key]
    try:
        owner = importlib.import_module(swap.module)
    except ImportError:
        return None
    if swap.owner is not None:
        owner = getattr(owner, swap.owner, None)
    function = getattr(owner, swap.attribute, None)
    if getattr(function, "swap_key", None) == key:
        function = function.original
    return function


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _same_default(a, b) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except (TypeError, RuntimeError, ValueError):  # a default whose == is not a truth value
        return False


def _signature_mismatch(original, dispatcher, passthrough: frozenset) -> str:
    """"" when HF's ``original`` takes the dispatcher's named parameters (same names, order, kinds and defaults),
    then only parameters in ``passthrough`` with defaults, and ``**kwargs`` only where the dispatcher takes them;
    else what differs (the dispatcher would forward the calls to a function it does not know)."""
    try:
        hf = inspect.signature(original)
    except (TypeError, ValueError) as error:
        return f"has no signature to compare ({error})"
    ours = inspect.signature(dispatcher)
    expected = [(p.name, p.kind, p.default) for p in ours.parameters.values() if p.kind not in _VARIADIC]
    named = [p for p in hf.parameters.values() if p.kind not in _VARIADIC]
    leading = [(p.name, p.kind, p.default) for p in named[:len(expected)]]
    extra = named[len(expected):]
    same = len(leading) == len(expected) and all(
        a[:2] == b[:2] and _same_default(a[2], b[2]) for a, b in zip(leading, expected))
    unknown = [p.name for p in extra if p.name not in passthrough or p.default is inspect.Parameter.empty]
    kinds = {p.kind for p in hf.parameters.values()}
    ours_kinds = {p.kind for p in ours.parameters.values()}
    variadic = [kind for kind in _VARIADIC if kind in kinds and kind not in ours_kinds]
    if same and not unknown and not variadic:
        return ""
    return f"has the signature {hf}, which the fast scan's dispatcher {ours} does not cover"


def _differences(got: dict, expected: dict) -> dict:
    """part -> ``max |got - expected| / max |expected|``; inf for a part one side lacks or of another shape, nan
    for non-finite values."""
    differences = {}
    for name in list(expected) + [name for name in got if name not in expected]:
        a, b = got.get(name), expected.get(name)
        if a is None or b is None or a.shape != b.shape:
            differences[name] = math.inf
            continue
        a, b = a.detach().double(), b.detach().double()
        scale, error = b.abs().max().item(), (a - b).abs().max().item()
        differences[name] = error / scale if scale > 0 else error
    return differences


def check_swap(key: str) -> SwapCheck:
    """Check the swap ``key`` against HF's function now (no cache; :func:`fast_scans` checks each swap once per
    process through a cache).

    1. HF's function is looked up (absent: nothing to swap, HF's code runs);
    2. its ``inspect.signature`` must match what the dispatcher forwards (``Swap.passthrough``);
    3. the swap's probe (a small float64 call with every argument the mixers pass: initial states, D skip, Δ bias
       and softplus, Δ limits) runs on HF's function and on the dispatcher's fast path, on the CPU; the outputs,
       final states and gradients of every input (one vector-Jacobian product) must agree to ``Swap.tolerances``.
    """
    swap = SWAPS[key]
    function = ".".join(part for part in (swap.module, swap.owner, swap.attribute) if part)
    start = time.perf_counter()

    def outcome(swapped: bool, reason: str, difference: float = math.nan, part: str = "",
                tolerance: float = math.nan) -> SwapCheck:
        return SwapCheck(key, function, swapped, reason, difference, part, tolerance,
                         (time.perf_counter() - start) * 1e3)

    original = _hf_function(key)
    if original is None:
        return outcome(False, ABSENT)
    dispatcher = swap.dispatcher(key, original)
    mismatch = _signature_mismatch(original, dispatcher, swap.passthrough)
    if mismatch:
        return outcome(False, mismatch)
    depth = _thread_depth()
    try:
        # whatever the caller's modes: the probes differentiate, and build their tensors on the CPU
        with torch.inference_mode(False), torch.enable_grad(), torch.device("cpu"):
            expected = swap.probe(original)
            depth[key] = depth.get(key, 0) + 1  # this thread inside fast_scans() for the dispatcher: its fast path
            try:
                got = swap.probe(dispatcher)
            finally:
                _leave(depth, key)
    except Exception as error:  # a changed function may refuse the arguments the dispatcher forwards
        return outcome(False, f"raised {type(error).__name__}: {error} on the check input")
    differences = _differences(got, expected)
    tolerance = {name: swap.tolerances[name.startswith("∂")] for name in differences}  # outputs, gradients
    # the part nearest to (or furthest past) its tolerance; nan counts as past any
    part = max(differences, key=lambda name: math.inf if math.isnan(differences[name])
               else differences[name] / tolerance[name])
    difference = differences[part]
    if not difference <= tolerance[part]:
        return outcome(False, f"differs from the fast scan by {difference:.3g} (relative, in its {part}; tolerance "
                              f"{tolerance[part]:g})", difference, part, tolerance[part])
    return outcome(True, "", difference, part, tolerance[part])


_checks: dict = {}  # key -> SwapCheck, this process's
_checks_lock = threading.Lock()


def _swap_passes(key: str) -> bool:
    """Whether ``fast_scans()`` swaps ``key``: checked on the first call in the process (under a lock, so that
    every thread waits for the one check), warning once where it fails."""
    with _checks_lock:
        result = _checks.get(key)
        if result is None:
            result = _checks[key] = check_swap(key)
            if not result.swapped and result.reason != ABSENT:
                version = importlib.import_module("transformers").__version__
                # stacklevel 4: the ``with fast_scans()`` line (through fast_scans and contextlib's __enter__)
                warnings.warn(f"{result.function} of transformers {version} {result.reason}: HF's own function runs "
                              "instead of mamba-captum's fast scan in this process (mamba_captum.fast_scans)",
                              ScanMismatchWarning, stacklevel=4)
    return result.swapped


def swap_checks() -> dict:
    """The swap checks this process has run: swap key -> :class:`SwapCheck` (outcome, measured difference, time)."""
    with _checks_lock:
        return dict(_checks)


def reset_swap_checks() -> None:
    """Forget this process's swap checks: the next ``fast_scans()`` checks each swap it needs again (and warns
    again). For tests that change a scan, and after transformers' model modules were reloaded or patched.
    Dispatchers already installed for threads inside ``fast_scans()`` stay until those threads leave."""
    with _checks_lock:
        _checks.clear()


@contextlib.contextmanager
def fast_scans(model=None):
    """Swap HF's Mamba-1, Mamba-2 (SSD), RWKV-4 and RG-LRU scans for the fast ones while the context is open, for
    the calling thread (see the module docstring).

    Args:
        model: only the scans of the mixers this model contains are swapped; None swaps all of them.

    The first use of each swap in the process checks it against HF's function (:func:`check_swap`); one that fails
    is not swapped (HF's own function runs) and warns once with a :class:`ScanMismatchWarning`.

    Example::

        with mc.fast_scans(model):
            LayerIntegratedGradients(forward, model.backbone.embeddings).attribute(ids, target=t, n_steps=50)
    """
    if model is None:
        keys = list(SWAPS)
    else:
        present = {type(m).__name__ for m in model.modules()}
        keys = [key for key, swap in SWAPS.items() if present.intersection(swap.mixers)]
    depth = _thread_depth()
    with contextlib.ExitStack() as stack:
        for key in keys:
            if not _swap_passes(key):  # absent, or it failed its check (warned once): HF's own function runs
                continue
            stack.enter_context(PATCHES[key])
            depth[key] = depth.get(key, 0) + 1
            stack.callback(_leave, depth, key)
        yield


def _leave(depth: dict, key: str):
    depth[key] -= 1
    if not depth[key]:
        del depth[key]
