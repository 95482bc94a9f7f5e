"""The engine's rebuild loop: one forward pass under the capture hooks (:func:`captured_forward`), then each
recorded layer's operator rebuilt from its captured calls and checked against the layer's real output
(:func:`rebuilt_operators`), all at once or layer by layer as the forward goes (:class:`MapStream`)."""
from __future__ import annotations

import torch

from . import families
from .capture import Trace
from .checks import check_finite, model_dtype
from .families import softmax
from .fast_scans import fast_scans
from .keys import LayerPartKey, SharedAttentionKey
from .offload import loaded_weights
from .operators import ComposedOperator, SumOperator, operator_output_grad
from .verification import ReconstructionError, check_maps, check_reconstruction

FORMULATIONS = ("unified", "hidden")


def kept_components(formulation: str, components) -> frozenset:
    """The parts of the operator to keep (:func:`mamba_captum.families.parse_components`) for ``formulation``.

    Raises:
        ValueError: an unknown formulation (before any forward pass).
    """
    if formulation not in FORMULATIONS:
        raise ValueError(f"mamba_captum: formulation={formulation!r}; choose 'unified' or 'hidden'.")
    return families.parse_components(components, formulation)


def check_recorded(trace, mixers, layers):
    """Every SSM mixer in the requested layers must have been recorded: a mixer that ran where the hooks cannot see
    it (another thread, e.g. ``nn.DataParallel``'s replicas) would otherwise be silently missing from the result.

    Raises:
        RuntimeError: naming the layers whose mixer was not seen.
    """
    seen = {call.located.layer for call in trace.mixer_calls}
    mixer_layers = {m.layer for m in mixers}
    # every decoder-layer call of a layer with mixers (a looped model's layer runs at several positions)
    calls = enumerate(trace.schedule) if trace.schedule else ((index, index) for index in mixer_layers)
    missing = sorted({call for call, index in calls
                      if index in mixer_layers and (layers is None or call in layers) and call not in seen})
    if missing:
        raise RuntimeError(
            f"mamba_captum: the token mixers of decoder layers {missing} did not run in the forward pass as seen "
            "from this thread. Explain the HF model itself (not a wrapper that runs it in other threads, such as "
            "nn.DataParallel: pass model.module), with the whole sequence in one forward call.")


def captured_forward(model, capture, mixers, layers, attention_mask, forward_kwargs, forward):
    """Run ``forward()``, the model's forward call, once with ``capture``'s hooks (a :class:`LayerCapture` over
    ``mixers`` and ``layers``) and the fast scans on: what the operators cannot describe is refused first
    (:func:`mamba_captum.families.check_forward` on ``attention_mask`` and ``forward_kwargs``), every requested
    mixer's call is checked recorded after (:func:`check_recorded`).

    Returns:
        (trace, output): the recorded calls and what ``forward()`` returned.
    """
    families.check_forward(mixers, attention_mask, forward_kwargs)
    with fast_scans(model), capture:
        output = forward()
    check_recorded(capture.trace, mixers, layers)
    return capture.trace, output


def _operator_grads(operator, call):
    """Per target, the gradient with respect to the operator's output (None when the call carries no gradients)."""
    if call.output_grads is None:
        return None
    return [operator_output_grad(operator, grad) for grad in call.output_grads]


def rebuilt_operators(model, trace, decoder_layers, formulation, kept, attention_mask):
    """Rebuild and check the recorded layers one by one, in execution order: yields (key, operator, error, grads).

    ``grads`` is None unless a gradient method stored ``output_grads`` on the recorded calls; then it lists, per
    target, the gradient with respect to the operator's output (for a :class:`SumOperator`, one per part).

    Rebuilding runs in float64 (the rebuilt pieces feed exponentials and norms, where float32 rounding of the
    recomputation alone reaches 1e-5); each operator is then cast to the maps' dtype: float64 for float64 models,
    float32 otherwise.
    """
    dtype = model_dtype(model)
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    # the maps are checked where they are made (check_maps), against the operator's output: with parts of the operator
    # switched off (components=, an ablation) they describe by design another function than the layer's
    whole = kept == frozenset(families.COMPONENTS)
    token_mask = None if attention_mask is None else attention_mask.to(torch.float64)
    attention_calls: dict[int, list] = {}
    for call in trace.attention_calls:
        attention_calls.setdefault(call.layer, []).append(call)
    mixer_calls: dict[int, list] = {}
    for call in trace.mixer_calls:
        mixer_calls.setdefault(call.located.layer, []).append(call)

    for index in sorted(set(attention_calls) | set(mixer_calls)):
        # an offloaded layer's weights exist only inside its own forward: load them for its rebuild (and its
        # operator's maps, computed by the caller while this layer is current)
        with loaded_weights(model, decoder_layers[trace.decoder_layer(index)]):
            calls = mixer_calls.get(index, [])
            # a mixer that splits its tokens into segments and calls the attention interface once per segment (LFM3-VL's
            # vision attention over the frames of packed images) takes all of its calls; anything else calls it once
            segmented = any(c.located.adapter.ATTENTION_SEGMENTS for c in calls)
            if (len(attention_calls.get(index, ())) > 1 and not segmented) \
                    or len({c.located.name for c in calls}) < len(calls):
                raise RuntimeError(f"mamba_captum: layer {index} ran a token mixer twice in one forward; not supported.")
            attention = ssm = attention_grads = attention_error = None
            attentions = []
            for call in attention_calls.get(index, ()):
                attention, rebuilt, real = softmax.rebuild(call, torch.float64, token_mask)
                attentions.append(attention)
                attention_grads = _operator_grads(attention, call)
                dropout = getattr(call.module, "attention_dropout", 0.0)
                if call.module.training and dropout:  # a random mask inside the interface: P v is not the output
                    raise ValueError(
                        f"mamba_captum: layer {index} ({type(call.module).__name__}) drops attention probabilities at "
                        f"random in train() mode (attention_dropout={dropout}): the probabilities it used cannot be "
                        "recovered. Explain the model in eval() mode.")
                error = check_reconstruction(f"layer {index} ({type(call.module).__name__})", real, rebuilt, dtype,
                                             token_mask, module=call.module, layer_input=call.value, model=model)
                attention_error = error if attention_error is None else max(attention_error, error)
            parts = []  # the layer's token mixers in execution order: [name, operator, error, call whose output it gives]
            for call in calls:
                located = call.located
                _check_no_dropout(f"layer {index} ({located.name})", located.module)
                if call.attention_mask is None and located.adapter.IGNORES_ATTENTION_MASK:
                    call.attention_mask = token_mask  # (right) padding: zero the pad rows and columns of the maps
                _check_hooked(f"layer {index} ({located.name})", call, dtype)
                if _consumes_attention(located):
                    # softmax attention with more around it (ZAYA's shifted values, LFM3-VL's segments, Inkling's
                    # convolved values): the adapter explains the whole mixer from the probabilities of its attention
                    # calls, which are then not maps of their own
                    if attention is None:
                        raise RuntimeError(f"mamba_captum: layer {index} ({located.name}) called no attention "
                                           "interface that the capture could see; not supported.")
                    ssm, rebuilt = located.adapter.rebuild(call, formulation, kept, torch.float64,
                                                           attention=attentions if segmented else attention)
                    consumed_error, attention, attention_grads = attention_error, None, None
                else:
                    ssm, rebuilt = located.adapter.rebuild(call, formulation, kept, torch.float64)
                    consumed_error = None
                # a mixer around softmax attention is compared on its real rows, as the attention is: what fully masked
                # (pad) query rows give depends on the attention implementation's convention
                try:
                    ssm_error = check_reconstruction(
                        f"layer {index} ({located.name}, {type(located.module).__name__})", call.output, rebuilt,
                        dtype, None if consumed_error is None else token_mask, module=located.module,
                        layer_input=call.hidden_states, model=model)
                except ReconstructionError as error:
                    if not _has_gap(call.attention_mask):
                        raise
                    raise ReconstructionError(
                        f"{error} The attention_mask has a gap (a 0 between real tokens of a row), which is the likely "
                        "cause: a layer that packs a padded batch into sequences (flash-linear-attention's) drops the "
                        "gap instead of running a zeroed token there. Pad at the start or the end of each row only."
                    ) from error
                if consumed_error is not None:
                    ssm_error = max(ssm_error, consumed_error)  # the probabilities were checked too
                if located.follows is not None:
                    # no residual between this mixer and the one whose output it takes: one token mixer, composed
                    previous = next((part for part in parts if part[0] == located.follows), None)
                    if previous is None or not _same_tensor(call.hidden_states, previous[3].output):
                        raise ReconstructionError(
                            f"mamba_captum: {located.name} ({type(located.module).__name__}) did not receive the output "
                            f"of {located.follows} as its input (a hook that replaces that output, or another layout of "
                            "the layer); its operator would not compose with that mixer's. Remove the hook, or report "
                            "the model class and config.")
                    previous[1] = ComposedOperator.of(previous[1], ssm)
                    previous[2], previous[3] = max(previous[2], ssm_error), call
                    continue
                parts.append([located.name, ssm, ssm_error, call])
            layer = decoder_layers[trace.decoder_layer(index)]
            if len(parts) == 1 and attention is not None and hasattr(layer, "ssm_out_multiplier"):
                # FalconH1: attention ∥ Mamba-2 summed in every layer, each scaled by its output multiplier.
                ssm, ssm_error, ssm_grads = parts[0][1], parts[0][2], _operator_grads(parts[0][1], parts[0][3])
                combined = SumOperator([(float(layer.ssm_out_multiplier), ssm), (float(layer.attn_out_multiplier),
                                                                                   attention)])
                grads = None if ssm_grads is None else [list(pair) for pair in zip(ssm_grads, attention_grads)]
                combined = combined.to(work_dtype)
                if whole:
                    check_maps(f"layer {index}", combined, dtype, token_mask)
                yield index, combined, max(ssm_error, attention_error), grads
                continue
            if attention is not None:  # Zamba2's shared block runs before the layer's Mamba-2 mixer
                key = SharedAttentionKey(index) if parts else index
                attention = attention.to(work_dtype)
                check_maps(f"layer {key}", attention, dtype, token_mask)  # softmax: no components to switch off
                yield key, attention, attention_error, attention_grads
            ssm = rebuilt = None  # (the loop's last) float64 operator and rebuilt output: not alive during the maps
            for number in range(len(parts)):
                name, operator, error, call = parts[number]
                parts[number] = None  # the float64 operator is not kept alive while the caller uses the cast one
                key = index if number == 0 else LayerPartKey(index, name.split(".", 1)[1], number)
                grads, operator = _operator_grads(operator, call), operator.to(work_dtype)
                if whole:  # the maps' kernels, where they are made
                    check_maps(f"layer {key} ({name})", operator, dtype, token_mask, call.located.module)
                yield key, operator, error, grads
                del operator


def _has_gap(mask) -> bool:
    """Whether a (B, L) 0/1 mask has a 0 between two 1s in some row (padding inside the text, not at its ends)."""
    if mask is None:
        return False
    real = mask.bool()
    positions = torch.arange(real.shape[-1], device=real.device)
    first = torch.where(real, positions, real.shape[-1]).min(-1).values
    last = torch.where(real, positions, -1).max(-1).values
    return bool((real.sum(-1) < last - first + 1).any())


def _check_hooked(name: str, call, dtype: torch.dtype):
    """A submodule of the mixer that carries the user's hooks must give, without them, what it gave with them: the
    rebuild runs it without hooks (so that they fire once per call), and a hook that changes its output would make
    the rebuilt operator describe another function.

    Raises:
        ReconstructionError: naming the submodule.
    """
    from .families.common import run

    for path, module, (args, kwargs), output in call.hooked:
        if not torch.is_tensor(output):
            continue
        with torch.no_grad():
            recomputed = module.forward(*args, **kwargs) if kwargs else run(module, *args)
        if not torch.is_tensor(recomputed) or recomputed.shape != output.shape:
            continue
        scale = output.detach().double().abs().max().item()
        error = (recomputed.detach().double() - output.detach().double()).abs().max().item()
        bound = 1e-6 if dtype in (torch.float32, torch.float64) else 1e-3  # the same op on the same input
        if not error <= bound * max(scale, 1e-30):
            raise ReconstructionError(
                f"mamba_captum: a forward hook on {path} of {name} changes its output (relative "
                f"{error / max(scale, 1e-30):.3g}); the operator is rebuilt from the weights, so it would describe "
                "another function than the one that ran. Remove the hook while explaining, or hook the mixer's "
                "output instead (changes there act downstream of the operator and are explained correctly).")


def _check_no_dropout(name: str, mixer) -> None:
    """A token mixer in train() mode must not drop anything at random (e.g. PEFT's lora_dropout on a projection):
    the rebuild runs the projections again and would draw another mask.

    Raises:
        ValueError: naming the dropout module and the fix.
    """
    if not mixer.training:
        return
    active = [path for path, sub in mixer.named_modules()
              if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0 and sub.training]
    if active:
        raise ValueError(f"mamba_captum: {name} drops activations at random in train() mode ({active[0]}, "
                         f"p={mixer.get_submodule(active[0]).p}): the values it used cannot be recovered. Explain the "
                         "model in eval() mode.")


def _consumes_attention(located) -> bool:
    """Whether the mixer's adapter explains it from its attention-interface calls: ``CONSUMES_ATTENTION`` True (the
    adapter's every class) or the class names that do (an adapter module with an attention and a convolution)."""
    consumes = located.adapter.CONSUMES_ATTENTION
    return consumes is True or (not isinstance(consumes, bool) and type(located.module).__name__ in consumes)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same values (the same storage for recorded forwards; equal values else)."""
    if a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))


class MapStream:
    """Each decoder layer's maps as soon as its forward returned, then its recorded tensors dropped: one layer's
    inputs, outputs and operator are alive at a time, whatever the depth (long sequences, docs/scale.md). The
    ``on_layer_done`` of :func:`mamba_captum.implicit_attention`'s :class:`LayerCapture`."""

    def __init__(self, model, decoder_layers, formulation, kept, attention_mask, reduce, rows, maps):
        self.model, self.decoder_layers, self.formulation, self.kept = model, decoder_layers, formulation, kept
        self.attention_mask, self.reduce, self.rows, self.maps = attention_mask, reduce, rows, maps
        self.done = set()

    def __call__(self, trace, index):
        calls = [c for c in trace.mixer_calls if c.located.layer == index and c.output is not None]
        attention = [c for c in trace.attention_calls if c.layer == index]
        if not calls and not attention:
            return
        if index in self.done:
            raise RuntimeError(f"mamba_captum: decoder layer {index} ran twice in one forward; not supported.")
        layer_trace = Trace(mixer_calls=calls, attention_calls=attention, schedule=trace.schedule)
        for key, operator, _, _ in rebuilt_operators(self.model, layer_trace, self.decoder_layers,
                                                     self.formulation, self.kept, self.attention_mask):
            self.maps[key] = operator.maps(self.reduce, self.rows)
            check_finite(self.maps[key], f"the implicit-attention map of layer {key} (its output was reproduced: "
                         "please report this)")
        for call in calls:  # what the maps needed; the call stays (check_recorded counts the layers)
            call.hidden_states = call.output = None
            call.options, call.hooked = {}, []
        trace.attention_calls = [c for c in trace.attention_calls if c.layer != index]
        self.done.add(index)
