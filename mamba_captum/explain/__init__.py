"""Texts in, explanations out: the layer the CLI, the HTML report and the Trainer callback share.

``explain(model, tokenizer, texts)`` runs the methods (by default every one the model supports) on each text and
returns :class:`Explanation` records (tokens, prediction, per-method relevance, per-layer implicit-attention maps)
that serialise to JSON.

The package: :mod:`~mamba_captum.explain.loading` (a checkpoint directory -> model and tokenizer),
:mod:`~mamba_captum.explain.text` (texts, tokens, targets), :mod:`~mamba_captum.explain.pipeline` (the methods on
each text, :class:`Explanation`) and :mod:`~mamba_captum.explain.images` (images in, explanations out: the one
module here that imports the vision model zoo, so it loads only when imported).
"""
from __future__ import annotations

# the names this module has always had (tests/public_api.json), the ones its code imported included
from pathlib import Path

from ..attention import implicit_attention
from ..attr import MambaAttribution, MambaLRP, MambaRawAttention, MambaRollout, MambaSelectionAttribution
from ..families import SUPPORTED_MIXERS, decoder_layers
from ..session import session
from .loading import DEVICE_MAP_STRATEGIES, DTYPES, UsageError, check_device, check_supported, is_classifier, load
from .pipeline import CLASS_SPECIFIC, METHODS, Explanation, explain, explain_ids, lrp_refusal
from .text import encode_text, label_words, readable_tokens, resolve_target
