"""``fast_scans``: run HF's Mamba-1 selective scan on a fast, exact, differentiable implementation.

HF's torch path (``mamba_selective_scan`` in ``modeling_mamba``, ``modeling_falcon_mamba``, ``modeling_jamba``,
``modeling_zamba``) is a per-token loop under autograd whose backward grows faster than L; gradient methods (ours,
and Captum's own baselines) spend nearly all their time there. Inside ``fast_scans()`` these module-level functions
— which the mixers look up at call time — are replaced by a dispatcher: CUDA tensors go to the function that was
there when mamba-ssm is installed (its fused CUDA kernel), else float32 CUDA tensors to the Triton scan
(:func:`mamba_captum.kernels.selective_scan.selective_scan_triton`), everything else to
:func:`mamba_captum.kernels.selective_scan.selective_scan_chunked` (explicit forward and backward, linear in L,
equal to HF's path to float rounding; plain torch). The library enters it around its own forward passes.

The swap is per thread: the dispatcher is installed in the module while any thread is inside ``fast_scans()``
(a :class:`mamba_captum.session.SharedPatch`, restored when the last thread leaves, in any interleaving), and it
sends a call to the fast scan only when the calling thread itself is inside ``fast_scans()``; other threads get
HF's own function.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util

import torch

from .kernels.selective_scan import selective_scan_chunked, selective_scan_triton
from .kernels.triton_maps import triton_available
from .session import SharedPatch, thread_state

SCAN_MODULES = {
    "MambaMixer": "transformers.models.mamba.modeling_mamba",
    "FalconMambaMixer": "transformers.models.falcon_mamba.modeling_falcon_mamba",
    "JambaMambaMixer": "transformers.models.jamba.modeling_jamba",
    "ZambaMambaMixer": "transformers.models.zamba.modeling_zamba",  # one call per head
}


def _has_mamba_ssm() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None


def _thread_depth() -> dict:
    """module path -> how many ``fast_scans()`` contexts of this thread have it swapped."""
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


def _dispatcher(path, original):
    def mamba_selective_scan(hidden_states, *args, **kwargs):
        if not _thread_depth().get(path):  # a thread outside fast_scans(): HF's own function
            return original(hidden_states, *args, **kwargs)
        return _fast_scan_for(hidden_states, lambda: original)(hidden_states, *args, **kwargs)

    mamba_selective_scan.original = original
    return mamba_selective_scan


def _install(path):
    module = importlib.import_module(path)
    original = module.mamba_selective_scan
    dispatcher = _dispatcher(path, original)
    module.mamba_selective_scan = dispatcher
    return module, original, dispatcher


def _uninstall(token):
    module, original, dispatcher = token
    if module.mamba_selective_scan is dispatcher:  # someone patched over it meanwhile: leave theirs in place
        module.mamba_selective_scan = original


PATCHES = {path: SharedPatch(functools.partial(_install, path), _uninstall) for path in SCAN_MODULES.values()}


@contextlib.contextmanager
def fast_scans(model=None):
    """Swap HF's Mamba-1 selective scans for the fast ones while the context is open, for the calling thread (see
    the module docstring).

    Args:
        model: only the scan modules of the mixers this model contains are swapped; None swaps all of them.

    Example::

        with mc.fast_scans(model):
            LayerIntegratedGradients(forward, model.backbone.embeddings).attribute(ids, target=t, n_steps=50)
    """
    if model is None:
        paths = list(SCAN_MODULES.values())
    else:
        present = {type(m).__name__ for m in model.modules()}
        paths = [path for mixer, path in SCAN_MODULES.items() if mixer in present]
    depth = _thread_depth()
    with contextlib.ExitStack() as stack:
        for path in paths:
            stack.enter_context(PATCHES[path])
            depth[path] = depth.get(path, 0) + 1
            stack.callback(_leave, depth, path)
        yield


def _leave(depth: dict, path: str):
    depth[path] -= 1
    if not depth[path]:
        del depth[path]
