"""The faithfulness suite's shipped tiny classifiers (docs/faithfulness.md): every family × planted task loads with
``from_pretrained`` from ``mamba_captum/evaluation/weights/``, its training record matches it, a model scored by
the suite still solves held-out examples of the comparison's seed, and on ``needle`` our default
MambaAttribution (explaining the class log-probability) localises the key far above random."""
import pytest
import torch

import mamba_captum as mc
from mamba_captum.evaluation import compare, metrics
from mamba_captum.evaluation.models import FAMILIES, accuracy, load_classifier, one_thread, training_record
from mamba_captum.evaluation.report import ACCURACY_BAR
from mamba_captum.evaluation.tasks import TASKS

MODELS = [(family, task) for task in TASKS for family in FAMILIES]


@pytest.fixture(scope="module")
def held_out():
    return {task: compare.evaluation_task(task, examples=32) for task in TASKS}


@pytest.mark.parametrize("family,task", MODELS)
def test_the_shipped_classifier_loads_and_solves_its_task(family, task, held_out):
    record = training_record(family, task)
    assert (record["family"], record["task"], record["seed"]) == (family, task, 0)
    model, _ = load_classifier(family, task)
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    if record["held_out_accuracy"] < ACCURACY_BAR:
        pytest.skip(f"{family}/{task}: held-out accuracy {record['held_out_accuracy']:.1%}, listed and not scored")
    with one_thread():
        assert accuracy(model, held_out[task]) >= 0.9


@pytest.mark.parametrize("family", FAMILIES)
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
