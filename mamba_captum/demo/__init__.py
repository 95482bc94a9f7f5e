"""The bundled demo model: a tiny Mamba trained here (``python -m mamba_captum.demo.train``) to read the sentiment
of sentences of a small English grammar with negation and contrast (``demo.grammar``), with its tokenizer."""
from __future__ import annotations

from pathlib import Path

DEMO_TEXTS = [
    "the plot was not good",
    "honestly , the music was dull but the acting was great !",
    "the food is never bad , i think",
    "the service was truly awful .",
    "the movie looked wonderful but the ending was not very good",
]


def model_dir() -> Path:
    """The bundled checkpoint directory (config, weights, tokenizer, training.json)."""
    return Path(__file__).parent / "model"


def load_demo(device: str = "cpu"):
    """(model in eval mode, tokenizer) of the bundled demo model, offline."""
    from ..explain import load

    return load(model_dir(), device=device)
