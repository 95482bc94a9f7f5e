"""Train the bundled demo model: a tiny Mamba that reads the sentiment of a grammar sentence (``demo.grammar``).

``python -m mamba_captum.demo.train [--out DIR] [--steps N]`` writes a HF checkpoint directory (config, weights,
tokenizer, ``training.json``) that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(DIR)`` load offline.
The model is a causal LM: after the sentence the tokenizer appends ``[SENTIMENT]``, and the next-token logits there
at the words ``positive`` / ``negative`` are the classifier. Seeded; about a minute on one CPU core (400 steps).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers as tf

from ..evaluation.models import one_thread
from ..fast_scans import fast_scans
from . import grammar

QUERY = "[SENTIMENT]"
SPECIAL = ["[PAD]", "[UNK]", QUERY]
MAX_LENGTH = 64


def build_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A word-level tokenizer over the grammar's words: lower-cases, splits on spaces and punctuation, appends
    ``[SENTIMENT]``, pads on the left (the classifier reads the last position)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {word: index for index, word in enumerate(SPECIAL + grammar.words())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single=f"$A {QUERY}", special_tokens=[(QUERY, vocab[QUERY])])
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                      cls_token=QUERY, padding_side="left", model_max_length=MAX_LENGTH)


def demo_config(vocab_size: int) -> tf.MambaConfig:
    return tf.MambaConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, state_size=8, expand=2,
                          conv_kernel=4, time_step_rank=4, pad_token_id=0, bos_token_id=2, eos_token_id=2,
                          tie_word_embeddings=True, label_words=list(grammar.LABELS))


def label_token_ids(tokenizer) -> torch.Tensor:
    """Token ids of the label words, in label order (negative, positive)."""
    return torch.tensor(tokenizer.convert_tokens_to_ids(list(grammar.LABELS)))


def encode(tokenizer, sentences):
    return tokenizer([s.text for s in sentences], return_tensors="pt", padding=True)


def accuracy(model, tokenizer, sentences) -> float:
    batch = encode(tokenizer, sentences)
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits[:, -1, label_token_ids(tokenizer)]
    labels = torch.tensor([s.label for s in sentences])
    return float((logits.argmax(-1) == labels).float().mean())


def train(steps: int = 1500, batch: int = 64, lr: float = 3e-3, seed: int = 0, min_steps: int = 400, log=print):
    """Train from ``seed``; stops early at 100 % on 512 validation sentences after ``min_steps`` (more steps past
    the first 100 % sharpen the explanations: the model leans on fewer tokens). Returns (model, tokenizer, record)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = tf.MambaForCausalLM(demo_config(len(tokenizer)))
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    labels = label_token_ids(tokenizer)
    validation = grammar.sentences(512, seed=10_000 + seed)
    start = time.perf_counter()
    with one_thread(), fast_scans(model):  # one thread: the same weights on any machine
        for step in range(1, steps + 1):
            examples = grammar.sentences(batch, seed=seed * 1_000_003 + step)
            model.train()
            logits = model(**encode(tokenizer, examples), use_cache=False).logits[:, -1]
            target = labels[torch.tensor([s.label for s in examples])]
            loss = torch.nn.functional.cross_entropy(logits, target)
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            if step % 50 == 0:
                model.eval()
                valid = accuracy(model, tokenizer, validation)
                log(f"step {step} loss {loss.item():.4f} validation {valid:.4f}")
                if valid == 1.0 and step >= min_steps:
                    break
        seconds = time.perf_counter() - start
        model.eval()
        held = accuracy(model, tokenizer, grammar.sentences(2000, seed=20_000 + seed))
    record = dict(task="sentiment grammar with negation and 'but' (mamba_captum.demo.grammar)", seed=seed,
                  steps=step, train_seconds=round(seconds, 1), held_out_accuracy=held, held_out_examples=2000,
                  parameters=sum(p.numel() for p in model.parameters()))
    return model, tokenizer, record


def save(model, tokenizer, record, out: Path) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mamba_captum.demo.train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "model",
                        help="checkpoint directory (default: the package's bundled demo model)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-steps", type=int, default=400)
    args = parser.parse_args(argv)
    tf.logging.set_verbosity_error()
    model, tokenizer, record = train(steps=args.steps, seed=args.seed, min_steps=args.min_steps)
    print(json.dumps(record, indent=1))
    print("saved to", save(model, tokenizer, record, args.out))


if __name__ == "__main__":
    main()
