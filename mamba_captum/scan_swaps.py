"""The swaps of :mod:`mamba_captum.fast_scans`: for each of HF's recurrent scans, where its function lives, the
dispatcher that replaces it, the probe and tolerances of its swap check (:mod:`mamba_captum.scan_checks`), and the
shared patch that installs the dispatcher (:data:`PATCHES`).

A dispatcher sends a call to the fast scan only when the calling thread is inside ``fast_scans()`` with its swap
(:func:`thread_depth`); every other call goes to HF's own function. Which fast scan each dispatcher picks, per device
and dtype: the docstring of :mod:`mamba_captum.fast_scans`.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

import torch

from .kernels.rglru_scan import rglru_scan_chunked, rglru_scan_triton
from .kernels.scans import ssd_scan_reference
from .kernels.selective_scan import selective_scan_chunked, selective_scan_triton
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


def thread_depth() -> dict:
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
        scan = original if not thread_depth().get(path) else _fast_scan_for(hidden_states, lambda: original)
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
        if not thread_depth().get(name) or key.shape[1] == 1 or (on_cuda and hf_rwkv.rwkv_cuda_kernel is not None):
            return original(time_decay, time_first, key, value, state=state, return_state=return_state)
        scan = wkv_scan_triton if on_cuda and _on_triton(key) else wkv_scan_chunked
        return scan(time_decay, time_first, key, value, state=state, return_state=return_state)

    rwkv_linear_attention.original = original
    return rwkv_linear_attention


def _rglru_dispatcher(name, original):
    def _rnn_scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
        # HF's own method: a thread outside fast_scans(), a single token (HF's one-step decode branch, which also
        # returns the input itself when there is no state), or an accumulation dtype other than HF's default
        if not thread_depth().get(name) or hidden_states.shape[1] == 1 or acc_dtype != torch.float32:
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
        if (not thread_depth().get(name) or hidden_states.device.type == "cuda"
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

    The swap check (:func:`mamba_captum.fast_scans.check_swap`) runs ``probe`` on HF's function and on the dispatcher's fast path and
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


def leave(depth: dict, key: str):
    """One ``fast_scans()`` context of this thread (``depth``: :func:`thread_depth`) leaves the swap ``key``."""
    depth[key] -= 1
    if not depth[key]:
        del depth[key]
