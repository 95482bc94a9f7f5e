"""Results into Captum's visualisation: ``VisualizationDataRecord``s for ``visualize_text`` and
``LLMAttributionResult``s for generated text (``plot_token_attr`` / ``plot_seq_attr``)."""
from __future__ import annotations

import torch

from .checks import check_mask, index_list
from .session import session
from captum.attr import LLMAttributionResult, TextTokenInput
from captum.attr import visualization as captum_visualization


def scale_to_unit(relevance: torch.Tensor) -> torch.Tensor:
    """Divide by the largest |value| so scores lie in [-1, 1] (all-zero stays zero). Works on the last dim."""
    relevance = relevance.detach().double()
    peak = relevance.abs().amax(-1, keepdim=True)
    return (relevance / torch.where(peak > 0, peak, torch.ones_like(peak))).float()


def to_visualization_record(relevance, tokens, *, attention_mask=None, pred_prob=0.0, pred_class="",
                            true_class="", attr_class="", convergence_score=0.0):
    """``VisualizationDataRecord``(s) that ``captum.attr.visualization.visualize_text`` renders.

    Args:
        relevance: (L,) for one example or (B, L) for a batch (e.g. ``attr.attribute(...)``); (B, L, D) embedding
            attributions are reduced to one score per token (their first feature; the methods repeat it).
        tokens: L token strings, or B lists of them.
        attention_mask: (B, L) or (L,); padding tokens are left out of the record.
        pred_prob: the predicted probability, shown in the table (a scalar, or one per example); likewise
        pred_class: the predicted class,
        true_class: the true class,
        attr_class: the explained class.
        convergence_score: Captum's convergence column.
    Returns:
        one record for (L,) input, a list of B records for (B, L). Word scores are scaled to [-1, 1] by the
        largest |score| of the example; ``attr_score`` is the unscaled sum.
    """
    relevance = torch.as_tensor(relevance).detach()
    if relevance.dim() == 3:
        relevance = relevance[..., 0]
    single = relevance.dim() == 1
    batch = relevance[None] if single else relevance
    token_lists = [tokens] if single else list(tokens)
    if len(token_lists) != batch.shape[0]:
        raise ValueError(f"mamba_captum: {len(token_lists)} token lists for {batch.shape[0]} examples.")
    mask = None
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        if tuple(mask.shape) != tuple(relevance.shape):
            raise ValueError(f"mamba_captum: attention_mask has shape {tuple(mask.shape)}; the relevance is "
                             f"{tuple(relevance.shape)}: give one mask row per example, of the same length.")
        mask = mask.reshape(batch.shape)
        check_mask(mask, *batch.shape, mask.device)  # 0 / 1 only, a real token in every row
        mask = mask.bool()

    def pick(value, index):
        return value[index] if isinstance(value, (list, tuple)) or (torch.is_tensor(value) and value.dim()) \
            else value

    records = []
    for index, (row, names) in enumerate(zip(batch, token_lists)):
        names = list(names)
        if len(names) != row.shape[0]:
            raise ValueError(f"mamba_captum: {len(names)} tokens for a relevance row of {row.shape[0]}.")
        if mask is not None:
            keep = mask[index]
            row, names = row[keep], [n for n, k in zip(names, keep.tolist()) if k]
        records.append(captum_visualization.VisualizationDataRecord(
            scale_to_unit(row), float(pick(pred_prob, index)), pick(pred_class, index), pick(true_class, index),
            pick(attr_class, index), float(row.sum()), names, float(pick(convergence_score, index))))
    return records[0] if single else records


# -- generated text ------------------------------------------------------------------------------------------------
def generation_queries(method, inp, target, tokenizer, gen_args):
    """Prompt ids (1, Lp), full ids (1, Lp + T), target ids (T,), tokenizer, kept prompt positions (Lp,) bool."""
    if method._runner.forward_func is not None:
        raise TypeError("mamba_captum: attribute_generation explains a *ForCausalLM model's next-token logits; "
                        "it does not take forward_func.")
    if isinstance(inp, TextTokenInput):
        prompt, tokenizer = inp.inp_tensor, inp.tokenizer
        keep = torch.ones(prompt.shape[1], dtype=torch.bool) if inp.itp_mask is None else inp.itp_mask[0].bool()
    elif torch.is_tensor(inp) and not inp.is_floating_point():
        prompt = inp if inp.dim() == 2 else inp[None]
        keep = torch.ones(prompt.shape[1], dtype=torch.bool)
    else:
        raise TypeError("mamba_captum: inp must be a captum TextTokenInput or prompt token ids (1, Lp).")
    if prompt.shape[0] != 1:
        raise ValueError(f"mamba_captum: attribute_generation explains one prompt; got a batch of {prompt.shape[0]}.")
    device = next(method.model.parameters()).device
    prompt = prompt.to(device)
    if target is None:
        options = {"max_new_tokens": 25, "do_sample": False, **(gen_args or {})}
        with torch.no_grad(), session(method.model, method._runner.decoder_layers):
            generated = method.model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        generated = getattr(generated, "sequences", generated)  # return_dict_in_generate: a GenerateOutput
        target_ids = generated[0, prompt.shape[1]:]
    elif isinstance(target, str):
        if tokenizer is None:
            raise ValueError("mamba_captum: a str target needs a tokenizer (pass tokenizer= or a TextTokenInput).")
        target_ids = torch.tensor(tokenizer.encode(target, add_special_tokens=False), device=device)
    else:
        target_ids = torch.tensor(index_list(target, "target"), dtype=torch.long, device=device)
    if target_ids.numel() == 0:
        raise ValueError("mamba_captum: the target has no tokens.")
    full = torch.cat([prompt, target_ids[None]], dim=1)
    return prompt, full, target_ids, tokenizer, keep.to(device)


def _token_names(ids, tokenizer):
    ids = [int(i) for i in ids]
    return tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]


def generation_result(inp, prompt, target_ids, tokenizer, keep, explained, relevance) -> LLMAttributionResult:
    prompt_length = prompt.shape[1]
    rows = torch.stack([r[0, :prompt_length] for r in relevance])  # (T, Lp): each generated token's row
    token_attr = rows[:, keep].detach().cpu()
    probs = torch.stack([torch.softmax(scores[0].double(), -1)[int(t)]
                         for scores, t in zip(explained.scores, target_ids)]).float().cpu()
    input_tokens = inp.values if isinstance(inp, TextTokenInput) else \
        [n for n, k in zip(_token_names(prompt[0], tokenizer), keep.tolist()) if k]
    return LLMAttributionResult(input_tokens=list(input_tokens), output_tokens=_token_names(target_ids, tokenizer),
                                seq_attr=token_attr.sum(0), token_attr=token_attr, output_probs=probs,
                                inp=inp if isinstance(inp, TextTokenInput) else None)


# -- the output_attentions layout (bertviz) -------------------------------------------------------------------------
def as_hf_attentions(model, input_ids, attention_mask=None, *, formulation="unified", reduce="abs_mean",
                     **forward_kwargs) -> tuple:
    """The per-layer implicit attention in HF's ``output_attentions`` layout, for tools that read it (bertviz's
    ``head_view`` / ``model_view``).

    Args:
        model: as :func:`mamba_captum.implicit_attention`.
        input_ids: (B, L) token ids.
        attention_mask: (B, L), 1 for real tokens.
        formulation: ``"unified"`` or ``"hidden"``.
        reduce: the channel reduction (default ``"abs_mean"``: non-negative, like attention probabilities; softmax
            layers of hybrids give their head-mean probabilities either way); ``None`` is refused (one "head" per
            layer).
        **forward_kwargs: passed to ``model(...)``.
    Returns:
        a tuple with one (B, 1, L, L) tensor per decoder layer, indexed like the decoder layers (a looped model,
        inkling2_loop: one per decoder-layer call, as its ``output_attentions``; one "head": the channel-reduced
        map). A decoder layer that mixes no tokens (e.g. NemotronH's MLP layers) gets the identity
        (each token reads only itself; zero on padding). Zamba2's shared attention block, which has no
        decoder-layer index of its own, is left out.
    """
    from . import families
    from .attention import implicit_attention

    if reduce is None:
        raise ValueError("mamba_captum: as_hf_attentions gives one channel-reduced map per layer; choose reduce="
                         "'abs_mean', 'mean' or 'sum' (implicit_attention(..., reduce=None) gives per-channel maps).")
    for name in ("layers", "rows"):
        if name in forward_kwargs:
            raise TypeError(f"mamba_captum: as_hf_attentions gives every layer's full map (the layout indexes them "
                            f"by layer); {name}= does not apply.")
    maps = implicit_attention(model, input_ids, attention_mask, formulation=formulation, reduce=reduce,
                              **forward_kwargs)
    any_map = next(iter(maps.values()))
    identity = torch.eye(any_map.shape[-1], dtype=any_map.dtype, device=any_map.device).expand_as(any_map)
    if attention_mask is not None:
        keep = attention_mask.to(any_map.device, any_map.dtype)
        identity = identity * keep[:, :, None] * keep[:, None, :]
    count = len(families.layer_schedule(*families.locate(model)))  # decoder-layer calls (looped models: per pass)
    return tuple((maps[layer] if layer in maps else identity)[:, None] for layer in range(count))
