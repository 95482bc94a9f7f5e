"""Faithfulness evaluation (docs/faithfulness.md): metrics on plain tensors, planted-answer tasks, tiny trained
classifiers of every family, and the comparison with Captum's baselines.

    from mamba_captum.evaluation import metrics, make_task, load_classifier, evaluate
"""
from . import metrics
from .tasks import TASKS, ClassificationTask, bbc_news, make_task

__all__ = ["metrics", "TASKS", "ClassificationTask", "bbc_news", "make_task", "load_classifier", "train_classifier",
           "evaluate"]


def __getattr__(name):
    # models / compare import transformers and captum: loaded on first use only
    if name in ("load_classifier", "train_classifier"):
        from . import models
        return getattr(models, name)
    if name == "evaluate":
        from .compare import evaluate
        return evaluate
    raise AttributeError(name)
