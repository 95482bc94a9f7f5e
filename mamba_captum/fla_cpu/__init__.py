"""``fla_on_cpu()``: run flash-linear-attention's models on a CPU, exactly, through plain-torch versions of its
Triton functions.

Most of fla's layers call Triton kernels, and so do its fused modules (token shift, L2 norm, norms and gated norms,
the short convolution, rotary embeddings, activations, the fused cross-entropy): on a CPU an fla model does not even
run its forward. Inside ``fla_on_cpu()`` each of those functions is swapped, for the calling thread and for CPU
tensors, for a torch version with the same signature (:mod:`.modules`, :mod:`.ops`): chunked and differentiable,
over the library's kernels (:mod:`mamba_captum.kernels.gated_linear`, :mod:`~mamba_captum.kernels.delta_rule`,
:mod:`~mamba_captum.kernels.dplr`), so that a model can be run, trained and explained on a laptop. CUDA tensors keep
fla's own kernels unless ``devices="all"``.

The library enters it around its own forward passes of an fla model (through :func:`mamba_captum.fast_scans`), so
``implicit_attention``, the Captum classes, the CLI and the callback need nothing more; a user enters it to run or
train the model themself::

    with mc.fla_on_cpu():
        loss = model(ids, labels=ids).loss
        loss.backward()

What is swapped, and how each swap is checked against fla's torch references, is :data:`SWAPS` and docs/families/fla.md.
A call that still reaches a Triton kernel on a CPU (an op without a torch version) fails with fla's own error; an
argument a torch version cannot honour is refused by name (``NotImplementedError``), and a swap whose fla function
gained a parameter is not installed (:func:`refused_swaps` says which, and why).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import warnings

from . import (modules, ops, ops_abc, ops_cyfa, ops_delta_family, ops_gla_family, ops_gsa, ops_log_linear,
               ops_mesa_net, ops_mom, ops_precond, ops_rwkv)
from .swaps import (FlaSwap, FlaSwapError, FunctionSwap, SwapSet, install_function_swap, signature_gap, usable,
                    wants_torch)

__all__ = ["FUNCTION_SWAPS", "SWAPS", "FlaSwap", "FunctionSwap", "FlaSwapError", "fla_available", "fla_on_cpu", "has_fla_modules", "import_fla_models",
           "refused_swaps", "signature_gap", "usable", "wants_torch"]


def fused_cross_entropy_forward(self, input, target):
    """``fla.modules.FusedCrossEntropyLoss.forward`` on any device (fla's asserts CUDA): :func:`.modules.
    cross_entropy_loss` reduced as fla reduces it (mean over the targets that are not ``ignore_index``)."""
    loss, z_loss = modules.cross_entropy_loss(input, target, self.label_smoothing, self.logit_scale,
                                              self.lse_square_scale, self.logit_softcapping, self.ignore_index,
                                              self.inplace_backward, self.process_group)
    if self.reduction != "none":
        loss = loss.sum()
        z_loss = z_loss.sum()
        if self.reduction == "mean":
            total = (target != self.ignore_index).sum()
            loss, z_loss = loss / total, z_loss / total
    return (loss, z_loss) if self.return_z_loss else loss


_MODULE_SWAPS = {
    "fla.modules.norm.layernorm": ("layer_norm", "rms_norm", "group_norm", "layer_norm_linear", "rms_norm_linear",
                                   "group_norm_linear"),
    "fla.modules.norm.fused_norm_gate": ("layer_norm_gated", "rms_norm_gated", "layer_norm_swish_gate_linear",
                                         "rms_norm_swish_gate_linear"),
    "fla.modules.norm.layernorm_gated": ("layernorm_fn", "rmsnorm_fn"),
    "fla.modules.norm.l2norm": ("l2norm",),
    "fla.modules.token_shift": ("token_shift",),
    "fla.modules.causal_conv1d.ops": ("causal_conv1d", "causal_conv1d_update"),
    "fla.modules.rotary.ops": ("rotary_embedding",),
    "fla.modules.activations.ops": ("sigmoid", "logsigmoid", "swish", "elu_p1", "swiglu", "swiglu_linear",
                                    "sigmoidglu"),
    "fla.modules.fused_cross_entropy.ops": ("cross_entropy_loss",),
}
_OP_SWAPS = {
    "fla.ops.cyfa.chunk": ("chunk_cyfa",),
    "fla.ops.cyfa.fused_recurrent": ("fused_recurrent_cyfa",),
    "fla.ops.gla.chunk": ("chunk_gla",),
    "fla.ops.gla.fused_chunk": ("fused_chunk_gla",),
    "fla.ops.gla.fused_recurrent": ("fused_recurrent_gla",),
    "fla.ops.simple_gla.chunk": ("chunk_simple_gla",),
    "fla.ops.simple_gla.fused_chunk": ("fused_chunk_simple_gla",),
    "fla.ops.simple_gla.fused_recurrent": ("fused_recurrent_simple_gla",),
    "fla.ops.retention.chunk": ("chunk_retention",),
    "fla.ops.retention.fused_chunk": ("fused_chunk_retention",),
    "fla.ops.retention.fused_recurrent": ("fused_recurrent_retention",),
    "fla.ops.retention.parallel": ("parallel_retention",),
    "fla.ops.rwkv6.chunk": ("chunk_rwkv6",),
    "fla.ops.rwkv6.fused_recurrent": ("fused_recurrent_rwkv6",),
    "fla.ops.hgrn.chunk": ("chunk_hgrn",),
    "fla.ops.hgrn.fused_recurrent": ("fused_recurrent_hgrn",),
    "fla.ops.delta_rule.chunk": ("chunk_delta_rule",),
    "fla.ops.delta_rule.fused_recurrent": ("fused_recurrent_delta_rule",),
    "fla.ops.gated_delta_rule.chunk": ("chunk_gated_delta_rule",),
    "fla.ops.gated_delta_rule.fused_recurrent": ("fused_recurrent_gated_delta_rule",),
    "fla.ops.kda.chunk": ("chunk_kda",),
    "fla.ops.kda.fused_recurrent": ("fused_recurrent_kda",),
    "fla.ops.comba.chunk": ("chunk_comba",),
    "fla.ops.comba.fused_recurrent": ("fused_recurrent_comba",),
    "fla.ops.gated_delta_product.chunk": ("chunk_gated_delta_product",),
    "fla.ops.generalized_delta_rule.dplr.chunk": ("chunk_dplr_delta_rule",),
    "fla.ops.generalized_delta_rule.dplr.fused_recurrent": ("fused_recurrent_dplr_delta_rule",),
    "fla.ops.rwkv7.chunk": ("chunk_rwkv7",),
    "fla.ops.rwkv7.fused_recurrent": ("fused_recurrent_rwkv7", "fused_mul_recurrent_rwkv7"),
    "fla.ops.rwkv7.fused_addcmul": ("fused_addcmul_rwkv7",),
    "fla.ops.rwkv7.fused_k_update": ("fused_k_rwkv7",),
    "fla.ops.rwkv7.gate_output_correction": ("gate_output_correction",),
    # linear attention's normaliser and LightNet's (and GSA's) additive gate (ops_gla_family)
    "fla.ops.linear_attn.utils": ("normalize_with_z_state",),
    "fla.ops.gsa.gate": ("fused_additive_gate",),
    # gated slot attention (GSA, Raven): two GLA passes with a softmax over the slots (ops_gsa)
    "fla.ops.gsa.chunk": ("chunk_gsa",),
    "fla.ops.gsa.fused_recurrent": ("fused_recurrent_gsa",),
    # ABC: gated slot attention with its slot gates from the normalised slot logits (ops_abc)
    "fla.ops.abc.chunk": ("chunk_abc",),
    # the preconditioned delta rules (ops_precond)
    "fla.ops.precond_gated_delta_rule.chunk": ("chunk_precond_gated_delta_rule",),
    "fla.ops.precond_gated_delta_rule.fused_recurrent": ("fused_recurrent_precond_gated_delta_rule",),
    "fla.ops.precond_kda.chunk": ("chunk_precond_kda",),
    "fla.ops.precond_kda.fused_recurrent": ("fused_recurrent_precond_kda",),
    "fla.ops.kda.gate": ("fused_kda_gate",),
    # MesaNet: two gated states read through a fixed-step conjugate-gradient solve (ops_mesa_net)
    "fla.ops.mesa_net.chunk": ("chunk_mesa_net",),
    "fla.ops.mesa_net.decoding_one_step": ("mesa_net_decoding_one_step",),
    # log-linear attention (LogLinearMamba2), Fenwick level weights over a Mamba-2 core (ops_log_linear)
    "fla.ops.log_linear_attn.chunk": ("chunk_log_linear_attn",),
    # MoM's token layout with a stable sort: fla's argsort reorders a memory's tokens on a CPU (ops_mom)
    "fla.layers.mom": ("transform",),
}


# the modules holding the torch versions of _OP_SWAPS' functions, searched in order for each name
_OP_MODULES = (ops, ops_rwkv, ops_gla_family, ops_delta_family, ops_precond, ops_gsa, ops_abc, ops_mesa_net, ops_cyfa,
               ops_log_linear, ops_mom)


def _op_version(name: str):
    for module in _OP_MODULES:
        if hasattr(module, name):
            return getattr(module, name)
    raise FlaSwapError(f"mamba_captum: no torch version of fla's {name} in {[m.__name__ for m in _OP_MODULES]}.")


# fla's methods whose own body reaches Triton or refuses a CPU: (module, "Class.method", torch version)
_METHOD_SWAPS = (
    ("fla.modules.fused_cross_entropy.ops", "FusedCrossEntropyLoss.forward", fused_cross_entropy_forward),
    # LogLinearMamba2's forward raises NotImplementedError off CUDA: its own CUDA path with a torch conv (ops_log_linear)
    ("fla.layers.log_linear_mamba2", "LogLinearMamba2.forward", ops_log_linear.log_linear_mamba2_forward),
)


def _swaps() -> list[FlaSwap]:
    found = [FlaSwap(module, name, getattr(modules, name)) for module, names in _MODULE_SWAPS.items()
             for name in names]
    found += [FlaSwap(module, name, _op_version(name)) for module, names in _OP_SWAPS.items() for name in names]
    return found + [FlaSwap(module, name, replacement) for module, name, replacement in _METHOD_SWAPS]


SWAPS = _swaps
_swap_set = SwapSet(_swaps)

# fla's autograd Functions that models keep in attributes (Mamba's act, layers' gate_fn): their classes are wrapped
FUNCTION_SWAPS = (
    FunctionSwap("fla.modules.activations.ops", "SwishFunction", modules.swish),
    FunctionSwap("fla.modules.activations.ops", "SigmoidFunction", modules.sigmoid),
    FunctionSwap("fla.modules.activations.ops", "LogSigmoidFunction", modules.logsigmoid),
    FunctionSwap("fla.modules.activations.ops", "SquaredReLUFunction", ops_rwkv.sqrelu),
)


def _import_fla(name: str):
    """Import an fla module without fla's "Triton is not supported on current platform, roll back to CPU" warning
    (emitted on import where there is no GPU: on a CPU the library runs fla's functions in torch), and without fla's
    configs left over transformers' own model types (:func:`import_fla_models`: ``import fla`` imports its models)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        warnings.filterwarnings("ignore", message="Flash Attention is not installed", category=ImportWarning)
        module = importlib.import_module(name)
    _give_back_transformers_model_types()
    return module


def _give_back_transformers_model_types() -> None:
    """Remove every registration of an fla config over one of transformers' own model types (fla 0.6 registers its
    ``mamba``, ``mamba2`` and ``bitnet`` under transformers' names)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    extra, builtin = getattr(CONFIG_MAPPING, "_extra_content", None), getattr(CONFIG_MAPPING, "_mapping", {})
    if extra is not None:
        for key in [k for k, config in extra.items()
                    if k in builtin and getattr(config, "__module__", "").startswith("fla.")]:
            del extra[key]


def fla_available() -> bool:
    """Whether flash-linear-attention can be imported here (it needs triton importable, not a GPU)."""
    try:
        _import_fla("fla.layers")
    except Exception:  # noqa: BLE001  (fla missing, or its import failing: either way no fla model can exist here)
        return False
    return True


def has_fla_modules(model) -> bool:
    """Whether ``model`` contains a module defined by flash-linear-attention."""
    return any(type(m).__module__.startswith("fla.") for m in model.modules())


def import_fla_models():
    """Import ``fla.models`` (which registers fla's model types with transformers' Auto classes) without letting it
    take over transformers' own model types: fla 0.6 registers its ``mamba``, ``mamba2`` and ``bitnet`` configs under
    transformers' names (on ``import fla`` already, which transformers' own KDA and gated-delta-rule files do when fla
    is installed), after which ``AutoConfig`` reads a transformers Mamba checkpoint as fla's. Every registration of
    an fla config over one of transformers' own model types is removed (fla's classes stay usable by name:
    ``fla.models.MambaForCausalLM``). Returns the module."""
    return _import_fla("fla.models")


def refused_swaps() -> dict[str, list[str]]:
    """fla function -> why it is not swapped in this process: the parameters of fla's function its torch version
    does not take (a moved fla release), or ``["<absent>"]``. Empty until the first ``fla_on_cpu()``."""
    return dict(_swap_set.refused)


@contextlib.contextmanager
def fla_on_cpu(model=None, *, devices: str = "cpu"):
    """Swap fla's Triton functions for their torch versions, for the calling thread, while the context is open.

    Args:
        model: unused except to return early when it contains no fla module (the library passes every model).
        devices: ``"cpu"`` (default): only calls on CPU tensors take the torch versions; ``"all"``: calls on any
            device do (a GPU without a working Triton, or a check against fla's kernels).

    transformers' own KDA and gated-delta-rule layers call fla's kernels whenever fla is installed (its hub-kernel
    fallback), a CPU's tensors included; inside ``fla_on_cpu()`` those calls go to transformers' own torch body.

    Raises:
        ImportError: flash-linear-attention is not importable (``pip install "mamba-captum[fla]"``).
    """
    if devices not in ("cpu", "all"):
        raise ValueError(f"mamba_captum: fla_on_cpu(devices={devices!r}); use 'cpu' or 'all'.")
    if model is not None and not has_fla_modules(model) and "fla" not in sys.modules:
        yield  # no fla here: nothing to swap (with fla imported, transformers' own layers may call it: see below)
        return
    if not fla_available():
        raise ImportError('mamba_captum: fla_on_cpu() needs flash-linear-attention: pip install "mamba-captum[fla]" '
                          "(flash-linear-attention and triton; no GPU needed).")
    _import_fla("fla.modules")
    for swap in FUNCTION_SWAPS:
        install_function_swap(swap)
    with _swap_set.entered(devices == "all"):
        yield
