"""The capture of softmax attention at HF's attention interface, and the stack of open captures it records into.

Every attention module of transformers 5 looks its implementation up through ``ALL_ATTENTION_FUNCTIONS`` at call
time: while any capture is open that lookup is wrapped process-wide (:data:`ATTENTION_PATCH`, a
:class:`mamba_captum.session.SharedPatch`), so that the query, key, value, mask and scaling handed to the interface,
and the interface's output, are seen whatever ``attn_implementation`` the model was loaded with. The wrapper records
for the calling thread's innermost open capture (:func:`open_captures`: a :class:`mamba_captum.capture.LayerCapture`
records an :class:`AttentionCall`, :class:`mamba_captum.lrp_forward.LRPForward` runs the call itself) and is
transparent for every other thread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .families import DEPTH_ATTENTION
from .session import SharedPatch, thread_state


def open_captures() -> list:
    """This thread's open captures, innermost last."""
    return thread_state("captures", list)


def _recording_interface(interface):
    """``interface`` plus recording into the calling thread's innermost open capture (if any). A capture with an
    ``_attention_call(interface, module, query, key, value, attention_mask, args, kwargs)`` method runs the call
    itself and returns what the layer gets (:class:`mamba_captum.lrp_forward.LRPForward`)."""

    def recording_interface(module, query, key, value, attention_mask, *args, **kwargs):
        if type(module).__name__ in DEPTH_ATTENTION:  # a softmax over earlier layers at each token: no token mixer
            return interface(module, query, key, value, attention_mask, *args, **kwargs)
        captures = open_captures()
        if captures and hasattr(captures[-1], "_attention_call"):  # the capture runs the call itself (MambaLRP)
            return captures[-1]._attention_call(interface, module, query, key, value, attention_mask, args, kwargs)
        output = interface(module, query, key, value, attention_mask, *args, **kwargs)
        if captures:
            captures[-1]._record_attention(module, query, key, value, attention_mask, args, kwargs, output)
        return output

    return recording_interface


def _install_attention_recording():
    # An instance attribute shadows AttentionInterface.get_interface; every attention module of transformers 5
    # looks its implementation up through it at call time.
    had_own = "get_interface" in vars(ALL_ATTENTION_FUNCTIONS)
    previous = ALL_ATTENTION_FUNCTIONS.get_interface

    def get_interface(attn_implementation, default):
        return _recording_interface(previous(attn_implementation, default))

    ALL_ATTENTION_FUNCTIONS.get_interface = get_interface
    return had_own, previous, get_interface


def _uninstall_attention_recording(token):
    had_own, previous, ours = token
    if vars(ALL_ATTENTION_FUNCTIONS).get("get_interface") is not ours:
        return  # someone replaced it after us: leave theirs
    if had_own:
        ALL_ATTENTION_FUNCTIONS.get_interface = previous
    else:
        del ALL_ATTENTION_FUNCTIONS.get_interface


ATTENTION_PATCH = SharedPatch(_install_attention_recording, _uninstall_attention_recording)


@dataclass
class AttentionCall:
    """One call of HF's attention interface during the captured forward pass."""

    layer: int
    module: nn.Module
    query: torch.Tensor  # (B, Hq, L, d)
    key: torch.Tensor  # (B, Hkv, L, d)
    value: torch.Tensor  # (B, Hkv, L, d)
    attention_mask: torch.Tensor | None
    scaling: float | None
    options: dict[str, Any]  # sliding_window, softcap, is_causal, position_bias, sinks, cu_seq_lens_q / _k (varlen)
    output: torch.Tensor | None = None  # (B, L, Hq, d) the interface's real output
    output_grads: list | None = None  # gradients of targets with respect to ``output``, set by gradient methods
    input_effects: list | None = None  # per target, (B, L) gradient × input at query and key (selection-aware)
    row_effects: list | None = None  # per target, (B, L, L) the same per output row (selection share placed exactly)


ATTENTION_OPTIONS = ("sliding_window", "softcap", "is_causal", "position_bias", "sinks", "cu_seq_lens_q",
                     "cu_seq_lens_k")


def attention_call(layer, module, query, key, value, attention_mask, args, kwargs, output) -> AttentionCall:
    """The :class:`AttentionCall` of one call of HF's attention interface (tensors as given, not detached)."""
    scaling = kwargs.get("scaling", args[0] if args else None)
    options = {k: kwargs[k] for k in ATTENTION_OPTIONS if k in kwargs}
    attn_out = output[0] if isinstance(output, tuple) else output
    return AttentionCall(layer, module, query, key, value, attention_mask, scaling, options, attn_out)
