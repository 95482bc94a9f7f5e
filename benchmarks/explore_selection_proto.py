"""Prototype: selection-aware attribution = value-path G plus the rest of each token's first-order effect
(grad x input at the mixer input minus the value path's column sums), distributed over rows."""
import torch
from mamba_captum import MambaAttribution
from mamba_captum.attr import _explain
from mamba_captum.attr._rollout import RunningProduct, layer_weights, rollout_step
from mamba_captum.evaluation.compare import _class_forward

_orig = _explain.Runner._gradients

def _gradients(explained, trace, queries, layers, residual_grads, operator_grads):
    # also d target / d mixer input, for every mixer call (prototype: one query)
    _, scores, targets = queries[0]
    picked = scores.gather(1, targets[:, None].to(scores.device)).sum()
    hs = [c.hidden_states for c in trace.mixer_calls]
    grads = torch.autograd.grad(picked, hs, retain_graph=True, allow_unused=True)
    for c, g in zip(trace.mixer_calls, grads):
        c.input_grads = None if g is None else g.detach()
        c.input_values = c.hidden_states.detach()
    return _orig(explained, trace, queries, layers, residual_grads, operator_grads)

_explain.Runner._gradients = staticmethod(_gradients)


class SelectionAttribution(MambaAttribution):
    def __init__(self, model, forward_func=None, spread="column", weight=1.0):
        super().__init__(model, forward_func)
        self.spread, self.weight = spread, weight

    def _relevance(self, explained, options):
        calls = {c.located.layer: c for c in explained.trace.mixer_calls}
        products = [RunningProduct() for _ in explained.queries]
        records = list(explained.layers())
        for n, record in enumerate(records):
            grads = record.operator_grads[0]
            G = record.operator.contributions(grads).float()  # (B, L, L) value path, summed over channels
            call = calls.get(record.key)
            if call is not None and getattr(call, "input_grads", None) is not None:
                total = (call.input_grads * call.input_values).sum(-1).float()  # (B, L)
                total = total * explained.mask
                rest = self.weight * (total - G.sum(1))  # (B, L): selection + skip share of each token
                if self.spread == "column":
                    w = G.abs()
                    norm = w.sum(1, keepdim=True)
                    eye = torch.eye(G.shape[-1])[None].expand_as(G)
                    w = torch.where(norm > 0, w / norm.clamp(min=1e-30), eye)
                    G = G + w * rest[:, None, :]
                elif self.spread == "diagonal":
                    G = G + torch.diag_embed(rest)
                elif self.spread == "query":
                    q = explained.queries[0].positions
                    G = G.clone(); G[torch.arange(G.shape[0]), q] += rest
            factor = G / record.operator.value_channels
            products[0].push(rollout_step(layer_weights(factor, options["sign"], options["normalise"])))
        return [q.row_of(p, explained.length) for q, p in zip(explained.queries, products)]


def _run(**kw):
    def run(model, task, explained):
        m = SelectionAttribution(model, forward_func=_class_forward(model, task, explained), **kw)
        return m.attribute(task.input_ids, target=task.labels).detach()
    return run

METHODS = {"Sel column": _run(spread="column"), "Sel diagonal": _run(spread="diagonal"),
           "Sel query": _run(spread="query")}
