"""AttributionCallback inside a real Trainer: TensorBoard events read back, metrics, the fallback files, the model's
mode restored."""
import json

import pytest
import torch
import transformers as tf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mamba_captum.callback import AttributionCallback, top_k_mass
from mamba_captum.demo import grammar
from mamba_captum.demo.train import build_tokenizer, demo_config

PROBES = ["the plot was not good", "the cast was great but the food was awful"]


class Sentences(torch.utils.data.Dataset):
    def __init__(self, tokenizer, count, seed):
        sentences = grammar.sentences(count, seed)
        self.batch = tokenizer([f"{s.text}" for s in sentences], padding="max_length", max_length=24,
                               return_tensors="pt")
        labels = self.batch["input_ids"].clone()
        labels[self.batch["attention_mask"] == 0] = -100
        self.batch["labels"] = labels

    def __len__(self):
        return len(self.batch["input_ids"])

    def __getitem__(self, index):
        return {key: value[index] for key, value in self.batch.items()}


def make_trainer(tmp_path, callbacks=None, **training):
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = tf.MambaForCausalLM(demo_config(len(tokenizer)))
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8,
                                per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=2, logging_steps=2,
                                report_to=["tensorboard"], save_strategy="no", use_cpu=True, seed=0,
                                disable_tqdm=True, **training)
    return tf.Trainer(model=model, args=args, train_dataset=Sentences(tokenizer, 32, 0),
                      eval_dataset=Sentences(tokenizer, 8, 1), processing_class=tokenizer, callbacks=callbacks)


def events(folder):
    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {folder}"
    found = {"scalars": {}, "images": {}, "text": set()}
    for path in files:
        accumulator = EventAccumulator(str(path), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
        accumulator.Reload()
        tags = accumulator.Tags()
        for tag in tags["scalars"]:
            found["scalars"].setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
        for tag in tags["images"]:
            found["images"].setdefault(tag, []).extend(e.step for e in accumulator.Images(tag))
        found["text"] |= {tag for tag in tags["tensors"] if tag.startswith("mamba_captum/probe")}
    return found


def test_callback_logs_to_the_trainers_tensorboard_and_metrics(tmp_path):
    trainer = make_trainer(tmp_path)
    callback = AttributionCallback(PROBES, method=("attribution", "rollout"), top_k=3).attach(trainer)
    trainer.train()
    found = events(tmp_path)
    mass = found["scalars"]["mamba_captum/attribution_top3_mass"]
    assert [step for step, _ in mass] == [2, 4]
    assert [step for step, _ in found["scalars"]["mamba_captum/rollout_top3_mass"]] == [2, 4]
    assert found["images"]["mamba_captum/probe0/layer1_map"] == [2, 4]
    assert found["text"] == {"mamba_captum/probe0/text_summary", "mamba_captum/probe1/text_summary"}
    assert "train/loss" in found["scalars"]  # one event stream with the Trainer's own scalars
    # the logged scalar is the mean top-3 mass of the explanations written to the fallback folder
    rows = [json.loads(line) for line in (tmp_path / "mamba_captum" / "step-4" / "explanations.jsonl").open()]
    assert [row["text"] for row in rows] == PROBES
    expected = sum(top_k_mass(row["relevance"]["attribution"], 3) for row in rows) / 2
    assert mass[-1][1] == pytest.approx(expected, rel=1e-6)
    assert (tmp_path / "mamba_captum" / "step-2" / "report.html").read_text().count("<section") == 2
    history = [entry for entry in trainer.state.log_history if "mamba_captum/attribution_top3_mass" in entry]
    assert [entry["step"] for entry in history] == [2, 4]
    # a later evaluate(): the scalars are in its metrics
    metrics = trainer.evaluate()
    assert 0 < metrics["mamba_captum/attribution_top3_mass"] <= 1
    assert callback.evaluations == 3
    # called on a model in train mode (Trainer.evaluate switches to eval itself): the mode is restored, nothing
    # is left on the model
    trainer.model.train()
    extra = {}
    callback.on_evaluate(trainer.args, trainer.state, trainer.control, model=trainer.model,
                         processing_class=trainer.processing_class, metrics=extra)
    assert trainer.model.training and extra["mamba_captum/attribution_top3_mass"] == pytest.approx(
        metrics["mamba_captum/attribution_top3_mass"], rel=1e-6)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in trainer.model.modules())
    assert all(p.grad is None for p in trainer.model.parameters())


def test_callback_from_the_eval_dataloader_every_second_evaluation(tmp_path):
    callback = AttributionCallback(every=2, probes=2, method="raw")
    trainer = make_trainer(tmp_path, callbacks=[callback])  # not attached: it finds the Trainer's writer itself
    trainer.train()
    found = events(tmp_path)
    assert not (tmp_path / "runs" / "mamba_captum").exists()  # no event file of its own
    assert "train/loss" in found["scalars"]
    assert [step for step, _ in found["scalars"]["mamba_captum/raw_top3_mass"]] == [2]  # evaluations 1 (not 2)
    rows = [json.loads(line) for line in (tmp_path / "mamba_captum" / "step-2" / "explanations.jsonl").open()]
    assert len(rows) == 2 and all(row["tokens"][-1] == "[SENTIMENT]" and "[PAD]" not in row["tokens"]
                                  for row in rows)
    assert not (tmp_path / "mamba_captum" / "step-4").exists()


def test_without_a_trainer_writer_it_writes_its_own(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.pop_callback(tf.integrations.TensorBoardCallback)  # report_to still says tensorboard
    trainer.add_callback(AttributionCallback(PROBES[:1]))
    trainer.train()
    found = events(tmp_path / "runs" / "mamba_captum")
    assert [step for step, _ in found["scalars"]["mamba_captum/attribution_top3_mass"]] == [2, 4]


def test_a_users_own_callback_list_is_not_mistaken_for_the_trainers(tmp_path):
    callbacks = [AttributionCallback(PROBES[:1]), tf.TrainerCallback()]  # the user keeps this list
    trainer = make_trainer(tmp_path, callbacks=callbacks)
    trainer.train()
    assert not (tmp_path / "runs" / "mamba_captum").exists()
    assert [s for s, _ in events(tmp_path)["scalars"]["mamba_captum/attribution_top3_mass"]] == [2, 4]


def test_bad_probes_stop_training_before_the_first_step(tmp_path):
    from mamba_captum.explain import UsageError

    for callback, message in ((AttributionCallback(PROBES, target="wonderful"), "not one of the model's label"),
                              (AttributionCallback(["good " * 80]), "the model allows at most 64")):
        trainer = make_trainer(tmp_path, callbacks=[callback])
        trainer.model.config.label_words = ["negative", "positive"]
        with pytest.raises(UsageError, match=message):
            trainer.train()
        assert trainer.state.global_step == 0


def test_zamba2_shared_attention_keys_do_not_break_the_figures(tmp_path):
    from mamba_captum.explain import Explanation

    trainer = make_trainer(tmp_path)
    maps = {0: torch.eye(3), "1.shared_attention": torch.eye(3), 1: torch.eye(3)}
    item = Explanation("a b c", ["a", "b", "c"], "x", 1.0, "x", 1.0, {"attribution": [0.1, 0.2, 0.3]}, maps)
    AttributionCallback(["a"])._figures(trainer.args, trainer.state, [item], {"mamba_captum/x": 0.5})
    assert events(tmp_path / "runs" / "mamba_captum")["images"] == {"mamba_captum/probe0/layer1_map": [0]}


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="every must be at least 1"):
        AttributionCallback(["x"], every=0)
    with pytest.raises(ValueError, match="unknown method"):
        AttributionCallback(["x"], method="saliency")


def test_wandb_gets_scalars_images_and_heatmaps_when_asked(tmp_path, monkeypatch):
    """W&B is not installed here: a stand-in module records what the callback hands to ``wandb.log``."""
    import sys
    import types

    logged = []
    fake = types.ModuleType("wandb")
    fake.run = object()
    fake.Image = lambda array: ("image", array.shape)
    fake.Html = lambda page: ("html", page)
    fake.log = lambda values, step=None: logged.append((step, values))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    trainer = make_trainer(tmp_path)
    trainer.args.report_to = ["wandb"]  # after __post_init__: no WandbCallback is built
    callback = AttributionCallback(PROBES[:1], method=("attribution", "raw"))
    callback.on_evaluate(trainer.args, trainer.state, trainer.control, model=trainer.model,
                         processing_class=trainer.processing_class, metrics={})
    ((step, values),) = logged
    assert step is None  # W&B counts steps itself (HF's WandbCallback does the same); the Trainer's step is a value
    assert values["train/global_step"] == trainer.state.global_step
    assert set(values) == {"mamba_captum/attribution_top3_mass", "mamba_captum/raw_top3_mass",
                           "mamba_captum/target_probability", "mamba_captum/probe0/layer1_map",
                           "mamba_captum/heatmaps", "train/global_step"}
    tokens = trainer.processing_class(PROBES[0])["input_ids"]
    assert values["mamba_captum/probe0/layer1_map"] == ("image", (8 * len(tokens), 8 * len(tokens), 3))
    assert values["mamba_captum/heatmaps"][0] == "html" and "[SENTIMENT]" in values["mamba_captum/heatmaps"][1]
