"""Results into Captum's visualisation: ``VisualizationDataRecord``s for ``visualize_text``, and the
``output_attentions`` layout (bertviz). The ``LLMAttributionResult``s of generated text (``plot_token_attr`` /
``plot_seq_attr``) are built by the attribution classes (:mod:`mamba_captum.attr._generation`)."""
from __future__ import annotations

import torch

from .checks import check_mask
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
