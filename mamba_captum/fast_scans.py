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
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
from typing import Callable, Optional

import torch

from .kernels.rglru_scan import rglru_scan_chunked, rglru_scan_triton
from .kernels.scans import ssd_scan_reference
from .kernels.selective_scan import selective_scan_chunked, selective_scan_triton
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


def _has_mamba_ssm() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None


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


def _mamba_ssm_selective_scan():
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    return selective_scan_fn


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """mamba-ssm's ``selective_scan_fn`` on the fastest exact implementation for the inputs' device (mamba-ssm's
    CUDA kernel when installed, Triton on CUDA, the chunked torch scan elsewhere); differentiable. The library's own
    models (:mod:`mamba_captum.vision`) run their scans through it.

    Shapes: u, delta (B, D, L); A (D, N); B, C (B, N, L); D (D,) or None; z (B, D, L) or None; returns y (B, D, L)
    in u's dtype.
    """
    scan = _fast_scan_for(u, _mamba_ssm_selective_scan)
    return scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)


def _on_triton(x: torch.Tensor) -> bool:
    """Triton for CUDA tensors that are not float64 (the kernels accumulate in float32)."""
    return x.device.type == "cuda" and triton_available() and x.dtype != torch.float64


def _dispatcher(path, original):
    def mamba_selective_scan(hidden_states, *args, **kwargs):
        if not _thread_depth().get(path):  # a thread outside fast_scans(): HF's own function
            return original(hidden_states, *args, **kwargs)
        return _fast_scan_for(hidden_states, lambda: original)(hidden_states, *args, **kwargs)

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


@dataclasses.dataclass(frozen=True)
class Swap:
    """``attribute`` of ``module`` (or of its class ``owner``), replaced by ``dispatcher(key, original)`` for models
    holding one of ``mixers``."""

    mixers: tuple
    module: str
    owner: Optional[str]
    attribute: str
    dispatcher: Callable


# key (also the thread-depth key) -> swap
SWAPS = {path: Swap((mixer,), path, None, "mamba_selective_scan", _dispatcher) for mixer, path in SCAN_MODULES.items()}
SWAPS.update({path: Swap((mixer,), path, None, "mamba2_chunk_scan", _ssd_dispatcher)
              for mixer, path in SSD_MODULES.items()})
SWAPS[RWKV_MODULE] = Swap(("RwkvSelfAttention",), RWKV_MODULE, None, "rwkv_linear_attention", _wkv_dispatcher)
SWAPS[f"{GRIFFIN_MODULE}.RecurrentGemmaRglru"] = Swap(("RecurrentGemmaRglru",), GRIFFIN_MODULE, "RecurrentGemmaRglru",
                                                       "_rnn_scan", _rglru_dispatcher)


def _install(key):
    swap = SWAPS[key]
    owner = importlib.import_module(swap.module)
    if swap.owner is not None:
        owner = getattr(owner, swap.owner)
    original = getattr(owner, swap.attribute)
    dispatcher = swap.dispatcher(key, original)
    setattr(owner, swap.attribute, dispatcher)
    return owner, swap.attribute, original, dispatcher


def _uninstall(token):
    owner, attribute, original, dispatcher = token
    if getattr(owner, attribute) is dispatcher:  # someone patched over it meanwhile: leave theirs in place
        setattr(owner, attribute, original)


PATCHES = {key: SharedPatch(lambda key=key: _install(key), _uninstall) for key in SWAPS}


@contextlib.contextmanager
def fast_scans(model=None):
    """Swap HF's Mamba-1, Mamba-2 (SSD), RWKV-4 and RG-LRU scans for the fast ones while the context is open, for
    the calling thread (see the module docstring).

    Args:
        model: only the scans of the mixers this model contains are swapped; None swaps all of them.

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
            stack.enter_context(PATCHES[key])
            depth[key] = depth.get(key, 0) + 1
            stack.callback(_leave, depth, key)
        yield


def _leave(depth: dict, key: str):
    depth[key] -= 1
    if not depth[key]:
        del depth[key]
