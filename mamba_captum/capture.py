"""Hooks as a context manager: record what each token mixer saw, and always remove the hooks.

What is recorded does not depend on the kernel path. For an SSM mixer: its input and 2-D mask (forward pre-hook
on the mixer, which every path calls as a module), its output (forward hook), and whether its ``out_proj`` ran as a
module (it does not in the fused training kernels, which compute conv, scan, norm and projection in one call;
the adapters then rebuild the fused semantics). For a softmax attention layer: the query, key, value, mask and
scaling handed to HF's attention interface, and the interface's output, whatever ``attn_implementation`` the model
was loaded with. Everything else is recomputed from weights by the family adapters.

Hooks record only the forward pass of the thread that opened the capture, and only while that capture is the
innermost one open in the thread (a forward of the same model run by another thread, or the library called again
from inside a user's hook, is not mixed into the trace). The attention-interface lookup is wrapped process-wide
while any capture is open (:mod:`mamba_captum.attention_capture`); the wrapper records for the calling thread's
innermost capture and is transparent for every other thread.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .attention_capture import ATTENTION_PATCH, AttentionCall, attention_call, open_captures
from .families import LocatedMixer
from .shared_state import forget_hook, library_hook


@dataclass
class MixerCall:
    """One call of an SSM mixer during the captured forward pass."""

    located: LocatedMixer
    hidden_states: torch.Tensor  # (B, L, D_model) mixer input, before the mixer's own pad masking
    attention_mask: torch.Tensor | None  # (B, L) 2-D mask the mixer received (None: no padding)
    output: torch.Tensor | None = None  # (B, L, D_model) the mixer's real output
    unfused: bool = False  # True when out_proj ran as a module (the hookable, unfused path)
    output_grads: list | None = None  # gradients of targets with respect to ``output``, set by gradient methods
    input_effects: list | None = None  # per target, (B, L) gradient × input at hidden_states (selection-aware)
    row_effects: list | None = None  # per target, (B, L, L) the same per output row (selection share placed exactly)
    options: dict = field(default_factory=dict)  # the mixer's other keyword arguments (e.g. position_ids)
    # submodules that carry the user's hooks: (path, module, input before any pre-hook, output after every hook)
    hooked: list = field(default_factory=list)


@dataclass
class Trace:
    """Everything recorded in one forward pass, by decoder-layer call (its position in ``schedule``: the decoder-layer
    index, for every model that runs each layer once)."""

    mixer_calls: list[MixerCall] = field(default_factory=list)
    attention_calls: list[AttentionCall] = field(default_factory=list)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # call -> (B, L, D_model) stream entering it
    embedding_inputs: list = field(default_factory=list)  # what the input embeddings were called with (token ids)
    # the decoder-layer index of each decoder-layer call of the forward (families.layer_schedule); empty: 0 .. N-1
    schedule: list[int] = field(default_factory=list)

    def decoder_layer(self, call: int) -> int:
        """The index in the decoder-layer list of the layer that ran as decoder-layer call ``call``."""
        return self.schedule[call] if 0 <= call < len(self.schedule) else call

    def detach(self):
        """Drop the autograd graph from everything recorded (after the gradients have been taken)."""
        for call in self.mixer_calls:
            call.hidden_states, call.output = call.hidden_states.detach(), call.output.detach()
        for call in self.attention_calls:
            call.query, call.key, call.value = call.query.detach(), call.key.detach(), call.value.detach()
            call.output = call.output.detach()
            call.options = {k: v.detach() if torch.is_tensor(v) else v for k, v in call.options.items()}
        self.residuals = {k: v.detach() for k, v in self.residuals.items()}


def mixer_arguments(args, kwargs) -> tuple:
    """(hidden_states, 2-D padding mask or None, the other keyword arguments) of a token mixer's call."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    mask = kwargs.get("attention_mask")
    if mask is None and len(args) > 2:
        mask = args[2]
    if isinstance(mask, dict):  # ZAYA's attention: {"causal": 4-D mask, "conv": 2-D padding mask}
        mask = mask.get("conv")
    if mask is not None and (not torch.is_tensor(mask) or mask.dim() != 2):
        mask = None  # the mixers only ever use a 2-D padding mask
    options = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "attention_mask")}
    return hidden, mask, options


def _trampoline(capture, method: str, *bound):
    """A hook that calls ``capture.<method>(*bound, module, *args)`` through a weak reference.

    A copy of a hooked module made while the capture is open (``copy.deepcopy`` of the model inside a
    ``forward_func``) carries the hook: it keeps no trace alive there, does nothing, and removes itself from the
    copy the first time the copy runs."""
    ref = weakref.ref(capture)

    def hook(module, *args):
        owner = ref()
        if owner is None or owner._closed:
            forget_hook(module, hook)
            return None
        return getattr(owner, method)(*bound, module, *args)

    return library_hook(hook)


class LayerCapture(contextlib.AbstractContextManager):
    """Register the recording hooks on entry; remove every one of them on exit, whatever happened.

    Args:
        decoder_layers: the model's decoder-layer ``ModuleList`` (index = decoder-layer index).
        mixers: the SSM mixers to record (from :func:`mamba_captum.families.locate`).
        layers: decoder-layer calls to record (positions in ``schedule``: the decoder-layer indices, for a model that
            runs each layer once), or None for all.
        record_attention: whether to record softmax attention calls.
        detach: store detached tensors (maps need no graph); False keeps the graph for gradient methods, and then
            (with grad enabled) a decoder layer's input that carries no graph (a frozen model, frozen embeddings,
            inputs without grad) is swapped for a leaf that requires grad, same values, so that gradients with
            respect to every recorded tensor exist; the weights are not touched.
        record_residual: also record the residual stream entering each recorded decoder layer.
        embeddings: the model's input-embedding module, or None. Its inputs are recorded (the token ids the model
            really saw); with ``detach=False`` and grad enabled, an output that carries no graph (frozen embeddings)
            is swapped for a leaf that requires grad there, before anything the model derives from it (Zamba2
            feeds a copy of the embeddings to every shared attention block), not only at the first layer.
        on_layer_done: called with the trace and a decoder-layer index as soon as that layer's forward returned
            (its calls are then complete in the trace): a caller that needs no gradients can consume and drop them there, so that
            one layer's recorded tensors are alive at a time (:func:`mamba_captum.implicit_attention`).
        schedule: the decoder-layer index of each decoder-layer call of the forward
            (:func:`mamba_captum.families.layer_schedule`), None for ``0 .. N-1``. A looped model's layer runs at
            several positions: each of its calls is recorded as a mixer of its own (a copy of its
            :class:`LocatedMixer` whose ``layer`` is the call's position), and a forward that departs from a loop's
            schedule is refused.
    """

    def __init__(self, decoder_layers: nn.ModuleList, mixers: list[LocatedMixer], layers=None,
                 record_attention: bool = True, detach: bool = True, record_residual: bool = False,
                 embeddings: nn.Module | None = None, on_layer_done=None, schedule=None):
        self.embeddings = embeddings
        self.on_layer_done = on_layer_done
        self.decoder_layers = decoder_layers
        schedule = list(range(len(decoder_layers))) if schedule is None else list(schedule)
        self._looped = schedule != list(range(len(decoder_layers)))
        wanted = None if layers is None else {schedule[i] if 0 <= i < len(schedule) else i for i in layers}
        self.mixers = [m for m in mixers if wanted is None or m.layer in wanted]
        self.layers = None if layers is None else set(layers)
        self.record_attention = record_attention
        self.detach = detach
        self.record_residual = record_residual
        self.trace = Trace(schedule=schedule)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._layer_stack: list[int] = []  # the decoder-layer calls now running (positions in the schedule)
        self._next_call = 0  # the position in the schedule of the next decoder-layer call
        self._call_mixers: dict = {}  # (call, id(located)) -> the located mixer of a looped layer's later call
        self._thread = None
        self._captures: list = []
        self._attention_patched = False
        self._closed = True  # hooks do nothing (and drop themselves) unless the capture is open

    # -- helpers --------------------------------------------------------------------------------------------
    def _keep(self, tensor):
        if tensor is None or not torch.is_tensor(tensor):
            return tensor
        return tensor.detach() if self.detach else tensor

    def _current_layer(self) -> int | None:
        return self._layer_stack[-1] if self._layer_stack else None

    def _layer_call(self, index: int) -> int:
        """The position in the schedule of the call of decoder layer ``index`` that starts now (``index`` itself for
        a model that runs each layer once).

        Raises:
            RuntimeError: a looped model's layer runs where its schedule has another one.
        """
        schedule, position = self.trace.schedule, self._next_call
        if position < len(schedule) and schedule[position] == index:
            self._next_call += 1
            return position
        if self._looped:
            expected = f"layer {schedule[position]}" if position < len(schedule) else "no further layer"
            raise RuntimeError(
                f"mamba_captum: decoder layer {index} ran as call {position} of the forward pass, where the model's "
                f"loop schedule has {expected}; the calls of its looped layers cannot be told apart. Explain one "
                "forward pass of the model as transformers runs it.")
        return index  # a layer that runs twice is refused where its calls are rebuilt

    def _at_call(self, located: LocatedMixer) -> LocatedMixer | None:
        """``located`` as recorded in the decoder-layer call now running: itself in its layer's own position (and in
        every model without a loop), a copy keyed by the call's position in a looped layer's later calls; None in a
        looped model's call that is not recorded (``layers=``)."""
        call = self._current_layer()
        if not self._looped or call is None or self.trace.decoder_layer(call) != located.layer:
            return located
        if self.layers is not None and call not in self.layers:
            return None
        if call == located.layer:
            return located
        copy = self._call_mixers.get((call, id(located)))
        if copy is None:
            def renamed(name):  # "{layer}.{path}" -> "{call}.{path}"
                return f"{call}.{name.split('.', 1)[1]}" if "." in name else str(call)

            copy = dataclasses.replace(located, layer=call, name=renamed(located.name),
                                       follows=None if located.follows is None else renamed(located.follows))
            self._call_mixers[(call, id(located))] = copy
        return copy

    def _mine(self) -> bool:
        """Whether the call now running belongs to this capture: its thread, and no capture opened inside it."""
        if threading.get_ident() != self._thread:
            return False
        captures = open_captures()
        return bool(captures) and captures[-1] is self

    # -- hooks (each registered through _trampoline: see there) ---------------------------------------------
    def _on_layer_pre(self, index, module, args, kwargs):
        if not self._mine():
            return None
        index = self._layer_call(index)  # from here on: the call's position in the schedule
        self._layer_stack.append(index)
        recorded = self.record_residual and (self.layers is None or index in self.layers)
        positional = bool(args)
        hidden = args[0] if positional else kwargs.get("hidden_states")
        if not torch.is_tensor(hidden):
            if recorded:
                raise RuntimeError(f"mamba_captum: decoder layer {index} received no hidden_states tensor.")
            return None
        if not self.detach and torch.is_grad_enabled() and not hidden.requires_grad:
            hidden = hidden.detach().requires_grad_(True)
            if positional:
                args = (hidden, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": hidden}
        if recorded:
            self.trace.residuals[index] = self._keep(hidden)
        return args, kwargs

    def _on_embedding(self, module, args, output):
        if not self._mine():
            return None
        if args and torch.is_tensor(args[0]):
            self.trace.embedding_inputs.append(args[0].detach())
        if not self.detach and torch.is_grad_enabled() and torch.is_tensor(output) and output.is_floating_point() \
                and not output.requires_grad:
            return output.detach().requires_grad_(True)
        return None

    def _on_layer_post(self, index, module, args, output):
        if self._mine() and self._layer_stack:
            call = self._layer_stack.pop()
            if self.on_layer_done is not None:
                self.on_layer_done(self.trace, call)

    def _on_mixer_pre(self, located, module, args, kwargs):
        if not self._mine():
            return
        located = self._at_call(located)
        if located is None:  # a decoder-layer call that is not recorded (layers=)
            return
        hidden, mask, options = mixer_arguments(args, kwargs)
        options = {k: self._keep(v) for k, v in options.items()}
        self.trace.mixer_calls.append(MixerCall(located, self._keep(hidden), self._keep(mask), options=options))

    def _on_mixer_post(self, located, module, args, kwargs, output):
        if self._mine() and (call := self._last_call(located)) is not None:
            call.output = self._keep(output[0] if isinstance(output, tuple) else output)

    def _on_hooked_input(self, located, name, module, args, kwargs):
        if self._mine() and (call := self._last_call(located)) is not None:
            call.hooked.append([name, module, (self._keep_all(args), self._keep_all(kwargs)),
                                None])  # the output is filled in by the post-hook

    def _on_hooked_output(self, located, name, module, args, output):
        if self._mine() and (call := self._last_call(located)) is not None:
            for entry in reversed(call.hooked):
                if entry[0] == name and entry[3] is None:
                    entry[3] = output.detach() if torch.is_tensor(output) else output
                    break

    @staticmethod
    def _keep_all(values):
        """Detached copies of the references (only the check reads them; no graph is kept for it)."""
        keep = lambda v: v.detach() if torch.is_tensor(v) else v  # noqa: E731
        if isinstance(values, dict):
            return {k: keep(v) for k, v in values.items()}
        return tuple(keep(v) for v in values)

    def _on_out_proj(self, located, module, args, output):
        if self._mine() and (call := self._last_call(located)) is not None:
            call.unfused = True

    def _last_call(self, located) -> MixerCall | None:
        """The call of ``located`` now running (None in a decoder-layer call that is not recorded)."""
        located = self._at_call(located)
        if located is None:
            return None
        for call in reversed(self.trace.mixer_calls):
            if call.located is located:
                return call
        raise RuntimeError(f"mamba_captum: no recorded call for {located.name}")  # hooks fire in order

    def _record_attention(self, module, query, key, value, attention_mask, args, kwargs, output):
        """Called by the attention-interface wrapper for calls of this thread (see :mod:`mamba_captum.attention_capture`)."""
        layer = self._current_layer()
        if not self.record_attention or layer is None or (self.layers is not None and layer not in self.layers):
            return
        call = attention_call(layer, module, query, key, value, attention_mask, args, kwargs, output)
        call.query, call.key, call.value = self._keep(query), self._keep(key), self._keep(value)
        call.attention_mask, call.output = self._keep(attention_mask), self._keep(call.output)
        call.options = {k: self._keep(v) for k, v in call.options.items()}
        self.trace.attention_calls.append(call)

    # -- context manager ------------------------------------------------------------------------------------
    def _hook(self, module: nn.Module, pre: bool, method: str, *bound, **options):
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        self._handles.append(register(_trampoline(self, method, *bound), **options))

    def __enter__(self):
        self._thread = threading.get_ident()
        self._closed = False
        self._next_call = 0
        self._captures = open_captures()  # the list of the opening thread, whichever thread removes the hooks
        self._captures.append(self)
        try:
            if self.embeddings is not None:
                self._hook(self.embeddings, False, "_on_embedding")
            for index, layer in enumerate(self.decoder_layers):
                self._hook(layer, True, "_on_layer_pre", index, with_kwargs=True)
                self._hook(layer, False, "_on_layer_post", index)
            for located in self.mixers:
                module = located.module
                # The rebuild runs submodules without hooks: where the user's hooks sit, record what the submodule
                # received before them and gave after them, so that a hook that changes outputs is detected.
                for name, sub in module.named_modules():
                    if sub is not module and (sub._forward_hooks or sub._forward_pre_hooks):
                        self._hook(sub, True, "_on_hooked_input", located, name, prepend=True, with_kwargs=True)
                        self._hook(sub, False, "_on_hooked_output", located, name)
                self._hook(module, True, "_on_mixer_pre", located, with_kwargs=True)
                # prepend: the mixer's own output, before any hook of the user's changes it (the operator describes
                # the mixer; a hook's change acts downstream, where the gradients see it)
                self._hook(module, False, "_on_mixer_post", located, with_kwargs=True, prepend=True)
                out_proj = getattr(module, "out_proj", None)
                if isinstance(out_proj, nn.Module):
                    self._hook(out_proj, False, "_on_out_proj", located)
            if self.record_attention:
                ATTENTION_PATCH.__enter__()
                self._attention_patched = True
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self):
        """Remove every hook this capture registered (and the attention patch it holds); what ``__exit__`` does,
        for an owner that must close a capture left open."""
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._layer_stack.clear()
        if self in self._captures:
            self._captures.remove(self)
        if self._attention_patched:
            self._attention_patched = False
            ATTENTION_PATCH.__exit__(None, None, None)

    def __exit__(self, *exc):
        self.remove()
        return False
