"""How well each method finds the deciding words of the bundled demo model (the grammar knows them: the deciding
clause's adjective and its negator), with the faithfulness suite's scoring (localisation; query token excluded).

    python benchmarks/demo_faithfulness.py [--sentences 256]

Sentences are grouped by token length (no padding), every method explains the true label's log-probability over
the two label words, as in docs/faithfulness.md.
"""
import argparse
import collections
import time

import torch
import transformers as tf

from mamba_captum.demo import grammar, load_demo
from mamba_captum.demo.train import label_token_ids
from mamba_captum.evaluation.compare import captum_methods, implicit_methods, score
from mamba_captum.evaluation.tasks import ClassificationTask
from mamba_captum.fast_scans import fast_scans

KEEP = {"Attribution (default)", "Raw attention (unified)", "Rollout (unified)", "Attribution (unified, grad_x_operator)",
        "Attribution (hidden, grad_x_operator)", "Attribution (unified, official recipe)",
        "Selection attribution (unified, query)", "Selection attribution (unified, column)",
        "Selection attribution (unified, exact)", "MambaLRP"}


def tasks(tokenizer, count, seed):
    groups = collections.defaultdict(list)
    for sentence in grammar.sentences(count, seed):
        groups[len(sentence.words) + 1].append(sentence)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    for length, sentences in sorted(groups.items()):
        ids = tokenizer([s.text for s in sentences], return_tensors="pt")["input_ids"]
        assert ids.shape[1] == length  # one token per word, plus [SENTIMENT]
        relevant = torch.tensor([s.deciding + [False] for s in sentences])
        yield ClassificationTask("demo", vocab, ids, torch.tensor([s.label for s in sentences]), relevant,
                                 label_token_ids(tokenizer))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=256)
    args = parser.parse_args()
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    model, tokenizer = load_demo()
    methods = [m for m in implicit_methods("mamba") if m.name in KEEP] + captum_methods()
    totals = collections.defaultdict(lambda: collections.defaultdict(float))
    with fast_scans(model):
        for task in tasks(tokenizer, args.sentences, seed=40_000):
            weight = len(task.labels)
            for method in methods:
                start = time.perf_counter()
                relevance = method.run(model, task, "log_prob")
                totals[method.name]["seconds"] += time.perf_counter() - start
                for name, value in score(model, task, relevance, perturbation=False).items():
                    totals[method.name][name] += value * weight
                totals[method.name]["count"] += weight
    print(f"demo model, {args.sentences} grammar sentences (seed 40000): localisation of the deciding words")
    print(f"{'method':45s} {'ROC-AUC':>8s} {'P@k':>6s} {'mass':>6s} {'seconds':>8s}")
    for name, row in totals.items():
        n = row["count"]
        print(f"{name:45s} {row['roc_auc'] / n:8.3f} {row['precision_at_k'] / n:6.3f} "
              f"{row['relevance_mass'] / n:6.3f} {row['seconds']:8.1f}")


if __name__ == "__main__":
    main()
