"""MambaLRP: conservative layer-wise relevance propagation (Rezaei Jafari et al., NeurIPS 2024).

    R[b, t] = Σ_d E[b, t, d] · ∂ f̃_target / ∂ E[b, t, d],

E the input embeddings and f̃ the model's forward with the LRP rules (:mod:`mamba_captum.rules`): the token mixers'
data-dependent factors detached (Mamba's Δ, B, C; RWKV's normaliser; softmax probabilities; ...), the norms'
normalisers detached, SiLU / sigmoid / GELU by the identity rule, multiplicative gates by the half rule. f̃ has the
model's value and is linear in the embeddings and the biases, so Σ_t R[b, t] = logit − (the biases' share)
(``return_convergence_delta=True`` gives that difference). Per family: docs/methods/lrp.md.

Every call checks that identity at run time, from its own backward pass
(:class:`mamba_captum.conservation.ConservationLedger`): per replaced module and per example, relevance out − relevance
in = the share of the biases it reads, and over the whole model Σ relevance + the biases' share = the explained score;
beyond the dtype's tolerance (:data:`mamba_captum.conservation.CONSERVATION_TOLERANCE`) it raises
:class:`ConservationError` instead of returning.
"""
from __future__ import annotations

import inspect
import warnings

import torch
from captum.attr import GradientAttribution
from captum.log import log_usage

from .. import checks, families, rules
from ..attention import ReconstructionError
from ..checks import check_finite, check_forward_devices, check_inputs, unwrap_parallel
from ..conservation import ConservationGap, requiring_grad, rule_biases
from ..families.lrp_plan import lrp_plan
from ..fast_scans import fast_scans
from ..lrp_forward import LRPForward
from ..offload import is_dispatched
from ..session import session
from ._gradient import scaled_grad
from ._inputs import check_forward_func_inputs, format_inputs, format_mask, format_positions, format_targets
from ._runner import Runner


class ConservationError(ReconstructionError):
    """MambaLRP's relevance is not conserved: through one replaced module (relevance out − relevance in − the share
    of its biases), or over the whole model (Σ relevance + the biases' share − the explained score as it enters the
    model's output head), beyond the dtype's tolerance (:data:`mamba_captum.conservation.CONSERVATION_TOLERANCE`). The
    relevance is not returned."""


def _conservation_error(gap: ConservationGap, dtype, failing: int) -> ConservationError:
    """The error for the first failed comparison (``failing``: how many failed in all)."""
    per = "over the batch" if gap.example is None else f"for example {gap.example}"
    others = f" ({failing - 1} other comparison{'s' if failing > 2 else ''} failed too)" if failing > 1 else ""
    scale = "the largest of these terms" if gap.where == "the whole model" else "the relevance through it"
    measured = (f"{gap.gap:.3g} {per}, {gap.relative:.3g} relative to {scale} ({gap.scale:.3g}), above the "
                f"{str(dtype).replace('torch.', '')} tolerance {gap.tolerance:g}{others}")
    if gap.where == "the whole model":
        return ConservationError(
            "mamba_captum: MambaLRP's relevance is not conserved over the whole model: Σ relevance + the biases' share "
            f"− the explained score (as it enters the model's output head) = {measured}. Every module with a rule "
            "conserved, so a step between them is not linear: a module the library reads as linear whose forward "
            "changed (a newer transformers release), a forward hook that changes an output non-linearly, or a "
            "non-linear step of a forward_func before the model's head (after it, a forward_func is differentiated as "
            "it is). Please report the model class, its config and the transformers version.")
    return ConservationError(
        f"mamba_captum: MambaLRP's relevance is not conserved through {gap.where}: relevance out − relevance in − its "
        f"biases' share = {measured}. Its rule no longer matches what the module "
        "computes (a transformers release that changed the module, or a step of its rule run in a lower precision); "
        "the relevance is not returned. Please report the model class, its config and the transformers version.")


def _drops(module) -> bool:
    """Whether the module drops activations at random (in train() mode): dropout, or attention dropout."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    return bool(getattr(module, "attention_dropout", 0))


class MambaLRP(GradientAttribution):
    """MambaLRP: gradient × input of the model's forward under conservative LRP rules.

    ``MambaLRP(model).attribute(input_ids, target=c)`` -> (B, L) token relevance, which sums to the explained logit
    less what the rules leave to the biases. See :meth:`attribute` and ``docs/methods/lrp.md``.

    Args:
        model: a transformers model whose layers all have MambaLRP rules (docs/methods/lrp.md lists them; any
            other raises ``NotImplementedError`` naming the module), unchanged.
        forward_func: optional ``forward_func(inputs, *additional_forward_args, attention_mask=..., **kwargs)``
            returning (B, K) scores, for base models with a custom head. Its own operations are differentiated as
            they are (LRP-0, exact for a linear head).
    """

    def __init__(self, model, forward_func=None):
        model = unwrap_parallel(model)
        GradientAttribution.__init__(self, forward_func if forward_func is not None else model)
        self.model = model
        self._runner = Runner(model, forward_func)
        if self._runner.packed:
            raise NotImplementedError("mamba_captum: MambaLRP explains token models and Vision Mamba; vision towers "
                                      "over packed patches are not covered yet.")
        lrp_plan(model, self._runner.mixers)  # NotImplementedError now for a model without rules

    # -- Captum's capability flags and protocol ------------------------------------------------------------------
    @property
    def multiplies_by_inputs(self) -> bool:
        return True

    def has_convergence_delta(self) -> bool:
        return True

    def attribute_future(self, *args, **kwargs):
        raise NotImplementedError(f"attribute_future is not implemented for {type(self).__name__}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._runner.close()
        return False

    @log_usage()  # Captum's wrapper: NoiseTunnel calls attribute.__wrapped__
    def attribute(self, inputs, target=None, additional_forward_args=None, *, attention_mask=None, position=None,
                  sigmoid_gates="signal", return_convergence_delta=False, **forward_kwargs):
        """Relevance of every input token for the explained output, by MambaLRP's rules.

        Args:
            inputs: token ids (B, L), or embeddings (B, L, D) (passed as ``inputs_embeds``), or Vision Mamba's pixels
                (B, C, H, W), or a 1-tuple of any. A vision-language model takes its images as keywords
                (``pixel_values=``, ...): each image-placeholder token gets its image features' relevance.
            target: the explained class: int, a 1-tuple, one per example (list or 1-D tensor), or None (argmax).
            additional_forward_args: a dict of keywords for the model, or a tuple of positional arguments after
                the inputs (token-id inputs or ``forward_func`` only).
            attention_mask: (B, L), 1 for real tokens; left or right padding (right only for the families whose
                mixers ignore the mask, as everywhere in the library).
            position: the query token (causal LM or ``forward_func``): int, one per example, or None for the last
                real token. A sequence-classification head always explains its pooled token.
            sigmoid_gates: the rule of sigmoid gates ``σ(r) ⊙ v`` (RWKV's receptance): ``"signal"`` (default: σ(r)
                detached, all relevance to v, as LRP does for LSTM gates) or ``"half"`` (the half rule, σ by the
                identity rule; its ratio σ(r)/r is unbounded near 0, so r's inputs get large cancelling relevances).
                SiLU and GELU gates always take the half rule (their ratios are bounded). Both conserve.
            return_convergence_delta: also return, per example, ``Σ relevance − explained score`` (Captum's LRP
                convention): minus the share the rules leave to the biases; 0 up to rounding for a model without
                biases.
            **forward_kwargs: passed to the model's forward (e.g. ``position_ids``).

        Returns:
            (B, L) for token ids: Σ_d E · ∂score/∂E over each token's embedding; (B, L, D) for embeddings: the
            per-feature gradient × input (it sums over D to the token relevance); (B, 1, H, W) for pixels: each
            pixel's gradient × input summed over its channels; a 1-tuple when ``inputs`` was a tuple; with
            ``return_convergence_delta``, ``(attributions, delta)``, delta (B,).

        Raises:
            ConservationError: the relevance is not conserved through a module (naming it) or over the whole model,
                beyond the dtype's tolerance (the measured gap and the tolerance in the message): a rule that no
                longer matches its module, or a step read as linear that is not. Nothing is returned.
            ReconstructionError: a module's rule does not give the module's real output.
        """
        inputs_tensor, was_tuple = format_inputs(inputs, self._runner.image_model)
        with rules.sigmoid_gates(sigmoid_gates):
            relevance, delta = self._relevance_and_gap(inputs_tensor, target, additional_forward_args, attention_mask, position,
                                             forward_kwargs)
        out = (relevance,) if was_tuple else relevance
        return (out, delta) if return_convergence_delta else out

    def _relevance_and_gap(self, inputs, target, additional_forward_args, attention_mask, position, forward_kwargs,
                           parameters=None, measured=None):
        """(relevance, delta); with ``parameters`` (tensors that require grad, e.g. the biases) also
        Σ_p ⟨∂ Σ_b score_b / ∂p, p⟩ under the rules, their share of the explained scores (the tests' bias share).

        The conservation guard (:class:`mamba_captum.conservation.ConservationLedger`) compares, from the same
        backward pass, every replaced module's relevance in and out and the whole model's sum with the explained
        score, and raises :class:`ConservationError` beyond the dtype's tolerance; given a list as ``measured``, it
        appends the comparisons (:class:`mamba_captum.conservation.ConservationGap`) there instead of raising (the
        benchmark's figures).
        """
        runner = self._runner
        runner.refresh()
        plan = lrp_plan(self.model, runner.mixers)
        random = [name for name, module in self.model.named_modules() if module.training and _drops(module)]
        if random:
            raise ValueError(f"mamba_captum: {random[0]} drops activations at random in train() mode; the rules "
                             "recompute the layers, which would draw other masks. Explain the model in eval() mode.")
        if torch.is_inference_mode_enabled():
            raise RuntimeError("mamba_captum: MambaLRP takes gradients, which torch.inference_mode() forbids; call "
                               "it outside inference_mode (the library switches gradients on for its own forward).")
        names = [n for n in inspect.signature(self.attribute).parameters if n != "forward_kwargs"]
        model_dtype = checks.model_dtype(self.model)
        work_dtype = torch.float64 if model_dtype == torch.float64 else torch.float32
        with session(self.model, runner.decoder_layers, runner.forward_func):
            args, kwargs, attention_mask = runner._arguments(inputs, attention_mask, additional_forward_args,
                                                             forward_kwargs, names, "MambaLRP.attribute")
            image = runner.layout is not None  # pixels (B, C, H, W) in: the relevance of each pixel
            if image:  # the pixels checked, the tokens' mask (all real) and the query (the CLS row or the mean)
                mask, positions = runner._image_query(inputs, attention_mask, position)
                if runner.forward_func is None:
                    check_forward_devices(kwargs, inputs.device, self.model)
            else:
                if runner.forward_func is None:
                    check_inputs(self.model, None if inputs.is_floating_point() else inputs,
                                 inputs if inputs.is_floating_point() else None)
                    check_forward_devices(kwargs, inputs.device, self.model)
                else:  # the same checks, but for the device and the width, which a forward_func may change
                    check_forward_func_inputs(self.model, inputs)
                mask = format_mask(attention_mask, inputs)
                if position is not None and runner.is_classifier:
                    raise ValueError("mamba_captum: position= does not apply to a sequence-classification head, "
                                     "which explains its pooled (last non-pad) token.")
                positions = format_positions(position, mask)
            families.check_forward(runner.mixers, attention_mask, kwargs)
            floating = inputs.is_floating_point()
            call_inputs = inputs.detach().requires_grad_(True) if floating else inputs
            embeddings = None if floating else self.model.get_input_embeddings()
            forward = LRPForward(plan, embeddings, mask, work_dtype, model_dtype, self.model)
            runner._active.add(forward)
            requested = list(parameters or ())
            # the rules' biases require grad for the call (restored after): the guard reads their shares from their
            # gradients. Not an offloaded module's (meta at rest): accelerate swaps its placeholders, which would keep
            # the flag; a dispatched model's resident weights (no offloading) stay in place and are set like any other
            offloading = is_dispatched(self.model)
            biases = [p for p in rule_biases(plan) + forward.ledger.outside_biases if not (offloading and p.is_meta)]
            try:
                with torch.enable_grad(), fast_scans(self.model), requiring_grad(biases), forward:
                    output = runner._call(call_inputs, args, kwargs, attention_mask)
                    scores, positions = runner._scores(output, inputs, positions, mask, attention_mask)
                    if scores is None:
                        raise TypeError(f"mamba_captum: {type(self.model).__name__} returns no logits; pass "
                                        "forward_func= returning (B, K) scores (e.g. a head on the last hidden state).")
                    check_finite(scores.detach(), "the explained scores (the model's output logits)", self.model)
                    targets = format_targets(target, scores.detach())
                    picked = scores.gather(1, targets[:, None].to(scores.device))[:, 0]
                    self._check_covered(forward, plan)
                    leaf = self._leaf(forward, call_inputs, floating)
                    if not picked.requires_grad:
                        raise RuntimeError("mamba_captum: the explained scores carry no autograd graph (a forward_func "
                                           "that detaches them, or runs the model under torch.no_grad).")
                    # the guard's biases (those the rules read) join the same backward: a sum over (B, L) per bias,
                    # no extra pass. A float16 backward is loss-scaled (one more backward, as for the gradient
                    # methods): unscaled, the gradients below float16's range flush to zero and their relevance is lost
                    read = [p for unit in forward.ledger.units for p in unit.biases] + forward.ledger.outside_biases
                    guard_biases = list({id(p): p for p in read if p.requires_grad and not p.is_meta
                                         and all(p is not q for q in requested)}.values())
                    loss_scale = {}
                    grad, *parameter_grads = scaled_grad(picked.sum(), [leaf, *requested, *guard_biases],
                                                         retain_graph=False, memo=loss_scale)
            finally:
                runner._active.discard(forward)
        if grad is None:
            grad = torch.zeros_like(leaf)
        check_finite(grad, "the gradients of the explained scores under MambaLRP's rules", self.model)
        per_feature = grad.detach().double() * leaf.detach().double()  # sums in float64 whatever the model's dtype
        # per token; for pixels (B, C, H, W), per pixel (B, H·W), its channels summed
        token = per_feature.sum(1).flatten(1) if image else per_feature.sum(-1)
        delta = token.sum(-1) - picked.detach().double()
        bias_grads = {id(p): g for p, g in zip([*requested, *guard_biases], parameter_grads)}
        gaps = forward.ledger.gaps(token.sum(-1), token.abs().sum(-1), picked, bias_grads, model_dtype,
                                   grad_scale=loss_scale.get("scale", 1.0))
        if forward.ledger.skipped:
            warnings.warn("mamba_captum: MambaLRP's conservation guard could not compare "
                          f"{', '.join(forward.ledger.skipped)}; the relevance there is returned unchecked.",
                          RuntimeWarning, stacklevel=3)
        if measured is not None:
            measured.extend(gaps)
        else:
            failed = [gap for gap in gaps if not gap.relative <= gap.tolerance]
            if failed:
                raise _conservation_error(failed[0], model_dtype, len(failed))
        parameter_grads = parameter_grads[:len(requested)]
        if image:  # (B, 1, H, W), as the other methods' image maps; it sums to the explained score less the shares
            relevance = per_feature.sum(1, keepdim=True).to(inputs.dtype)
        else:
            relevance = per_feature.to(inputs.dtype) if floating else token.to(
                torch.float64 if model_dtype == torch.float64 else torch.float32)
        if parameters is not None:
            share = sum(float((g.double() * p.detach().double()).sum()) for g, p in zip(parameter_grads, parameters)
                        if g is not None)
            return relevance, delta, share
        return relevance, delta

    @staticmethod
    def _leaf(forward, call_inputs, floating):
        if floating:
            return call_inputs
        if len(forward.embeddings) != 1:
            raise RuntimeError(f"mamba_captum: the input embeddings ran {len(forward.embeddings)} times in one forward "
                               "pass; MambaLRP reads the relevance at their one output.")
        return forward.embeddings[0]

    @staticmethod
    def _check_covered(forward, plan):
        """Every planned token mixer must have run under its rule (a mixer run in another thread, as by
        nn.DataParallel, would be left with its real, non-conservative gradient)."""
        missing = [p.path for p in plan if p.located is not None and not forward.calls.get(id(p))]
        if missing:
            raise RuntimeError(f"mamba_captum: the token mixers {missing} did not run under MambaLRP's rules in this "
                               "thread's forward pass; explain the HF model itself, with the whole sequence in one "
                               "call.")
