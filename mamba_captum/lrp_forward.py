"""MambaLRP's modified forward: a context manager under which the model's forward passes (of the opening thread)
give the real values and the LRP rules' gradients. Nothing in the model is swapped; every hook is removed on exit.

- Token mixers and the modules with a rule (:func:`mamba_captum.families.lrp_plan.lrp_plan`): a pre-hook records the
  input and switches autograd off for the real computation (its graph would be thrown away), the forward hook
  switches it back on and returns the rule's expression, computed from the recorded input: the real output's value
  (checked: ``ReconstructionError`` naming the module beyond the dtype's tolerance) with the rule's gradient.
  The rule's own value is passed on, not the real output's: the modified forward is then one function, linear in
  the embeddings and biases, whose value its gradient × input reproduces to the work dtype's rounding (HF computes
  parts of some float64 layers in float32: taking those real values would add their rounding to the sums).
- Softmax attention (any ``attn_implementation``): HF's attention interface is run without a graph and its output
  replaced by ``P̄ v`` (the probabilities rebuilt by :mod:`mamba_captum.families.softmax`, detached): the value
  path only, CP-LRP / AttnLRP's rule.
- The input embeddings: the embedding module's output is swapped for a leaf that requires grad
  (:attr:`LRPForward.embeddings`), where the relevance is read as gradient × input. In a vision-language model the
  leaf is the language model's ``inputs_embeds`` instead, the token embeddings with the image features merged into
  the placeholder rows: a placeholder token's relevance is its image features' gradient × input; the vision tower
  and projector, upstream of the leaf (:attr:`~mamba_captum.families.lrp_plan.PlannedRule.feeds`), run without a
  graph.
- The conservation guard's ledger (:class:`mamba_captum.conservation.ConservationLedger`): gradient hooks on each
  replaced computation's inputs and output, and on the bias of every ``nn.Linear`` outside them, record during the
  one backward pass what relevance enters and leaves each of them, per example;
  :meth:`~mamba_captum.conservation.ConservationLedger.gaps` compares.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch import nn

from .attention_capture import ATTENTION_PATCH, attention_call, open_captures
from .capture import MixerCall, mixer_arguments
from .conservation import ConservationLedger, bias_parameters
from .families import softmax
from .families.lrp_plan import ADDITIVE_CONSTANTS, PlannedRule
from .offload import loaded_weights
from .rules import ratio
from .shared_state import forget_hook, library_hook
from .verification import check_reconstruction


def _output_head(model: nn.Module) -> nn.Module | None:
    """The layer that gives the model's scores: its output embeddings (a causal LM's head), else a sequence
    classifier's ``score`` layer; None for a base model (a forward_func's own head)."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    if not isinstance(head, nn.Module):
        head = getattr(model, "score", None)
    return head if isinstance(head, nn.Module) else None


class LRPForward(contextlib.AbstractContextManager):
    """Hooks that turn the model's forward into MambaLRP's modified forward while the context is open.

    Args:
        plan: the modules to replace (:func:`mamba_captum.families.lrp_plan.lrp_plan`).
        embeddings: the input-embedding module (its output becomes a leaf), or None (inputs_embeds are the leaf).
        token_mask: (B, L) 1 for real tokens: the attention check compares real rows only (pad rows of softmax
            layers depend on the mask convention and reach no real token).
        work_dtype: the dtype of the rules' expressions (float64 for float64 models, else float32).
        model_dtype: the model's dtype (the check's tolerance).
        model: the model the plan's modules belong to (its offloaded weights are loaded for each rule,
            :mod:`mamba_captum.offload`).
    """

    def __init__(self, plan: list[PlannedRule], embeddings: nn.Module | None, token_mask: torch.Tensor,
                 work_dtype: torch.dtype, model_dtype: torch.dtype, model: nn.Module):
        self.plan = plan
        self.model = model
        self.embedding_module = embeddings
        self.token_mask = token_mask
        self.work_dtype, self.model_dtype = work_dtype, model_dtype
        self.embeddings: list[torch.Tensor] = []  # the leaves, one per call of the embedding module
        self.calls: dict[int, int] = {}  # id(planned) -> how many times its rule replaced an output
        self._handles = []
        self._pending: dict[int, list] = {}  # id(module) -> stack of (args, kwargs, grad mode) of running calls
        self._unfused: dict[int, bool] = {}
        self._heads: dict[int, list] = {}  # id(planned) -> the head outputs of running soft-capped calls
        self._thread = None
        self._grad_mode = None
        self._captures = None
        self._patched = False
        batch, length = token_mask.shape[:2]
        self.ledger = ConservationLedger(batch, length, token_mask.device)  # the conservation guard's records
        self._paths: dict[int, str] | None = None
        self._biased_linears = self._biases_outside_rules()
        self._output_head = _output_head(model)

    # -- helpers --------------------------------------------------------------------------------------------
    def _mine(self) -> bool:
        if threading.get_ident() != self._thread:
            return False
        captures = open_captures()
        return bool(captures) and captures[-1] is self

    def _check(self, name, real, rule, rows_mask=None, module=None, layer_input=None):
        check_reconstruction(name, real, rule, self.model_dtype, rows_mask, module=module, layer_input=layer_input,
                             model=self.model)

    # -- hooks ----------------------------------------------------------------------------------------------
    def _on_pre(self, planned, module, args, kwargs):
        if not self._mine():
            return None
        self._pending.setdefault(id(module), []).append((args, kwargs, torch.is_grad_enabled()))
        if planned.located is not None:
            self._unfused[id(module)] = False
        torch.set_grad_enabled(False)  # the real computation only gives the value
        return None

    def _on_post(self, planned, module, args, kwargs, output):
        if not self._mine():
            return None
        args, kwargs, grad_mode = self._pending[id(module)].pop()
        torch.set_grad_enabled(grad_mode)
        if not grad_mode:
            return None
        real = output[0] if isinstance(output, tuple) else output
        name = planned.path or type(module).__name__
        unit = self.ledger.unit(f"{name} ({type(module).__name__})", module)
        # the rule reads the module's weights after its forward returned: an offloaded module's are meta by now
        with torch.enable_grad(), loaded_weights(self.model, module):
            unit.biases = bias_parameters(module)  # as the rule reads them (loaded, for an offloaded module)
            args, kwargs = self.ledger.watch_inputs(unit, args, kwargs)
            if planned.located is not None:
                hidden, mask, options = mixer_arguments(args, kwargs)
                if "attention_mask" in kwargs:  # as the mixer got it (ZAYA's rule re-runs its forward with it)
                    options = {**options, "attention_mask": kwargs["attention_mask"]}
                call = MixerCall(planned.located, hidden, mask, options=options,
                                 unfused=self._unfused.get(id(module), True))
                rule = planned.located.adapter.lrp(call, self.work_dtype)
                layer_input = hidden
            else:
                rule = planned.rule(module, args, kwargs, real, self.work_dtype)
                layer_input = args[0] if args else None
        # a rule of a module with several outputs gives a tuple, replacing as many of them (fla's fused-residual
        # norm: (norm(x + residual), x + residual)); each is checked and watched
        rule, *extras = rule if isinstance(rule, tuple) else (rule,)
        # a mixer whose rule re-runs a softmax (ZAYA's, Inkling's attention): its pad rows depend on the mask
        # convention (as a softmax layer's) and reach no real token; its real rows are compared
        rows = self.token_mask if planned.located is not None and planned.located.adapter.CONSUMES_ATTENTION and \
            real.dim() >= 2 and tuple(real.shape[:2]) == tuple(self.token_mask.shape) else None
        for index, value in enumerate((rule, *extras)):
            self._check(f"{name} ({type(module).__name__}) under MambaLRP's rules"
                        f"{f', output {index}' if index else ''}", output[index] if index else real, value.detach(),
                        rows if not index else None, module=module, layer_input=layer_input)
            self.ledger.watch_output(unit, value, slot=index)
        self.calls[id(planned)] = self.calls.get(id(planned), 0) + 1
        replaced = rule.to(real.dtype)
        if not isinstance(output, tuple):
            return replaced
        extras = tuple(value.to(output[index].dtype) for index, value in enumerate(extras, 1))
        return (replaced, *extras, *output[1 + len(extras):])

    def _on_out_proj(self, module_id, module, args, output):
        if self._mine():
            self._unfused[module_id] = True

    def _on_head(self, planned, module, args, output):
        if self._mine():
            self._heads.setdefault(id(planned), []).append(output)

    def _on_soft_capped(self, planned, module, args, kwargs, output):
        """The soft-capped logits ``s = c · tanh(z / c)`` by the identity rule ``z · (s / z)̄``."""
        heads = self._heads.get(id(planned))
        if not self._mine() or not heads:
            return None
        z = heads.pop()
        capped = output.logits
        if not torch.is_grad_enabled() or z.shape != capped.shape:
            return None
        name = f"{planned.path or type(module).__name__} (soft-capped logits under the identity rule)"
        unit = self.ledger.unit(name, None)
        unit.after_head = True
        (z,), _ = self.ledger.watch_inputs(unit, (z,), {})
        rule = z.to(self.work_dtype) * ratio(capped.to(self.work_dtype), z.to(self.work_dtype))
        self._check(name, capped, rule.detach(), module=module)
        self.ledger.watch_output(unit, rule)
        self.calls[id(planned)] = self.calls.get(id(planned), 0) + 1
        output.logits = rule.to(capped.dtype)
        return output

    def _on_output_head(self, module, args, output):
        if self._mine() and torch.is_tensor(output):
            self.ledger.watch_head(output)

    def _on_upstream_pre(self, module, args):
        """A module upstream of the relevance leaf (a vision tower): its real computation, without a graph."""
        if not self._mine():
            return
        if self.embedding_module is None:
            raise NotImplementedError(
                f"mamba_captum: MambaLRP reads a vision-language model's relevance at its merged text and image "
                f"embeddings, which it builds from token ids: pass input_ids, not inputs_embeds, with the images "
                f"({type(module).__name__} ran).")
        self._pending.setdefault(id(module), []).append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def _on_upstream_post(self, module, args, output):
        if self._mine() and self._pending.get(id(module)):
            torch.set_grad_enabled(self._pending[id(module)].pop())

    def _on_merged_embeddings(self, module, args, kwargs):
        """A vision-language model's language model: its ``inputs_embeds`` (text and image features merged) become
        the leaf."""
        embeds = kwargs.get("inputs_embeds")
        if not self._mine() or not torch.is_tensor(embeds) or not torch.is_grad_enabled():
            return None
        leaf = embeds.detach().requires_grad_(True)
        self.embeddings.append(leaf)
        return args, {**kwargs, "inputs_embeds": leaf}

    def _on_linear(self, module, args, output):
        """An ``nn.Linear`` with a bias outside the replaced modules: its bias's share, for the guard."""
        if not (self._mine() and torch.is_tensor(output) and output.requires_grad):
            return
        bias = module.bias
        if bias.is_meta:  # offloaded: accelerate dropped the weights when the forward returned
            with loaded_weights(self.model, module):
                bias = module.bias.detach().clone()
        self.ledger.watch_linear(bias, output)

    def _on_embedding(self, module, args, output):
        if not self._mine() or not torch.is_tensor(output) or not output.is_floating_point():
            return None
        leaf = output.detach().requires_grad_(True)
        self.embeddings.append(leaf)
        return leaf

    def _attention_call(self, interface, module, query, key, value, attention_mask, args, kwargs):
        """HF's attention interface, run without a graph; its output replaced by P̄ v (value path only)."""
        with torch.no_grad():
            output = interface(module, query, key, value, attention_mask, *args, **kwargs)
        if not torch.is_grad_enabled():
            return output
        if self._paths is None:
            self._paths = {id(m): path for path, m in self.model.named_modules()}
        name = f"{self._paths.get(id(module), '')} ({type(module).__name__}, softmax attention: P̄ v)".lstrip()
        unit = self.ledger.unit(name, None)  # the value path only: the projections' biases are outside, nn.Linear
        (value,), _ = self.ledger.watch_inputs(unit, (value,), {})
        call = attention_call(None, module, query.detach(), key.detach(), value, attention_mask, args, kwargs, output)
        _, rule, real = softmax.rebuild(call, self.work_dtype, None)
        self._check(f"{type(module).__name__} (softmax attention under MambaLRP's rules)", real, rule.detach(),
                    self.token_mask, module=module, layer_input=value)
        self.ledger.watch_output(unit, rule)
        self.calls["attention"] = self.calls.get("attention", 0) + 1
        replaced = rule.to(call.output.dtype)
        return (replaced, *output[1:]) if isinstance(output, tuple) else replaced

    # -- context manager ------------------------------------------------------------------------------------
    def _hook(self, module, pre, fn, *bound, **options):
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        owner = weakref.ref(self)
        name = fn.__name__

        def hook(hooked, *args):
            # a copy of the module made during the call (copy.deepcopy in a forward_func) carries this hook: once
            # the call is over it does nothing and removes itself from the copy the first time the copy runs
            forward = owner()
            if forward is None or not forward._handles:
                forget_hook(hooked, hook)
                return None
            return getattr(forward, name)(*bound, hooked, *args)

        self._handles.append(register(library_hook(hook), **options))

    def __enter__(self):
        self._thread = threading.get_ident()
        self._grad_mode = torch.is_grad_enabled()
        self._captures = open_captures()
        self._captures.append(self)
        try:
            merged = None  # a vision-language model's language model: its inputs_embeds are the leaf
            for planned in self.plan:
                module = planned.module
                if planned.feeds is not None:
                    merged = planned.feeds
                    self._hook(module, True, self._on_upstream_pre)
                    self._hook(module, False, self._on_upstream_post, prepend=True)
                    continue
                if planned.soft_cap is not None:
                    self._hook(planned.head, False, self._on_head, planned)
                    self._hook(module, False, self._on_soft_capped, planned, with_kwargs=True)
                    continue
                # outermost: the pre-hook after every other pre-hook (the input as the module gets it), the forward
                # hook before every other forward hook (the module's own output)
                self._hook(module, True, self._on_pre, planned, with_kwargs=True)
                self._hook(module, False, self._on_post, planned, with_kwargs=True, prepend=True)
                out_proj = getattr(module, "out_proj", None)
                if planned.located is not None and isinstance(out_proj, nn.Module):
                    self._hook(out_proj, False, self._on_out_proj, id(module))
            for linear in self._biased_linears:
                self._hook(linear, False, self._on_linear)
            if self._output_head is not None:
                self._hook(self._output_head, False, self._on_output_head)
            if self.embedding_module is not None and merged is not None:
                self._hook(merged, True, self._on_merged_embeddings, with_kwargs=True)
            elif self.embedding_module is not None:
                self._hook(self.embedding_module, False, self._on_embedding)
            ATTENTION_PATCH.__enter__()
            self._patched = True
        except BaseException:
            self._remove()
            raise
        return self

    def _biases_outside_rules(self) -> list[nn.Linear]:
        """The ``nn.Linear`` modules with a bias outside the replaced modules (hooked: their bias shares, per
        example); any other bias outside them goes to
        :attr:`mamba_captum.conservation.ConservationLedger.outside_biases` (compared over the batch: no covered
        model has one)."""
        inside = {id(sub) for planned in self.plan if planned.soft_cap is None for sub in planned.module.modules()}
        linears, seen, stack = [], set(), [self.model]
        while stack:
            module = stack.pop()
            if id(module) in inside or id(module) in seen:
                continue
            seen.add(id(module))
            constants = ADDITIVE_CONSTANTS.get(type(module).__name__, ())  # Vim's CLS token, position embeddings
            if isinstance(module, nn.Linear) and module.bias is not None:
                linears.append(module)
            else:
                self.ledger.outside_biases.extend(
                    p for name, p in module.named_parameters(recurse=False)
                    if (name.endswith("bias") or name in constants) and p.is_floating_point())
            stack.extend(module.children())
        return linears

    def _remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        self._heads.clear()
        if self in self._captures:
            self._captures.remove(self)
        if self._patched:
            self._patched = False
            ATTENTION_PATCH.__exit__(None, None, None)
        if self._grad_mode is not None:
            torch.set_grad_enabled(self._grad_mode)

    def __exit__(self, *exc):
        self._remove()
        return False
