"""``AttributionCallback``: explain fixed probe examples while a HF ``Trainer`` trains, and log what it finds."""
from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback

from .explain import METHODS, explain, explain_ids
from .html_report import map_rgb, render_html, token_heatmap

PREFIX = "mamba_captum"


def top_k_mass(relevance, k: int) -> float:
    """Share of the total |relevance| on the ``k`` largest-|relevance| tokens (1 = all on k tokens)."""
    scores = torch.tensor(relevance, dtype=torch.float64).abs()
    total = scores.sum()
    return float(scores.topk(min(k, scores.numel())).values.sum() / total) if total > 0 else 0.0


class AttributionCallback(TrainerCallback):
    """Explains probe examples on every ``every``-th evaluation (rank 0 only) and logs:

    - scalars to the evaluation metrics (``trainer.evaluate()``'s result and an entry of its own in
      ``state.log_history``: the Trainer logs its evaluation before callbacks run, so integrations other than
      TensorBoard and W&B do not see them) and to TensorBoard: ``mamba_captum/<method>_top<k>_mass`` (mean over
      probes of the share of |relevance| on the top-k tokens) and ``mamba_captum/target_probability``;
    - figures: each probe's last-layer implicit-attention map as an image and its top tokens as text, to the
      Trainer's TensorBoard writer (``TensorBoardCallback.tb_writer``; its own writer under
      ``output_dir/runs/mamba_captum`` if the Trainer has none) and to W&B when ``report_to`` includes them;
    - always, a fallback under ``output_dir/mamba_captum/step-<N>/``: ``report.html`` and ``explanations.jsonl``.

    The model's train / eval mode is restored afterwards; the methods use ``torch.autograd.grad`` and leave no
    ``.grad``, hooks or state on the model.

    Args:
        texts: probe texts (needs ``tokenizer`` or the Trainer's ``processing_class``); or None to take the first
            ``probes`` examples of ``eval_dataloader`` (their ``input_ids`` / ``attention_mask``). Words of the
            texts that the tokenizer does not know are named in an UnknownTokenWarning when training begins.
        tokenizer: the tokenizer (default: the Trainer's ``processing_class``).
        every: explain on the first evaluation and every ``every``-th after it (1 = each; 2 = the 1st, 3rd, ...).
        method: the explained methods' names (``"raw"``, ``"rollout"``, ``"attribution"``, ``"selection"``,
            ``"lrp"``); the first is imaged.
        top_k: k of the top-k relevance mass.
        probes: how many eval examples to take when ``texts`` is None.
        target: as :func:`mamba_captum.explain.explain`.
        labels: as :func:`mamba_captum.explain.explain`.
        formulation: as :func:`mamba_captum.explain.explain`.
    """

    def __init__(self, texts=None, *, tokenizer=None, every: int = 1, method=("attribution",), top_k: int = 3,
                 probes: int = 2, target=None, labels=None, formulation: str = "unified"):
        if every < 1:
            raise ValueError(f"mamba_captum: every must be at least 1, not {every}.")
        methods = (method,) if isinstance(method, str) else tuple(method)
        unknown = [m for m in methods if m not in METHODS]
        if unknown or not methods:
            raise ValueError(f"mamba_captum: unknown method {unknown or methods}; choose among {', '.join(METHODS)}.")
        self.texts = [texts] if isinstance(texts, str) else (list(texts) if texts is not None else None)
        self.tokenizer, self.every, self.methods, self.top_k = tokenizer, every, methods, top_k
        self.probes, self.target, self.labels, self.formulation = probes, target, labels, formulation
        self.evaluations = 0
        self.trainer = None

    def attach(self, trainer):
        """Add this callback to ``trainer`` and remember it (optional: passed through ``Trainer(callbacks=[...])``
        or ``add_callback`` it finds the Trainer's other callbacks itself, through the list that holds it).
        Returns ``self``."""
        trainer.add_callback(self)
        self.trainer = trainer
        return self

    # -- the work ----------------------------------------------------------------------------------------------------
    def _explanations(self, model, tokenizer, eval_dataloader):
        options = dict(target=self.target, methods=self.methods, formulation=self.formulation, labels=self.labels)
        if self.texts is not None:
            if tokenizer is None:
                raise ValueError("mamba_captum: AttributionCallback(texts=...) needs tokenizer= (or a Trainer with "
                                 "processing_class=).")
            return explain(model, tokenizer, self.texts, **options)
        if eval_dataloader is None:
            raise ValueError("mamba_captum: AttributionCallback without texts= takes its probes from the "
                             "eval_dataloader, and the Trainer has none; pass texts=.")
        dataset = getattr(eval_dataloader, "dataset", None)
        if isinstance(dataset, torch.utils.data.Dataset) and hasattr(dataset, "__len__") and \
                getattr(eval_dataloader, "collate_fn", None) is not None:
            # by index, not by iterating the prepared loader: on rank 0 alone that could wait on other ranks
            batch = eval_dataloader.collate_fn([dataset[i] for i in range(min(self.probes, len(dataset)))])
        else:
            batch = next(iter(eval_dataloader))
        ids = batch["input_ids"][:self.probes]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask[:self.probes]
        return explain_ids(model, tokenizer, (ids, mask), **options)

    def _scalars(self, explanations) -> dict:
        scalars = {f"{PREFIX}/{name}_top{self.top_k}_mass":
                   sum(top_k_mass(e.relevance[name], self.top_k) for e in explanations) / len(explanations)
                   for name in self.methods}
        scalars[f"{PREFIX}/target_probability"] = sum(e.target_probability for e in explanations) / len(explanations)
        return scalars

    def _trainer_tensorboard(self):
        """The Trainer's TensorBoardCallback: through the attached Trainer, or else through the CallbackHandler's
        list that holds this callback (HF hands callbacks no reference to the Trainer or its handler; a user's own
        list holding this callback has no TensorBoardCallback in it and is passed over)."""
        holders = [self.trainer.callback_handler.callbacks] if self.trainer is not None else [
            holder for holder in gc.get_referrers(self) if isinstance(holder, list)]
        for holder in holders:
            for callback in holder:
                if isinstance(callback, TensorBoardCallback):
                    return callback
        return None

    def _tensorboard_writer(self, args):
        callback = self._trainer_tensorboard()
        if callback is not None and callback.tb_writer is not None:
            return callback.tb_writer, False
        if "tensorboard" not in (args.report_to or []):
            return None, False
        from torch.utils.tensorboard import SummaryWriter

        logging_dir = os.getenv("TENSORBOARD_LOGGING_DIR") or os.path.join(args.output_dir, "runs", PREFIX)
        return SummaryWriter(log_dir=logging_dir), True

    def _figures(self, args, state, explanations, scalars):
        writer, own = self._tensorboard_writer(args)
        images = {}
        for number, item in enumerate(explanations):
            layers = [k for k in item.layer_maps or () if isinstance(k, int)]  # Zamba2 adds "{i}.shared_attention"
            if layers:
                last = max(layers)
                images[f"{PREFIX}/probe{number}/layer{last}_map"] = map_rgb(item.layer_maps[last], scale=8)
        if writer is not None:
            for name, value in scalars.items():
                writer.add_scalar(name, value, state.global_step)
            for name, rgb in images.items():
                writer.add_image(name, rgb.numpy(), state.global_step, dataformats="HWC")
            for number, item in enumerate(explanations):
                line = "; ".join(f"{name}: " + ", ".join(f"{t} {s:+.3f}" for t, s in item.top_tokens(name))
                                 for name in item.relevance)
                writer.add_text(f"{PREFIX}/probe{number}", f"{item.text} -> {item.prediction} | {line}",
                                state.global_step)
            writer.flush()
            if own:
                writer.close()
        if "wandb" in (args.report_to or []):
            try:
                import wandb
            except ImportError:
                wandb = None
            if wandb is not None and wandb.run is not None:
                logged = {name: wandb.Image(rgb.numpy()) for name, rgb in images.items()}
                logged[f"{PREFIX}/heatmaps"] = wandb.Html("<br>".join(
                    token_heatmap(e.shown(), e.relevance[self.methods[0]]) for e in explanations))
                # no step=: HF's WandbCallback lets W&B count steps and plots against train/global_step; an
                # explicit step lower than W&B's own would be dropped
                wandb.log({**scalars, **logged, "train/global_step": state.global_step})

    def _fallback(self, args, state, explanations):
        folder = Path(args.output_dir) / PREFIX / f"step-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.html").write_text(render_html(explanations, title=f"mamba-captum probes at step "
                                                                              f"{state.global_step}"), encoding="utf-8")
        with (folder / "explanations.jsonl").open("w", encoding="utf-8") as handle:
            for item in explanations:
                handle.write(json.dumps(item.to_dict()) + "\n")

    # -- the events ----------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        """Check the probes, the target and the labels now, not at the first evaluation hours into the run."""
        if self.texts is None or not state.is_world_process_zero:
            return
        from .explain import encode_text, label_words, resolve_target

        tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        if tokenizer is None:
            raise ValueError("mamba_captum: AttributionCallback(texts=...) needs tokenizer= (or a Trainer with "
                             "processing_class=).")
        resolve_target(model, tokenizer, self.target, label_words(model, self.labels))
        for text in self.texts:
            encode_text(model, tokenizer, text)

    def on_evaluate(self, args, state, control, model=None, processing_class=None, eval_dataloader=None,
                    metrics=None, **kwargs):
        self.evaluations += 1
        if not state.is_world_process_zero or (self.evaluations - 1) % self.every:
            return
        tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        was_training = model.training
        model.eval()
        try:
            explanations = self._explanations(model, tokenizer, eval_dataloader)
        finally:
            model.train(was_training)
        scalars = self._scalars(explanations)
        if metrics is not None:
            metrics.update(scalars)
        state.log_history.append({**scalars, "step": state.global_step})
        self._figures(args, state, explanations, scalars)
        self._fallback(args, state, explanations)
