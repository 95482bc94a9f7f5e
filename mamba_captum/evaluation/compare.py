"""The faithfulness comparison: our methods, their ablations and Captum's baselines on the tiny trained models.

``evaluate(families, tasks)`` returns one row per family × task × method with the localisation scores (planted
tasks), the perturbation scores (AUAC, AU-MSE, MoRF / LeRF deletion AUCs) and the method's wall time;
``python -m mamba_captum.evaluation`` (or ``mamba-captum evaluate``) writes them to ``docs/faithfulness.md``.

Every method explains the same number: the logit of the true class's label token at the final query token.
Captum's embedding methods (Saliency, InputXGradient, LayerIntegratedGradients) give one score per token as the
sum over the embedding features of their attribution (Captum's text convention); FeatureAblation replaces one
token at a time by ``[UNK]``. The query token is never scored and never replaced (it is the prompt, not evidence).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
from captum.attr import FeatureAblation, InputXGradient, LayerIntegratedGradients, Saliency

from .. import MambaAttribution, MambaLRP, MambaRawAttention, MambaRollout, MambaSelectionAttribution, fast_scans
from ..attr import SPREADS
from ..fla_cpu import fla_available, fla_on_cpu
from . import metrics
from .models import FAMILIES, class_logits, load_classifier, shipped
from .tasks import QUERY, TASKS, UNK, ClassificationTask, bbc_news, make_task

ALL_COMPONENTS = ("s6", "gate", "act", "conv", "norm")
# The parts of the unified operator each family has (the others are absent, so switching them off changes nothing).
FAMILY_COMPONENTS = {"mamba": ("gate", "act", "conv"), "mamba3": ("gate", "act", "conv"), "mamba2": ("gate", "act", "conv", "norm"),
                     "bamba": ("gate", "act", "conv", "norm"), "jamba": ("gate", "act", "conv"), "rwkv": ("gate",),
                     "recurrent_gemma": ("gate", "conv"), "qwen3_next": ("gate", "act", "conv", "norm"),
                     "lfm2": ("gate", "act", "conv"), "xlstm": ("gate", "norm"),
                     # fla's tiny models have no short convs: their unified operators are gate · norm · core
                     "gla": ("gate", "norm"), "retnet": ("gate", "norm"), "rwkv7": ("gate", "norm")}
# Families whose operator has no core for "s6" to switch (LFM2's short conv: the band is the conv itself).
CORELESS = ("lfm2",)
# Families whose adapters have no MambaLRP rules yet (mamba_captum.families.fla_rwkv7: LRP_UNSUPPORTED)
NO_LRP = ("rwkv7",)
ABLATIONS = {"w/o act": ("act",), "w/o gate": ("gate",), "w/o conv": ("conv",), "w/o S6": ("s6",),
             "only S6": ("gate", "act", "conv", "norm")}


@dataclass
class Method:
    """A relevance method: ``run(model, task) -> (B, L)`` relevance of every token for the true class."""

    name: str
    group: str  # "ours", "ablation", "captum", "random"
    run: Callable
    note: str = ""


def _ours(cls, **options):
    def run(model, task, explained):
        method = cls(model, forward_func=_class_forward(model, task, explained))
        return method.attribute(task.input_ids, target=task.labels, **options).detach()
    return run


def implicit_methods(family: str, gradient_rules=("grad_x_operator", "residual"), ablation_rule="grad_x_operator",
                     **attribution_options) -> list[Method]:
    """Our methods on ``family``: Raw attention, Rollout, Attribution × {hidden, unified} × gradient rules, the
    papers' official recipe, Selection attribution (unified) × spreads, MambaLRP, and the unified ablations (of
    Attribution with ``ablation_rule``)."""
    # the default, as a user calls it: MambaAttribution(model).attribute(ids, target=c) (recipe="auto")
    methods = [Method("Attribution (default)", "ours", _ours(MambaAttribution))]
    for formulation in ("unified", "hidden"):
        methods.append(Method(f"Raw attention ({formulation})", "ours",
                              _ours(MambaRawAttention, formulation=formulation)))
        methods.append(Method(f"Rollout ({formulation})", "ours", _ours(MambaRollout, formulation=formulation)))
        for rule in gradient_rules:
            methods.append(Method(f"Attribution ({formulation}, {rule})", "ours",
                                  _ours(MambaAttribution, formulation=formulation, gradient_rule=rule,
                                        recipe="product", **attribution_options)))
            methods.append(Method(f"Attribution ({formulation}, {rule}, G₊ unnormalised)", "ours",
                                  _ours(MambaAttribution, formulation=formulation, gradient_rule=rule,
                                        recipe="product", sign="positive", normalise="none")))
        methods.append(Method(f"Attribution ({formulation}, official recipe)", "ours",
                              _ours(MambaAttribution, formulation=formulation, recipe="official")))
        if formulation == "unified":
            for spread in SPREADS:
                methods.append(Method(f"Selection attribution ({formulation}, {spread})", "ours",
                                      _ours(MambaSelectionAttribution, formulation=formulation, spread=spread)))
    # MambaLRP has no formulation: it differentiates the model itself under its rules
    if family not in NO_LRP:
        methods.append(Method("MambaLRP", "ours", _ours(MambaLRP)))
    present = set(FAMILY_COMPONENTS[family]) | (set() if family in CORELESS else {"s6"})
    for label, removed in ABLATIONS.items():
        # an ablation of a part the family lacks would repeat the full operator; one that keeps none of the
        # family's parts (LFM2's "only S6") would leave no operator
        if set(removed) & present and present - set(removed):
            kept = tuple(name for name in ALL_COMPONENTS if name not in removed)
            methods.append(Method(f"Attribution (unified, {ablation_rule}, {label})", "ablation",
                                  _ours(MambaAttribution, formulation="unified", gradient_rule=ablation_rule,
                                        components=kept, recipe="product", **attribution_options)))
    return methods


EXPLAINED = ("log_prob", "logit")


def _explained(logits, explained):
    return logits.log_softmax(-1) if explained == "log_prob" else logits


def _class_forward(model, task, explained="logit"):
    """ids (B, L) -> (B, K): the class logits at the query, or their log-softmax over the K label tokens."""
    def forward(input_ids):
        return _explained(class_logits(model, input_ids, task.label_token_ids), explained)
    return forward


def _embedding_forward(model, task, explained):
    def forward(embeddings):
        logits = model(inputs_embeds=embeddings, use_cache=False).logits[:, -1, task.label_token_ids]
        return _explained(logits, explained)
    return forward


def _embeddings(model, task):
    return model.get_input_embeddings()(task.input_ids).detach().requires_grad_()


def _saliency(model, task, explained):
    forward = _embedding_forward(model, task, explained)
    return Saliency(forward).attribute(_embeddings(model, task), target=task.labels).sum(-1)


def _input_x_gradient(model, task, explained):
    forward = _embedding_forward(model, task, explained)
    return InputXGradient(forward).attribute(_embeddings(model, task), target=task.labels).sum(-1)


def _integrated_gradients(model, task, explained, steps=50, internal_batch_size=512):
    baseline = torch.full_like(task.input_ids, UNK)
    baseline[:, -1] = task.input_ids[:, -1]  # the query token stays: the path changes the evidence only
    method = LayerIntegratedGradients(_class_forward(model, task, explained), model.get_input_embeddings())
    scores = method.attribute(task.input_ids, baselines=baseline, target=task.labels, n_steps=steps,
                              internal_batch_size=internal_batch_size)
    return scores.sum(-1)


def _feature_ablation(model, task, explained):
    method = FeatureAblation(_class_forward(model, task, explained))
    return method.attribute(task.input_ids, baselines=UNK, target=task.labels, perturbations_per_eval=16)


def _random(seed):
    def run(model, task, explained):
        return metrics.random_relevance(tuple(task.input_ids.shape), torch.Generator().manual_seed(seed))
    return run


def captum_methods(seed: int = 0) -> list[Method]:
    """Captum's baselines on the same model, and random relevance."""
    return [Method("Saliency", "captum", _saliency, "|∂logit/∂embedding| summed over features"),
            Method("InputXGradient", "captum", _input_x_gradient, "embedding · gradient, summed"),
            Method("LayerIntegratedGradients (50 steps)", "captum", _integrated_gradients,
                   "on the input embeddings, baseline [UNK] (query kept)"),
            Method("FeatureAblation", "captum", _feature_ablation, "one token at a time → [UNK]"),
            Method("Random", "random", _random(seed))]


def score(model, task: ClassificationTask, relevance: torch.Tensor, perturbation: bool = True) -> dict:
    """Localisation (when the task has truth) and perturbation scores of ``relevance`` (B, L) on ``task``."""
    relevance = relevance.detach().float()
    fixed = torch.zeros_like(task.relevant)
    fixed[:, -1] = True  # the query token: not evidence, never replaced
    row = {}
    if task.has_truth:
        for name, values in metrics.localisation_scores(relevance, task.relevant, exclude=fixed).items():
            row[name] = float(torch.nanmean(values))
    if perturbation:
        forward = _class_forward(model, task, "logit")
        common = dict(fixed=fixed, batch_size=256)
        activation = metrics.activation_curve(forward, task.input_ids, relevance, task.labels, UNK, **common)
        pruning = metrics.pruning_curve(forward, task.input_ids, relevance, task.labels, UNK, **common)
        morf = metrics.deletion_curve(forward, task.input_ids, relevance, task.labels, UNK,
                                      most_relevant_first=True, **common)
        lerf = metrics.deletion_curve(forward, task.input_ids, relevance, task.labels, UNK,
                                      most_relevant_first=False, **common)
        row.update(auac=float(metrics.auac(activation)), au_mse=float(metrics.au_mse(pruning)),
                   morf_auc=float(metrics.deletion_auc(morf)), lerf_auc=float(metrics.deletion_auc(lerf)),
                   curves=dict(activation=activation.tolist(), pruning=pruning.tolist(), morf=morf.tolist(),
                               lerf=lerf.tolist()))
    return row


def evaluation_task(task_name: str, examples: int = 64, seed: int = 30_000) -> ClassificationTask:
    """The held-out examples every method is scored on (a seed no model was trained or validated on)."""
    if task_name == "bbc_news":
        return bbc_news()[1].subset(slice(0, examples))
    return make_task(task_name, examples, seed=seed)


def evaluate_model(model, task: ClassificationTask, methods, family: str = "", perturbation: bool = True,
                   explained: str = "log_prob", log=None) -> list[dict]:
    """Score every method on one model and task: a list of rows (dicts)."""
    rows = []
    for method in methods:
        # fast_scans: Captum's baselines and the perturbation forwards get the same linear-in-L Mamba-1 scan
        # our methods use (HF's CPU path loops over tokens in Python); the numbers agree to float rounding.
        # fla_on_cpu: with flash-linear-attention installed, transformers' gated delta-net calls its Triton kernels,
        # CPU tensors included; the baselines' and the perturbation metrics' forwards take the torch bodies, as the
        # library's own forwards do
        with fast_scans(model), (fla_on_cpu(model) if fla_available() else contextlib.nullcontext()):
            start = time.perf_counter()
            relevance = method.run(model, task, explained)
            seconds = time.perf_counter() - start
            if relevance.shape != task.input_ids.shape:
                raise RuntimeError(f"{method.name} returned {tuple(relevance.shape)}, "
                                   f"not {tuple(task.input_ids.shape)}")
            # the ablations are compared by localisation only (they exist to rank the operator's parts)
            scores = score(model, task, relevance, perturbation and method.group != "ablation")
        row = dict(family=family, task=task.name, method=method.name, group=method.group,
                   seconds=round(seconds, 3), **scores)
        rows.append(row)
        if log:
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "curves"}
            log(shown)
    return rows


def evaluate(families=FAMILIES, tasks=TASKS, methods: Callable | None = None, examples: int = 64,
             perturbation: bool = True, explained: str = "log_prob", weights_root=None, pairs=None,
             log=None) -> list[dict]:
    """Run the comparison over the shipped tiny classifiers.

    Args:
        families, tasks: which models (``bbc_news`` is trained for ``mamba`` only).
        methods: ``methods(family) -> list[Method]``; default our methods, their ablations and Captum's baselines.
        examples: held-out examples per task.
        perturbation: also compute AUAC, AU-MSE and the deletion AUCs (slower).
        explained: the number every method explains: ``"log_prob"`` (log-softmax of the true class over the K label
            tokens) or ``"logit"`` (its raw next-token logit, which a tiny LM can lower for the true class while it
            lowers the other classes' more).
        pairs: explicit (family, task) pairs instead of ``families`` × ``tasks``.
    Returns:
        one dict per family × task × method (plus the model's held-out accuracy).
    """
    methods = methods or (lambda family: implicit_methods(family) + captum_methods())
    if pairs is None:
        pairs = [(f, t) for t in tasks for f in families if shipped(f, t)]
    rows, held_out = [], {}
    for family, task_name in pairs:
        if task_name not in held_out:
            held_out[task_name] = evaluation_task(task_name, examples)
        model, record = load_classifier(family, task_name, weights_root)
        for row in evaluate_model(model, held_out[task_name], methods(family), family, perturbation, explained,
                                  log):
            row["held_out_accuracy"] = record["held_out_accuracy"]
            rows.append(row)
    return rows


__all__ = ["Method", "implicit_methods", "captum_methods", "score", "evaluate", "evaluate_model",
           "evaluation_task", "QUERY"]
