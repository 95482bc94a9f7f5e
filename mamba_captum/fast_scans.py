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
- flash-linear-attention's models: every Triton function of fla on CPU tensors, through
  :func:`mamba_captum.fla_on_cpu` (its own docstring; fla's kernels stay on CUDA tensors).
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

The swap check: a new transformers release may change what one of these functions computes, so the first
``fast_scans()`` of the process that needs a swap checks it against HF's own function (signature and a probe);
one that fails stays unswapped with a :class:`ScanMismatchWarning` (:mod:`mamba_captum.scan_checks` says what is
compared and to what tolerance).

The dispatchers, their probes and the registry of swaps are in :mod:`mamba_captum.scan_swaps`, the swap check in
:mod:`mamba_captum.scan_checks`; their public names are importable from here.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Optional  # noqa: F401  (the annotations of Swap, importable from here as before)

# the fast scans the dispatchers call, and selective_scan (the library's own models' scan), importable from here
from .kernels.rglru_scan import rglru_scan_chunked, rglru_scan_triton  # noqa: F401
from .kernels.scans import ssd_scan_reference  # noqa: F401
from .kernels.selective_scan import selective_scan, selective_scan_chunked, selective_scan_triton  # noqa: F401
from .kernels.triton_maps import triton_available  # noqa: F401
from .kernels.wkv_scan import wkv_scan_chunked, wkv_scan_triton  # noqa: F401
from .fla_cpu import fla_on_cpu as _fla_on_cpu, has_fla_modules as _has_fla_modules
from .scan_checks import (ABSENT, ScanMismatchWarning, SwapCheck, check_swap, reset_swap_checks,  # noqa: F401
                          swap_checks)
from .scan_checks import swap_passes as _swap_passes
from .scan_swaps import (FLOAT32, FLOAT32_CAST_GRADIENTS, FLOAT64, GRIFFIN_MODULE, PATCHES, RWKV_MODULE,  # noqa: F401
                         SCAN_MODULES, SSD_MODULES, SWAPS, Swap)
from .scan_swaps import leave as _leave, thread_depth as _thread_depth
from .session import SharedPatch, thread_state  # noqa: F401
from .session import kernel_fallback_quiet as _kernel_fallback_quiet


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
        # HF's "falling back to its reference PyTorch implementation" would be wrong here: the fast scans run
        stack.enter_context(_kernel_fallback_quiet())
        if (model is None and "fla.layers" in sys.modules) or (model is not None and _has_fla_modules(model)):
            stack.enter_context(_fla_on_cpu())  # flash-linear-attention's Triton functions, torch on CPU tensors
        for key in keys:
            if not _swap_passes(key):  # absent, or it failed its check (warned once): HF's own function runs
                continue
            stack.enter_context(PATCHES[key])
            depth[key] = depth.get(key, 0) + 1
            stack.callback(_leave, depth, key)
        yield
