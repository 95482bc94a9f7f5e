"""Models dispatched by accelerate (issue 20): a checkpoint loaded with ``from_pretrained(..., device_map=...)``
with layers offloaded to CPU and to disk (their weights on the meta device outside their own forward) gives the
undispatched model's maps and attributions, and is left with its weights offloaded and its hooks as they were."""
import json

import pytest
import torch
import transformers as tf
from accelerate import cpu_offload
from conftest import relative_error
from tiny_models import LINEAR_CONFIGS, make_model

import mamba_captum as mc
from mamba_captum import cli
from mamba_captum.callback import AttributionCallback
from mamba_captum.demo import model_dir
from mamba_captum.offload import is_dispatched, loaded_weights
from mamba_captum.explain import load

# a pure SSM of each kind, hybrids with softmax attention (Jamba), a shared block (Zamba2), the delta rule
# (Qwen3-Next), a recurrent family (RecurrentGemma), and RWKV without the in-place rescaling
FAMILIES = {"mamba": {}, "mamba2": {}, "jamba": {}, "zamba2": {}, "qwen3_next": {}, "recurrent_gemma": {},
            "rwkv": {"rescale_every": 0}}
if "lara_mini" in LINEAR_CONFIGS:  # transformers >= 5.24: its checkpoint fuses the delta-net's input projections,
    FAMILIES["lara_mini"] = {}     # which loading splits again


def alternating_map(model) -> dict:
    """Every other decoder layer on disk, the rest on "cpu" (offloaded to CPU memory when disk is used too)."""
    base = model.base_model_prefix
    placement = {}
    for name, child in getattr(model, base).named_children():
        if isinstance(child, torch.nn.ModuleList):
            placement.update({f"{base}.{name}.{i}": "disk" if i % 2 else "cpu" for i in range(len(child))})
        else:
            placement[f"{base}.{name}"] = "cpu"
    placement.update({name: "cpu" for name, _ in model.named_children() if name != base})
    return placement


def offloaded(model) -> list[str]:
    return [name for name, parameter in model.named_parameters() if parameter.device.type == "meta"]


def dispatched_pair(family, tmp_path, **overrides):
    model = make_model(family, **overrides)
    model.save_pretrained(tmp_path / "checkpoint")
    loaded = type(model).from_pretrained(tmp_path / "checkpoint", device_map=alternating_map(model),
                                         offload_folder=str(tmp_path / "offload"), attn_implementation="eager",
                                         dtype=torch.float32, **overrides).eval()
    assert is_dispatched(loaded) and offloaded(loaded)
    return model, loaded


def explanations(model, ids):
    return {"maps": mc.implicit_attention(model, ids, rows=[-1]),
            "raw": mc.MambaRawAttention(model).attribute(ids),
            "rollout": mc.MambaRollout(model).attribute(ids),
            "attribution": mc.MambaAttribution(model).attribute(ids, target=5),
            "selection": mc.MambaSelectionAttribution(model).attribute(ids, target=5),
            "lrp": mc.MambaLRP(model).attribute(ids, target=5)}


@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_model_gives_the_undispatched_models_results(family, tmp_path):
    model, loaded = dispatched_pair(family, tmp_path, **FAMILIES[family])
    meta_before = offloaded(loaded)
    hooks_before = {name: id(module._hf_hook) for name, module in loaded.named_modules() if hasattr(module, "_hf_hook")}
    ids = torch.randint(3, 64, (2, 9))
    expected, got = explanations(model, ids), explanations(loaded, ids)
    for name in expected:
        if name == "maps":
            assert list(got[name]) == list(expected[name])
            for key in expected[name]:
                assert relative_error(got[name][key], expected[name][key]) <= 1e-6, (name, key)
        else:
            assert relative_error(got[name], expected[name]) <= 1e-6, name
    # the offloaded weights are offloaded again, accelerate's hooks are the same objects and still offload
    assert offloaded(loaded) == meta_before
    assert {name: id(module._hf_hook) for name, module in loaded.named_modules()
            if hasattr(module, "_hf_hook")} == hooks_before
    assert all(module._hf_hook.offload for name, module in loaded.named_modules()
               if hasattr(module, "_hf_hook") and any(n.startswith(name + ".") for n in meta_before)
               and module._hf_hook.weights_map is not None)


def test_lrp_guard_checks_a_frozen_model_dispatched_without_offloading():
    """A frozen model spread by accelerate over devices without offloading (device_map="auto" over two GPUs, here
    two CPU entries with hooks forced): its weights stay in place, so MambaLRP's guard still reads the biases'
    shares (no module returned unchecked), and every requires_grad flag is restored."""
    import warnings

    from accelerate import dispatch_model

    model = make_model("mamba")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.3)  # non-zero biases: each has a share the guard must read
    ids = torch.randint(3, 64, (2, 9))
    expected = mc.MambaLRP(model).attribute(ids, target=5)
    placement = {"backbone.embeddings": "cpu", "backbone.layers": "cpu", "backbone.norm_f": "cpu", "lm_head": "cpu"}
    model = dispatch_model(model, device_map=placement, main_device="cpu", force_hooks=True)
    assert is_dispatched(model) and not offloaded(model)
    model.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "the relevance there is returned unchecked"
        got = mc.MambaLRP(model).attribute(ids, target=5)
    assert relative_error(got, expected) <= 1e-6
    assert not any(parameter.requires_grad for parameter in model.parameters())


def test_an_ancestor_hook_that_preloads_the_whole_backbone(tmp_path):
    """cpu_offload with preload_module_classes: one hook on the backbone loads all of it in its forward; the rebuild
    loads only the layer it explains, and puts it back."""
    model = make_model("mamba2")
    offloaded_model = make_model("mamba2")
    cpu_offload(offloaded_model, execution_device="cpu", preload_module_classes=["Mamba2Model"])
    assert offloaded(offloaded_model)
    ids = torch.randint(3, 64, (1, 8))
    backbone = offloaded_model.backbone
    with loaded_weights(offloaded_model, backbone.layers[1]):
        assert not [n for n, p in backbone.layers[1].named_parameters() if p.device.type == "meta"]
        assert all(p.device.type == "meta" for p in backbone.layers[0].parameters())  # only the layer asked for
    assert all(p.device.type == "meta" for p in backbone.layers[1].parameters())
    assert relative_error(mc.MambaAttribution(offloaded_model).attribute(ids, target=3),
                          mc.MambaAttribution(model).attribute(ids, target=3)) <= 1e-6


def test_rwkv_that_cannot_keep_its_rescaling_is_refused(tmp_path):
    """transformers' RWKV divides its weights in place on the first eval forward; offloaded weights are reloaded
    undivided, so the dispatched model's logits are not the model's. Refused, naming rescale_every=0."""
    model, loaded = dispatched_pair("rwkv", tmp_path)
    ids = torch.randint(3, 64, (1, 8))
    with torch.no_grad():
        assert relative_error(loaded(ids).logits, model(ids).logits) > 1e-2  # transformers' own behaviour
    with pytest.raises(ValueError, match="rescale_every=0"):
        mc.MambaAttribution(loaded).attribute(ids, target=3)


def test_callback_on_an_offloaded_model(tmp_path):
    probes = ["the plot was not good", "the cast was great"]
    plain, tokenizer = load(model_dir())
    dispatched, _ = load(model_dir(), device_map={"": "disk"}, offload_folder=tmp_path / "offload")
    assert offloaded(dispatched)
    results = []
    for index, model in enumerate((plain, dispatched)):
        args = tf.TrainingArguments(output_dir=str(tmp_path / str(index)), report_to=[], use_cpu=True)
        state, metrics = tf.TrainerState(), {}
        callback = AttributionCallback(probes, tokenizer=tokenizer, method=("attribution", "lrp"), top_k=2)
        callback.on_evaluate(args, state, tf.TrainerControl(), model=model, metrics=metrics)
        results.append(metrics)
    assert results[1].keys() == results[0].keys() and results[0]
    for key, value in results[0].items():
        assert results[1][key] == pytest.approx(value, rel=1e-6), key


def test_cli_device_map_and_max_memory(tmp_path, capsys):
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["the plot was not good", "it was great"]))
    outputs = {}
    for name, options in {"plain": [], "auto": ["--device-map", "auto", "--max-memory", "cpu=100KB"],
                          "json": ["--device-map", '{"": "disk"}', "--offload-folder", str(tmp_path / "off")]}.items():
        out = tmp_path / f"{name}.jsonl"
        assert cli.main(["explain", "--model", str(model_dir()), "--dataset", str(dataset), "--jsonl", str(out),
                         *options]) == 0
        outputs[name] = [json.loads(line) for line in out.open()]
    for name in ("auto", "json"):
        for got, expected in zip(outputs[name], outputs["plain"]):
            for method, scores in expected["relevance"].items():
                assert relative_error(torch.tensor(got["relevance"][method]), torch.tensor(scores)) <= 1e-6
    capsys.readouterr()
    for options, message in [(["--device", "cpu", "--device-map", "auto"], "not both"),
                             (["--max-memory", "cpu=1GiB"], "give a device_map"),
                             (["--device-map", "auto", "--max-memory", "cpu"], "device=size"),
                             (["--device-map", "{oops"], "not a JSON object"),
                             (["--device-map", "everywhere"], "neither one of auto"),
                             (["--device-map", '{"": "moon"}'], "not a device")]:
        code = cli.main(["explain", "--model", str(model_dir()), "--text", "good", *options])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (options, err)
