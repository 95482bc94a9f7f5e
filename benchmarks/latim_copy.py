"""LaTIM's copy task (Pitorro & Treviso, ACL 2025): how well each method finds the copied source token.

    OMP_NUM_THREADS=1 python benchmarks/latim_copy.py [--family mamba mamba2] [--examples 64] [--copied 16]
    OMP_NUM_THREADS=1 python benchmarks/latim_copy.py --train [--family mamba]   # retrain, save the weights

Loads the shipped tiny copy models (``mamba_captum/evaluation/weights/<family>-copy/``; ``--train`` trains them
from a fixed seed on one CPU thread and saves them there), explains every query of held-out copy sequences
(``mamba_captum/evaluation/copy_task.py``) with each method and prints AUC / AP / R@K and seconds per model, beside
LaTIM's published numbers (their Table: Mamba-Attention, MambaLRP and their best LaTIM variant).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers as tf

from captum.attr import FeatureAblation, InputXGradient, Saliency

from mamba_captum import (MambaAttribution, MambaLaTIM, MambaLRP, MambaRawAttention, MambaRollout,
                          MambaSelectionAttribution)
from mamba_captum.evaluation.copy_task import alignment_scores, copy_examples, copy_loss_mask, vocab_size
from mamba_captum.evaluation.models import one_thread, weights_root
from mamba_captum.fast_scans import fast_scans

SYMBOLS = 16
MAX_COPIED = 16
# LaTIM's copy-task table (AUC, AP, R@K) for the methods it reports
PUBLISHED = {
    "mamba": {"Mamba-Attention": (0.84, 0.36, 0.22), "MambaLRP": (0.40, 0.22, 0.20),
              "LaTIM-ALTI": (0.86, 0.47, 0.36)},
    "mamba2": {"Mamba-Attention": (0.79, 0.49, 0.39), "LaTIM-l2": (0.98, 0.86, 0.74)},
}


def copy_config(family: str) -> tf.PretrainedConfig:
    """The tiny copy model of ``family``: width 64, two layers, state 16 (Mamba-2: 8 heads of 16)."""
    common = dict(vocab_size=vocab_size(SYMBOLS), hidden_size=64, num_hidden_layers=2, state_size=16, pad_token_id=0,
                  bos_token_id=2, eos_token_id=2, tie_word_embeddings=True, conv_kernel=4, expand=2)
    if family == "mamba":
        return tf.MambaConfig(time_step_rank=8, **common)
    if family == "mamba2":
        return tf.Mamba2Config(num_heads=8, head_dim=16, n_groups=1, chunk_size=16, **common)
    raise ValueError(f"unknown family {family!r}")


def copy_accuracy(model, examples) -> float:
    """The share of copied tokens predicted right (greedy next token at every query)."""
    with torch.no_grad():
        logits = model(examples.input_ids, use_cache=False).logits[:, examples.queries]
    return (logits.argmax(-1) == examples.input_ids[:, examples.sources]).double().mean().item()


def train(family: str, seed: int = 0, max_steps: int = 3000, batch: int = 64, lr: float = 3e-3, log=print):
    """Train the tiny ``family`` copy model: n ~ U[4, 16] symbols per batch (short copies are the curriculum),
    cross-entropy on the copied tokens, until 99% of held-out copies of 16 are right."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(copy_config(family))
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    validation = copy_examples(256, MAX_COPIED, SYMBOLS, torch.Generator().manual_seed(10_000 + seed))
    start, steps, accuracy = time.perf_counter(), 0, 0.0
    with one_thread(), fast_scans(model):
        for steps in range(1, max_steps + 1):
            copied = int(torch.randint(4, MAX_COPIED + 1, (1,), generator=generator))
            examples = copy_examples(batch, copied, SYMBOLS, generator)
            model.train()
            logits = model(examples.input_ids, use_cache=False).logits
            mask = copy_loss_mask(examples)
            next_tokens = examples.input_ids.roll(-1, dims=1)
            loss = torch.nn.functional.cross_entropy(logits[mask], next_tokens[mask])
            optimiser.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimiser.step()
            if steps % 100 == 0:
                model.eval()
                accuracy = copy_accuracy(model, validation)
                log(f"{family} step {steps} loss {loss.item():.4f} copy accuracy {accuracy:.3f} "
                    f"({time.perf_counter() - start:.0f} s)", flush=True)
                if accuracy >= 0.99:
                    break
    seconds = time.perf_counter() - start
    model.eval()
    test = copy_examples(512, MAX_COPIED, SYMBOLS, torch.Generator().manual_seed(20_000 + seed))
    record = dict(family=family, task="copy", seed=seed, steps=steps, train_seconds=round(seconds, 1),
                  held_out_accuracy=copy_accuracy(model, test), held_out_examples=512, copied_tokens=MAX_COPIED,
                  symbols=SYMBOLS, parameters=sum(p.numel() for p in model.parameters()))
    return model, record


def save(model, record) -> Path:
    path = weights_root() / f"{record['family']}-copy"
    model.save_pretrained(path)
    (path / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    return path


def load(family: str):
    path = weights_root() / f"{family}-copy"
    return tf.AutoModelForCausalLM.from_pretrained(path).eval(), json.loads((path / "training.json").read_text())


def per_query(method_class, **options):
    """A method explaining one query position at a time: (model, examples, k) -> (E, L) relevance."""
    def explain(model, examples, k):
        method = method_class(model)
        return method.attribute(examples.input_ids, target=examples.targets(k), position=int(examples.queries[k]),
                                **options)
    return explain


def latim_map(variant, start_layer=None):
    """MambaLaTIM's rolled-out map (from ``start_layer``), computed once per model and read at every query row."""
    cache = {}

    def explain(model, examples, k):
        key = (id(model), id(examples))
        if key not in cache:
            cache[key] = MambaLaTIM(model, variant=variant).attribute_map(examples.input_ids, start_layer=start_layer)
        return cache[key][:, int(examples.queries[k])]
    return explain


def latim_logit(model, examples, k, cache={}):
    """MambaLaTIM alti_logit: every query of the examples from one decomposition (attribute_positions)."""
    key = (id(model), id(examples))
    if key not in cache:
        queries = range(examples.copied)
        cache[key] = MambaLaTIM(model, variant="alti_logit").attribute_positions(
            examples.input_ids, [int(examples.queries[q]) for q in queries], [examples.targets(q) for q in queries])
    return cache[key][k]


def captum_method(kind):
    """Captum's Saliency / InputXGradient (summed over features, |·| for Saliency) and FeatureAblation (each token's
    embedding set to 0) on the input embeddings, explaining the target's logit at the query."""
    def explain(model, examples, k):
        position = int(examples.queries[k])
        embeddings = model.get_input_embeddings()(examples.input_ids).detach()
        forward = lambda embeds: model(inputs_embeds=embeds, use_cache=False).logits[:, position]
        target = examples.targets(k)
        if kind == "FeatureAblation":
            mask = torch.arange(examples.length)[None, :, None].expand_as(embeddings)
            with torch.no_grad():
                return FeatureAblation(forward).attribute(embeddings, target=target, feature_mask=mask)[..., 0]
        if kind == "Saliency":
            return Saliency(forward).attribute(embeddings, target=target, abs=True).sum(-1)
        return InputXGradient(forward).attribute(embeddings, target=target).sum(-1)
    return explain


METHODS = {
    "Raw attention (our Mamba-Attention)": per_query(MambaRawAttention),
    "Rollout": per_query(MambaRollout),
    "MambaAttribution": per_query(MambaAttribution),
    "MambaSelectionAttribution": per_query(MambaSelectionAttribution),
    "MambaLRP": per_query(MambaLRP),
    "MambaLaTIM alti": latim_map("alti"),
    "MambaLaTIM alti_logit": latim_logit,
    "MambaLaTIM l2": latim_map("l2"),
    "MambaLaTIM alti, last layer only": latim_map("alti", start_layer=-1),
    "MambaLaTIM l2, last layer only": latim_map("l2", start_layer=-1),
    "Saliency": captum_method("Saliency"),
    "InputXGradient": captum_method("InputXGradient"),
    "FeatureAblation": captum_method("FeatureAblation"),
}


def score_methods(model, examples, log=print):
    """One row per method: AUC, AP, R@K over every query of every example, and the seconds it took."""
    rows = []
    for name, explain in METHODS.items():
        start = time.perf_counter()
        scores, aligned = [], []
        with fast_scans(model):
            for k in range(examples.copied):
                relevance = explain(model, examples, k).detach().to(torch.float64)  # (E, L)
                scores.append(relevance[:, examples.source_span])
                aligned.append(torch.full((relevance.shape[0],), k))
        result = alignment_scores(torch.cat(scores), torch.cat(aligned))
        rows.append(dict(method=name, **result, seconds=round(time.perf_counter() - start, 1)))
        log(f"  {name:38s} AUC {result['auc']:.3f}  AP {result['ap']:.3f}  R@K {result['r_at_k']:.3f}  "
            f"{rows[-1]['seconds']:6.1f} s", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", default=["mamba", "mamba2"], choices=["mamba", "mamba2"])
    parser.add_argument("--train", action="store_true", help="train and save the copy models first")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--copied", type=int, default=MAX_COPIED)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for family in args.family:
        if args.train:
            model, record = train(family, args.seed, args.max_steps)
            print(json.dumps(record), "->", save(model, record), flush=True)
        model, record = load(family)
        examples = copy_examples(args.examples, args.copied, SYMBOLS, torch.Generator().manual_seed(30_000))
        print(f"\n{family}-copy: {record['parameters']} parameters, {record['steps']} steps, held-out copy accuracy "
              f"{record['held_out_accuracy']:.4f}; {args.examples} held-out sequences of {args.copied} symbols "
              f"(L = {examples.length}), {args.copied} queries each; accuracy on these "
              f"{copy_accuracy(model, examples):.4f}", flush=True)
        score_methods(model, examples)
        print("  LaTIM's published numbers (their models and data):")
        for name, (auc, ap, recall) in PUBLISHED[family].items():
            print(f"  {name:38s} AUC {auc:.2f}   AP {ap:.2f}   R@K {recall:.2f}")


if __name__ == "__main__":
    main()
