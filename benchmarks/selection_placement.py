"""How far the approximate placements of the selection share (spread="query", "column") are from the exact one
(spread="exact": one batched backward per row), on the faithfulness suite's trained models.

    python benchmarks/selection_placement.py [--families ...] [--tasks ...] [--examples 64]

Per model: the mean over examples of the relative L1 distance ‖r − r_exact‖₁ / ‖r_exact‖₁ between the relevance
rows (each a rollout row, summing to 1 over the tokens), their Spearman rank correlation, and the localisation
ROC-AUC of each spread, with the wall times.
"""
import argparse
import time

import torch
import transformers as tf

import mamba_captum as mc
from mamba_captum.evaluation.compare import evaluation_task, score
from mamba_captum.evaluation.models import FAMILIES, class_logits, load_classifier, shipped
from mamba_captum.evaluation.tasks import TASKS


def ranks(x):
    return x.argsort(-1).argsort(-1).double()


def spearman(a, b):
    a, b = ranks(a), ranks(b)
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--tasks", nargs="+", default=[t for t in TASKS if t != "long_range"])
    parser.add_argument("--examples", type=int, default=64)
    args = parser.parse_args()
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    print("| model | spread | L1 distance to exact | Spearman with exact | ROC-AUC | seconds |")
    print("|---|---|---|---|---|---|")
    totals = {}
    for task_name in args.tasks:
        task = evaluation_task(task_name, args.examples)
        for family in args.families:
            if not shipped(family, task_name):
                continue
            model, _ = load_classifier(family, task_name)

            def forward(ids):
                return class_logits(model, ids, task.label_token_ids).log_softmax(-1)

            method = mc.MambaSelectionAttribution(model, forward_func=forward)
            rows = {}
            with mc.fast_scans(model):
                for spread in ("exact", "query", "column"):
                    start = time.perf_counter()
                    relevance = method.attribute(task.input_ids, target=task.labels, spread=spread).double()
                    rows[spread] = (relevance, time.perf_counter() - start)
            exact = rows["exact"][0][:, :-1]  # the query token is not evidence
            for spread, (relevance, seconds) in rows.items():
                relevance_ = relevance[:, :-1]
                distance = float(((relevance_ - exact).abs().sum(-1) / exact.abs().sum(-1).clamp_min(1e-30)).mean())
                rank = float(spearman(relevance_, exact).mean())
                auc = score(model, task, relevance, perturbation=False)["roc_auc"]
                totals.setdefault(spread, []).append((distance, rank, auc, seconds))
                print(f"| {family} {task_name} | {spread} | {distance:.3f} | {rank:.3f} | {auc:.3f} | {seconds:.1f} |",
                      flush=True)
    print("\n| spread | models | mean L1 distance to exact | mean Spearman | mean ROC-AUC | seconds (sum) |")
    print("|---|---|---|---|---|---|")
    for spread, values in totals.items():
        n = len(values)
        print(f"| {spread} | {n} | {sum(v[0] for v in values) / n:.3f} | {sum(v[1] for v in values) / n:.3f} | "
              f"{sum(v[2] for v in values) / n:.3f} | {sum(v[3] for v in values):.0f} |")


if __name__ == "__main__":
    main()
