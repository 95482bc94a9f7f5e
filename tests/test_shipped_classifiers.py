"""The faithfulness suite's shipped tiny classifiers (docs/faithfulness.md): every family × planted task loads with
``from_pretrained`` from ``mamba_captum/evaluation/weights/``, its training record matches it, every model outside
the documented below-the-bar list reached the bar and still solves held-out examples of the comparison's seed,
exactly the documented models are below the bar and left out of the scoring (results.json, the report's table),
and on ``needle`` our default MambaAttribution (explaining the class log-probability) localises the key far above
random."""
import json
from pathlib import Path

import pytest
import torch

import mamba_captum as mc
from mamba_captum.evaluation import compare, metrics
from mamba_captum.evaluation.models import (FAMILIES, accuracy, load_classifier, one_thread, shipped,
                                            training_record)
from mamba_captum.evaluation.report import ACCURACY_BAR, BEGIN, END, available_models
from mamba_captum.evaluation.tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
MODELS = [(family, task) for task in TASKS for family in FAMILIES if shipped(family, task)]
# The shipped classifiers that miss ACCURACY_BAR on held-out examples: listed in docs/faithfulness.md and not scored
# (no model that solves the task, no ground truth to localise). Each with its reason; the test below fails when a
# model joins or leaves this list without the list (and the docs) saying so.
BELOW_BAR: dict = {}
SOLVED = [model for model in MODELS if model not in BELOW_BAR]


@pytest.fixture(scope="module")
def held_out():
    return {task: compare.evaluation_task(task, examples=32) for task in TASKS}


@pytest.mark.parametrize("family,task", MODELS)
def test_the_shipped_classifier_loads_with_its_record(family, task):
    record = training_record(family, task)
    assert (record["family"], record["task"], record["seed"]) == (family, task, 0)
    model, _ = load_classifier(family, task)
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]


@pytest.mark.parametrize("family,task", SOLVED)
def test_the_shipped_classifier_solves_its_task(family, task, held_out):
    model, record = load_classifier(family, task)
    assert record["held_out_accuracy"] >= ACCURACY_BAR, record
    with one_thread():
        assert accuracy(model, held_out[task]) >= 0.9


def test_exactly_the_documented_models_are_below_the_bar_and_not_scored():
    below = {(f, t) for f, t in MODELS if training_record(f, t)["held_out_accuracy"] < ACCURACY_BAR}
    assert below == set(BELOW_BAR)
    usable, skipped = available_models(FAMILIES, TASKS)
    assert {(f, t) for f, t, _ in usable} == set(SOLVED)
    assert {(f, t) for f, t, _ in skipped} == set(BELOW_BAR)
    assert all(reason.startswith("held-out accuracy") for _, _, reason in skipped)
    # the committed comparison scores exactly the models that solve their task, and its table lists the others
    rows = json.loads((ROOT / "docs/assets/faithfulness/results.json").read_text())["rows"]
    assert {(r["family"], r["task"]) for r in rows if r["task"] in TASKS} == set(SOLVED)
    generated = (ROOT / "docs/faithfulness.md").read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    listed = {tuple(cell.strip() for cell in line.split("|")[1:3]) for line in generated.splitlines()
              if "| not scored:" in line}
    assert listed == set(BELOW_BAR)


@pytest.mark.parametrize("family", [f for f in FAMILIES if shipped(f, "needle")])
def test_the_needle_is_localised_on_every_shipped_family(family, held_out):
    model, _ = load_classifier(family, "needle")
    task = held_out["needle"]
    forward = compare._class_forward(model, task, "log_prob")
    with one_thread():
        relevance = mc.MambaAttribution(model, forward_func=forward).attribute(task.input_ids, target=task.labels)
    fixed = torch.zeros_like(task.relevant)
    fixed[:, -1] = True
    roc = torch.nanmean(metrics.localisation_scores(relevance, task.relevant, exclude=fixed)["roc_auc"]).item()
    assert roc >= 0.9, f"{family}: needle ROC-AUC {roc:.3f}"
