"""``implicit_attention`` and ``build_operators``: the per-layer implicit-attention maps and operators of a
transformers model, one forward pass (the engine below: :mod:`mamba_captum.rebuild`)."""
from __future__ import annotations

import inspect

import torch

from . import families
from .capture import LayerCapture
from .checks import (check_inputs, check_keywords, check_mask, index_list, check_forward_devices, underlying_forward,
                     unwrap_parallel)
from .layout import check_packed, check_pixels, packed_tower, vision_layout
from .operators import REDUCTIONS
from .rebuild import MapStream, captured_forward, kept_components, rebuilt_operators
from .session import session
# names users met here, now defined in the engine: the map keys (mamba_captum.keys), the formulations and the
# rebuild loop (mamba_captum.rebuild), ReconstructionError and TOLERANCE with the check that uses them
# (mamba_captum.verification)
from .keys import LayerPartKey, SharedAttentionKey  # noqa: F401
from .rebuild import FORMULATIONS, check_recorded  # noqa: F401
from .verification import TOLERANCE, ReconstructionError  # noqa: F401


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


def _capture(model, input_ids, attention_mask, formulation, layers, components, forward_kwargs,
             on_layer_done=None, output_read=True):
    """Validate the arguments and run the model once with the capture hooks (inside :func:`session`);
    ``on_layer_done(trace, index)`` as in :class:`LayerCapture`. With ``output_read=False`` a causal LM computes
    its logits for the last token only (L × vocabulary floats otherwise: 6.6 GB at L = 32k for a 50k vocabulary)."""
    kept = kept_components(formulation, components)
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
    capture = LayerCapture(decoder_layers, mixers, layers, on_layer_done=on_layer_done, schedule=schedule)
    trace, output = captured_forward(model, capture, mixers, layers, attention_mask, forward_kwargs,
                                     lambda: model(*args, **forward_kwargs))
    return trace, output, decoder_layers, kept


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
        kept = kept_components(formulation, components)  # an unknown formulation is refused before the forward
        stream = MapStream(model, decoder_layers, formulation, kept, attention_mask, reduce, selected, maps)
        trace, _, _, _ = _capture(model, input_ids, attention_mask, formulation, layers, components, forward_kwargs,
                                  on_layer_done=stream, output_read=False)
        for index in sorted({call.located.layer for call in trace.mixer_calls if call.output is not None}
                            | {call.layer for call in trace.attention_calls}):
            stream(trace, index)  # calls made outside their decoder layer's own forward, if any
    return dict(sorted(maps.items()))
