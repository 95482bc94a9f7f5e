"""Explaining generated text (``attribute_generation``): the queries, one per generated token, and Captum's
``LLMAttributionResult`` of their relevance (``plot_token_attr`` / ``plot_seq_attr``)."""
from __future__ import annotations

import os
import sys

import torch
from captum.attr import LLMAttributionResult, TextTokenInput

from ..checks import index_list
from ..session import session
from ..tokens import unknown_id, unknown_spelling, unknown_words, warn_unknown_ids


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../mamba_captum


def _frames_to_the_caller() -> int:
    """The ``stacklevel`` (counted from this function's caller) of the first frame outside the library: the
    attribute_generation call in the user's code, however many of the library's frames lie between."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def refuse_single_call_keywords(kwargs) -> None:
    """TypeError for the keywords of one ``attribute`` call that ``attribute_generation`` cannot take."""
    for name in ("position", "attention_mask", "additional_forward_args"):
        if name in kwargs:
            raise TypeError(f"mamba_captum: {name}= does not apply to attribute_generation, which explains each "
                            "generated token of one unpadded prompt.")


def generation_inputs(model, runner, inp, target, tokenizer, gen_args, forward_kwargs):
    """:func:`generation_queries` after the checks every ``attribute_generation`` makes: forward arguments need an
    explicit target (they must cover prompt + generated tokens), and the runner sees the model's current layers."""
    if forward_kwargs and target is None:
        raise ValueError(f"mamba_captum: forward arguments ({', '.join(sorted(forward_kwargs))}) must cover prompt + "
                         "generated tokens: give target= explicitly.")
    runner.refresh()
    return generation_queries(model, runner, inp, target, tokenizer, gen_args)


def generation_queries(model, runner, inp, target, tokenizer, gen_args):
    """Prompt ids (1, Lp), full ids (1, Lp + T), target ids (T,), tokenizer, kept prompt positions (Lp,) bool.

    ``runner``: the method's :class:`~mamba_captum.attr._runner.Runner` (its ``forward_func`` and
    ``decoder_layers``). A prompt holding the tokenizer's unknown token gets an
    :class:`~mamba_captum.tokens.UnknownTokenWarning` (a ``TextTokenInput`` does not keep its text: the positions
    are named); a str target with an unknown token is refused (ValueError)."""
    if runner.forward_func is not None:
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
    if tokenizer is not None:  # the warning points at the user's line that called attribute_generation
        warn_unknown_ids(tokenizer, prompt[0], "the prompt", stacklevel=_frames_to_the_caller())
    device = next(model.parameters()).device
    prompt = prompt.to(device)
    if target is None:
        options = {"max_new_tokens": 25, "do_sample": False, **(gen_args or {})}
        with torch.no_grad(), session(model, runner.decoder_layers):
            generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), **options)
        generated = getattr(generated, "sequences", generated)  # return_dict_in_generate: a GenerateOutput
        target_ids = generated[0, prompt.shape[1]:]
    elif isinstance(target, str):
        if tokenizer is None:
            raise ValueError("mamba_captum: a str target needs a tokenizer (pass tokenizer= or a TextTokenInput).")
        target_ids = torch.tensor(tokenizer.encode(target, add_special_tokens=False), device=device)
        _refuse_unknown_target(tokenizer, target, target_ids)
    else:
        target_ids = torch.tensor(index_list(target, "target"), dtype=torch.long, device=device)
    if target_ids.numel() == 0:
        raise ValueError("mamba_captum: the target has no tokens.")
    full = torch.cat([prompt, target_ids[None]], dim=1)
    return prompt, full, target_ids, tokenizer, keep.to(device)


def _refuse_unknown_target(tokenizer, target: str, target_ids) -> None:
    """A str target must be spelled with the vocabulary: an unknown token in it would explain the stand-in's
    probability, not the target's (several tokens are fine: the target is a sequence)."""
    token_id = unknown_id(tokenizer)
    if token_id is None or token_id not in target_ids.tolist() or target.strip() == unknown_spelling(tokenizer):
        return  # the unknown token spelled out is a token like any other (the CLI's --target takes it too)
    words = [w for w in unknown_words(tokenizer, target, add_special_tokens=False) if w is not None]
    standing = f", standing for {', '.join(map(repr, words))}" if words else ""
    raise ValueError(f"mamba_captum: the target {target!r} is not in the tokenizer's vocabulary: it tokenizes to "
                     f"{tokenizer.convert_ids_to_tokens(target_ids.tolist())}, with the unknown token "
                     f"{unknown_spelling(tokenizer)!r}{standing}; give a target of words in the vocabulary, or its token "
                     "ids (target=[...]).")


def token_names(ids, tokenizer) -> list[str]:
    """The token strings of ``ids`` (L,) (their numbers as strings without a tokenizer)."""
    ids = [int(i) for i in ids]
    return tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]


def generation_result(inp, prompt, target_ids, tokenizer, keep, explained, relevance) -> LLMAttributionResult:
    """Captum's result for T generated tokens: ``token_attr`` (T, kept prompt tokens) from each token's relevance
    row (1, Lp + T), ``output_probs`` (T,) the generated tokens' probabilities in ``explained.scores``."""
    prompt_length = prompt.shape[1]
    rows = torch.stack([r[0, :prompt_length] for r in relevance])  # (T, Lp): each generated token's row
    token_attr = rows[:, keep].detach().cpu()
    probs = torch.stack([torch.softmax(scores[0].double(), -1)[int(t)]
                         for scores, t in zip(explained.scores, target_ids)]).float().cpu()
    input_tokens = inp.values if isinstance(inp, TextTokenInput) else \
        [n for n, k in zip(token_names(prompt[0], tokenizer), keep.tolist()) if k]
    return LLMAttributionResult(input_tokens=list(input_tokens), output_tokens=token_names(target_ids, tokenizer),
                                seq_attr=token_attr.sum(0), token_attr=token_attr, output_probs=probs,
                                inp=inp if isinstance(inp, TextTokenInput) else None)
