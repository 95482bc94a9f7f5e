"""``implicit_attention``: the per-layer implicit-attention maps of a transformers model, one forward pass."""
from __future__ import annotations

import inspect

import torch

from . import families
from .capture import LayerCapture, Trace
from .checks import (check_finite, check_inputs, check_keywords, check_mask, index_list,
                     check_forward_devices, model_dtype, underlying_forward, unwrap_parallel)
from .dispatch import loaded_weights
from .fast_scans import fast_scans
from .families import softmax
from .layout import check_packed, check_pixels, packed_tower, vision_layout
from .operators import REDUCTIONS, ComposedOperator, SumOperator, operator_output_grad
from .session import session
# ReconstructionError and TOLERANCE are defined with the check that uses them (the engine's verification) and
# stay importable from here, where users met them
from .verification import TOLERANCE, ReconstructionError, check_reconstruction  # noqa: F401

FORMULATIONS = ("unified", "hidden")
class LayerPartKey(str):
    """The map key of a token mixer run inside decoder layer ``layer`` besides the one under the int key ``layer``:
    the string ``"{layer}.{part}"``, ordered just after the int key ``layer`` (so ``sorted(maps)`` is execution
    order, next to the int keys of the other layers). Inkling's convolution after the MLP (``"{i}.mlp_sconv"``,
    Inkling2's ``"{i}.post_mlp_convolution"``). Equal to, and hashed as, the plain string."""

    ORDER = 2  # relative to the int key of the same layer (1)

    def __new__(cls, layer: int, part: str):
        key = super().__new__(cls, f"{layer}.{part}")
        key.layer, key.part = int(layer), str(part)
        return key

    def __getnewargs__(self):  # pickle / deepcopy rebuild it from the layer index and the part
        return (self.layer, self.part)

    @staticmethod
    def _rank(key):
        if isinstance(key, LayerPartKey):
            return (key.layer, key.ORDER, key.part)
        if isinstance(key, int) and not isinstance(key, bool):
            return (key, 1, "")
        return None

    def _compare(self, other, op):
        ranks = self._rank(self), self._rank(other)
        if ranks[1] is None:
            return getattr(str(self), op)(other)
        return getattr(ranks[0], op)(ranks[1])

    def __lt__(self, other):
        return self._compare(other, "__lt__")

    def __le__(self, other):
        return self._compare(other, "__le__")

    def __gt__(self, other):
        return self._compare(other, "__gt__")

    def __ge__(self, other):
        return self._compare(other, "__ge__")

    __hash__ = str.__hash__
    __eq__ = str.__eq__
    __ne__ = str.__ne__


class SharedAttentionKey(LayerPartKey):
    """The map key of Zamba2's shared attention block run inside decoder layer ``i``: the string
    ``"{i}.shared_attention"``, ordered just before the int key ``i`` (so ``sorted(maps)`` is execution order,
    next to the int keys of the other layers). Equal to, and hashed as, the plain string."""

    ORDER = 0

    def __new__(cls, layer: int):
        return super().__new__(cls, layer, "shared_attention")

    def __getnewargs__(self):  # pickle / deepcopy rebuild it from the layer index
        return (self.layer,)


# Maps saved with torch.save load back under torch.load's default weights_only=True.
torch.serialization.add_safe_globals([SharedAttentionKey, LayerPartKey])


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


def _layer_indices(layers, count: int):
    if layers is None:
        return None
    indices = index_list(layers, "layers")
    if any(not -count <= i < count for i in indices):
        raise IndexError(f"mamba_captum: layers={indices} out of range for a model with {count} decoder layers.")
    return sorted({i % count for i in indices})


def _normalise_rows(rows, length: int, device):
    if rows is None:
        return None
    indices = index_list(rows, "rows")
    if any(not -length <= i < length for i in indices):
        raise IndexError(f"mamba_captum: rows= {indices} out of range for a sequence of {length} tokens.")
    return torch.tensor([i % length for i in indices], dtype=torch.long, device=device)


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


def _capture(model, input_ids, attention_mask, formulation, layers, components, forward_kwargs,
             on_layer_done=None, output_read=True):
    """Validate the arguments and run the model once with the capture hooks (inside :func:`session`);
    ``on_layer_done(trace, index)`` as in :class:`LayerCapture`. With ``output_read=False`` a causal LM computes
    its logits for the last token only (L × vocabulary floats otherwise: 6.6 GB at L = 32k for a 50k vocabulary)."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"mamba_captum: formulation={formulation!r}; choose 'unified' or 'hidden'.")
    kept = families.parse_components(components, formulation)
    decoder_layers, mixers = families.locate(model)
    schedule = families.layer_schedule(decoder_layers, mixers)  # a looped model's layers run more than once
    layers = _layer_indices(layers, len(schedule))
    args = ()
    if vision_layout(model) is not None:  # an image model: model(pixel_values, ...)
        args = (input_ids,)
    elif packed_tower(model):  # a vision tower: pixel_values and grid_thw are among the keywords
        pass
    else:
        if input_ids is not None:
            forward_kwargs["input_ids"] = input_ids
        if attention_mask is not None:
            forward_kwargs["attention_mask"] = attention_mask
        forward_kwargs["use_cache"] = False  # no cache: it changes no output, and nothing continues from it
        if not output_read and "logits_to_keep" in inspect.signature(underlying_forward(model)).parameters:
            forward_kwargs["logits_to_keep"] = 1  # the layers' maps do not depend on the logits
    families.check_forward(mixers, attention_mask, forward_kwargs)
    with fast_scans(model), LayerCapture(decoder_layers, mixers, layers, on_layer_done=on_layer_done,
                                         schedule=schedule) as capture:
        output = model(*args, **forward_kwargs)
    check_recorded(capture.trace, mixers, layers)
    return capture.trace, output, decoder_layers, kept


def _check_arguments(model, input_ids, attention_mask, forward_kwargs, where) -> tuple[int, int]:
    """(B, L) of valid inputs; see :mod:`mamba_captum.checks`. An unsupported model is refused first."""
    families.locate(model)
    options = [n for n in inspect.signature(implicit_attention).parameters if n != "forward_kwargs"]
    check_keywords(forward_kwargs, underlying_forward(model), options, where)
    if packed_tower(model):  # packed patches (N, P) and grid_thw: one sequence (B = 1) of the N patches
        pixels = packed_pixels(input_ids, forward_kwargs)
        check_packed(model, pixels, forward_kwargs.get("grid_thw"), attention_mask)
        check_forward_devices(forward_kwargs, pixels.device, model)
        return 1, pixels.shape[0]
    layout = vision_layout(model)
    if layout is not None:  # pixels (B, C, H, W) in, L = patches + CLS tokens
        batch = check_pixels(model, input_ids, layout, attention_mask)
        check_forward_devices(forward_kwargs, input_ids.device, model)
        return batch, layout.length
    for name in ("logits_to_keep", "num_logits_to_keep", "return_dict"):
        forward_kwargs.pop(name, None)  # the maps need no logits; outputs are not read
    batch, length = check_inputs(model, input_ids, forward_kwargs.get("inputs_embeds"))
    source = input_ids if input_ids is not None else forward_kwargs["inputs_embeds"]
    check_mask(attention_mask, batch, length, source.device)
    check_forward_devices(forward_kwargs, source.device, model)
    return batch, length


def packed_pixels(inputs, forward_kwargs: dict):
    """A packed vision tower's pixel values, given positionally (``inputs``) or as ``pixel_values=``; kept in
    ``forward_kwargs["pixel_values"]`` for the forward call.

    Raises:
        ValueError: given both ways, or neither.
    """
    if inputs is not None:
        if forward_kwargs.get("pixel_values") is not None:
            raise ValueError("mamba_captum: the pixel values are given twice (positionally and as pixel_values=).")
        forward_kwargs["pixel_values"] = inputs
    if forward_kwargs.get("pixel_values") is None:
        raise ValueError("mamba_captum: pass the packed patches, pixel_values= (N, P), with grid_thw= (n_items, 3).")
    return forward_kwargs["pixel_values"]


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
            segmented = any(getattr(c.located.adapter, "ATTENTION_SEGMENTS", False) for c in calls)
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
                                             token_mask, module=call.module, layer_input=call.value)
                attention_error = error if attention_error is None else max(attention_error, error)
            parts = []  # the layer's token mixers in execution order: [name, operator, error, call whose output it gives]
            for call in calls:
                located = call.located
                _check_no_dropout(f"layer {index} ({located.name})", located.module)
                if call.attention_mask is None and getattr(located.adapter, "IGNORES_ATTENTION_MASK", False):
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
                ssm_error = check_reconstruction(
                    f"layer {index} ({located.name}, {type(located.module).__name__})", call.output, rebuilt, dtype,
                    None if consumed_error is None else token_mask, module=located.module,
                    layer_input=call.hidden_states)
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
                yield index, combined.to(work_dtype), max(ssm_error, attention_error), grads
                continue
            if attention is not None:  # Zamba2's shared block runs before the layer's Mamba-2 mixer
                yield (SharedAttentionKey(index) if parts else index), attention.to(work_dtype), \
                    attention_error, attention_grads
            ssm = rebuilt = None  # (the loop's last) float64 operator and rebuilt output: not alive during the maps
            for number in range(len(parts)):
                name, operator, error, call = parts[number]
                parts[number] = None  # the float64 operator is not kept alive while the caller uses the cast one
                key = index if number == 0 else LayerPartKey(index, name.split(".", 1)[1])
                grads, operator = _operator_grads(operator, call), operator.to(work_dtype)
                yield key, operator, error, grads
                del operator


def _consumes_attention(located) -> bool:
    """Whether the mixer's adapter explains it from its attention-interface calls: ``CONSUMES_ATTENTION`` True (the
    adapter's every class) or the class names that do (an adapter module with an attention and a convolution)."""
    consumes = getattr(located.adapter, "CONSUMES_ATTENTION", False)
    return consumes is True or (not isinstance(consumes, bool) and type(located.module).__name__ in consumes)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same values (the same storage for recorded forwards; equal values else)."""
    if a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))


def build_operators(model, input_ids=None, attention_mask=None, *, formulation="unified", layers=None,
                    components=None, **forward_kwargs):
    """Run one forward pass with the capture hooks and rebuild every token mixer's operator.

    Arguments as in :func:`implicit_attention`. The forward runs in the caller's grad mode; the operators carry no
    graph.

    Returns:
        (operators, output, errors): ``operators`` maps a layer key (decoder-layer index; for Zamba2's shared
        attention block, ``"{i}.shared_attention"``; for Inkling's MLP branch, ``"{i}.mlp_sconv"``) to its operator
        (:mod:`mamba_captum.operators`), in execution order; ``output`` is the model's output; ``errors`` maps the
        same keys to the relative error of the layer output rebuilt from the operator.
    """
    operators, errors = {}, {}
    model = unwrap_parallel(model)
    _check_arguments(model, input_ids, attention_mask, forward_kwargs, "build_operators")
    # session: one call at a time on this model, a plain eager forward, and RWKV's in-place rescaling undone
    # after the rebuild (which needs the weights the forward used).
    with session(model, families.decoder_layers(model)):
        trace, output, decoder_layers, kept = _capture(model, input_ids, attention_mask, formulation, layers,
                                                       components, forward_kwargs)
        with torch.no_grad():
            for key, operator, error, _ in rebuilt_operators(model, trace, decoder_layers, formulation, kept,
                                                             attention_mask):
                operators[key], errors[key] = operator, error
    return operators, output, errors


def implicit_attention(model, input_ids=None, attention_mask=None, *, formulation="unified", reduce="mean",
                       layers=None, rows=None, components=None, **forward_kwargs):
    """Per-layer implicit-attention maps: the data-controlled matrices H with ``y = H x`` of every token mixer.

    Args:
        model: a transformers model with supported token mixers (pure or hybrid), as loaded (any kernel path), or
            a Vision Mamba (:mod:`mamba_captum.vision`).
        input_ids: (B, L) token ids (or pass ``inputs_embeds=`` (B, L, D) in ``forward_kwargs``); for a Vision
            Mamba, pixel values (B, C, H, W): the maps are over its L patch and CLS tokens, in its own order; for a
            packed vision tower (LFM3-VL's ``Lfm3VlVisionModel``), the packed patches (N, P) (or ``pixel_values=``)
            with ``grid_thw=`` (n_items, 3): the maps are (1, N, N) over the N patches of all items in the tower's
            merge-block order (:class:`mamba_captum.vision.PackedPatches`), zero across frames and items.
        attention_mask: (B, L), 1 for real tokens; left or right padding.
        formulation: ``"unified"`` (gate · S6 · activation · conv [· norm], Zimerman et al.) or ``"hidden"``
            (the S6 / SSD part alone, Ali et al.).
        reduce: ``"mean"`` | ``"abs_mean"`` | ``"sum"`` over channels, or None for per-channel maps.
        layers: decoder-layer indices to compute (negative allowed), None for all; for a looped model
            (inkling2_loop), positions in its sequence of decoder-layer calls (the maps' keys, below).
        rows: query rows to compute (ints, negative allowed), None for all.
        components: unified only: the parts to keep, from ``("s6", "gate", "act", "conv", "norm")`` (an iterable
            of names or a mapping name -> bool); None keeps all. Used for the ablations.
        **forward_kwargs: passed to ``model(...)`` (e.g. ``position_ids``, ``inputs_embeds``).

    Returns:
        dict: decoder-layer index -> (B, L, L) reduced map or (B, C, L, L) per channel (C = d_inner channels;
        Mamba-2 "hidden": C = num_heads); (B, R, L) / (B, C, R, L) with ``rows``. Softmax layers of hybrids give
        their head-mean (head-wise with ``reduce=None``) probabilities; FalconH1 layers give the sum of their two
        parts scaled by the layer's output multipliers; Zamba2's shared attention block appears under the key
        ``"{i}.shared_attention"`` (a :class:`SharedAttentionKey`, which sorts just before ``i``) just before
        layer ``i``; Inkling's and Inkling2's decoder layers give their attention branch (the attention composed
        with the convolution after o_proj; with ``reduce=None`` its D·C paths d ← c, d major) under ``i`` and their
        MLP branch's convolution under ``"{i}.mlp_sconv"`` / ``"{i}.post_mlp_convolution"`` (a
        :class:`LayerPartKey`, which sorts just after ``i``). A looped model (inkling2_loop), whose loop layers run
        once per pass, is keyed by decoder-layer call in execution order (HF's numbering of its
        ``output_hidden_states``; :func:`mamba_captum.families.layer_schedule` gives each call's layer). Float32,
        or float64 for float64 models. Rows and columns of padding tokens are zero.

    Raises:
        TypeError: the model has a token mixer with no adapter (named in the message); or a bad argument.
        ValueError, IndexError: a bad argument (the message names it and the fix).
        ReconstructionError: a rebuilt operator does not reproduce its layer's real output.
        NonFiniteError: a layer's real output holds NaN or inf (its non-finite weights are named).
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"mamba_captum: reduce={reduce!r}; choose one of {REDUCTIONS}.")
    model = unwrap_parallel(model)
    _, length = _check_arguments(model, input_ids, attention_mask, forward_kwargs, "implicit_attention")
    source = input_ids if input_ids is not None else forward_kwargs.get("inputs_embeds",
                                                                        forward_kwargs.get("pixel_values"))
    selected = _normalise_rows(rows, length, source.device)
    maps = {}
    decoder_layers = families.decoder_layers(model)
    with torch.no_grad(), session(model, decoder_layers):
        # an unknown formulation is refused by _capture, before the forward
        kept = families.parse_components(components, formulation) if formulation in FORMULATIONS else None
        stream = _MapStream(model, decoder_layers, formulation, kept, attention_mask, reduce, selected, maps)
        trace, _, _, _ = _capture(model, input_ids, attention_mask, formulation, layers, components, forward_kwargs,
                                  on_layer_done=stream, output_read=False)
        for index in sorted({call.located.layer for call in trace.mixer_calls if call.output is not None}
                            | {call.layer for call in trace.attention_calls}):
            stream(trace, index)  # calls made outside their decoder layer's own forward, if any
    return dict(sorted(maps.items()))


class _MapStream:
    """Each decoder layer's maps as soon as its forward returned, then its recorded tensors dropped: one layer's
    inputs, outputs and operator are alive at a time, whatever the depth (long sequences, docs/scale.md)."""

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
