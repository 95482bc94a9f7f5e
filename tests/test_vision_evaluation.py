"""The image faithfulness suite: the planted task, the perturbation metric by hand, the Grad-CAM views, and the
shipped tiny models of every architecture (trained by ``python -m mamba_captum.evaluation.vision --train``)."""
import json

import pytest
import torch

import mamba_captum as mc
from mamba_captum.evaluation import metrics
from mamba_captum.evaluation.images import (OBJECT_SIZE, RED, SHAPE_NAMES, load_digits, make_shapes,
                                            shape_stamp)
from mamba_captum.evaluation.vision_compare import (_GridView, _StageMapView, _tables, evaluate_images, image_methods,
                                                    patch_feature_mask)
from mamba_captum.evaluation.vision_models import (Upsampled, checkpoint_file, held_out, input_size, load_trained_vim,
                                                   model_pixels, on_task_pixels, task_pixels, vision_accuracy)
from mamba_captum.vision import load_image_model


def test_the_four_shapes_by_hand():
    counts = [int(shape_stamp(s).sum()) for s in range(4)]
    # square 8·8; plus: two 2-wide bars of 8 overlapping in a 2×2 centre; ring: 64 − the inner 4×4;
    # cross: two diagonals 3 wide (1 + 2·7 + ... clipped at the corners), overlapping in the centre
    assert counts[:3] == [64, 2 * 2 * 8 - 4, 64 - 16]
    cross = shape_stamp(3)
    assert bool(cross.diagonal().all()) and bool(cross.flip(1).diagonal().all()) and not bool(cross[0, 3])
    with pytest.raises(ValueError, match="shape 4"):
        shape_stamp(4)


def test_the_planted_task_is_seeded_and_its_masks_are_the_red_objects_pixels():
    task = make_shapes(16, seed=3)
    again = make_shapes(16, seed=3)
    assert torch.equal(task.images, again.images) and torch.equal(task.masks, again.masks)
    assert not torch.equal(make_shapes(16, seed=4).images, task.images)
    assert sorted(task.labels.tolist()) == sorted([0, 1, 2, 3] * 4)  # balanced
    for image, mask, label in zip(task.images, task.masks, task.labels):
        assert int(mask.sum()) == int(shape_stamp(int(label)).sum())  # exactly the stamp of the labelled shape
        red = image[0][mask].mean() - image[1][mask].mean()
        assert abs(red - (RED[0] - RED[1])) < 0.3  # the object is red ...
        others = (image[0] - image[1] < -1.5) | (image[2] - image[1] > 1.5)  # ... the distractors blue or green
        assert int(others.sum()) >= 2 * min(counts_of_shapes()) and not bool((others & mask).any())
    assert task.class_names == SHAPE_NAMES and task.images.shape == (16, 3, 32, 32)


def counts_of_shapes():
    return [int(shape_stamp(s).sum()) for s in range(4)]


def test_digits_are_split_and_normalised():
    train, test = load_digits()
    assert len(train) + len(test) == 1797 and train.images.shape[1:] == (3, 32, 32) and test.masks is None
    everything = torch.cat([train.images, test.images])
    assert abs(float(everything.mean())) < 1e-4 and abs(float(everything.std()) - 1) < 1e-3


def test_pixel_deletion_by_hand():
    # one 2×2 image per row; the "model" predicts class 1 while pixel (0, 0) is kept, else class 0
    images = torch.ones(2, 1, 2, 2)
    forward = lambda x: torch.stack([1 - x[:, 0, 0, 0], x[:, 0, 0, 0]], -1)  # noqa: E731
    labels = torch.tensor([1, 1])
    relevance = torch.tensor([[[4.0, 3.0], [2.0, 1.0]],   # (0, 0) most relevant: gone at the first step
                              [[1.0, 2.0], [3.0, 4.0]]])  # (0, 0) least relevant: gone at the last
    steps = [0.25, 0.5, 0.75, 1.0]
    positive = metrics.pixel_deletion_curve(forward, images, relevance, labels, steps=steps)
    assert positive.tolist() == [0.5, 0.5, 0.5, 0.0]
    negative = metrics.pixel_deletion_curve(forward, images, relevance, labels, most_relevant_first=False, steps=steps)
    assert negative.tolist() == [0.5, 0.5, 0.5, 0.0]
    ties = torch.zeros(2, 2, 2)  # ties: lower pixel index first, so (0, 0) goes first
    assert metrics.pixel_deletion_curve(forward, images, ties, labels, steps=[0.25]).tolist() == [0.0]
    with pytest.raises(ValueError, match="do not match"):
        metrics.pixel_deletion_curve(forward, images, torch.zeros(2, 3, 3), labels)


@pytest.fixture(scope="module")
def shapes_model():
    return load_trained_vim("shapes")


def test_the_shipped_shapes_vim_is_trained_and_official_format(shapes_model):
    model, record = shapes_model
    assert record["held_out_accuracy"] >= 0.97 and model.class_names == list(SHAPE_NAMES)
    assert vision_accuracy(model, held_out("shapes").subset(slice(0, 128))) >= 0.95
    assert model.token_layout().length == 65 and model.cls_position == "middle"


def test_the_grad_cam_view_is_the_models_forward(shapes_model):
    model, _ = shapes_model
    images = held_out("shapes").images[:4]
    with torch.no_grad():
        assert torch.allclose(_GridView(model)(images), model(images), atol=1e-6)


def test_attribution_finds_the_planted_object(shapes_model):
    """The localisation the docs report, on 32 held-out images: far above random, and the model's own evidence."""
    model, _ = shapes_model
    task = held_out("shapes").subset(slice(0, 32))
    with torch.no_grad():
        predicted = model(task.images).argmax(-1)
    ours = mc.MambaAttribution(model).attribute(task.images, target=predicted)[:, 0]
    noise = torch.rand(32, 32, 32, generator=torch.Generator().manual_seed(0))
    # docs/faithfulness.md, 128 images: Binary-AUC 0.979, mIoU 0.489 (random patch values 0.633, 0.265)
    assert metrics.mean_binary_auc(ours, task.masks) >= 0.9 > metrics.mean_binary_auc(noise, task.masks) + 0.2
    assert metrics.segmentation_scores(ours, task.masks)["miou"] >= 0.45 > \
        metrics.segmentation_scores(noise, task.masks)["miou"] + 0.15


def test_the_comparison_runs_every_method(shapes_model):
    methods = [m for m in image_methods() if m.name in ("Attribution (unified)", "LayerGradCam (last block)",
                                                         "FeatureAblation (patches)", "random")]
    results = evaluate_images(["shapes"], examples=8, methods=methods, log=lambda row: None)
    assert [r["method"] for r in results["rows"]] == [m.name for m in methods]
    for row in results["rows"]:
        assert {"pixel_accuracy", "miou", "map", "binary_auc", "positive_predicted", "negative_target"} <= set(row)
        assert len(row["curves"]["positive_predicted"]) == 9


# -- the multi-stage architectures (VMamba, MambaOut, EfficientViM, MambaVision) -------------------------------------
NEW_ARCHITECTURES = ("vmamba", "mambaout", "efficientvim", "mambavision")
ARCH_CLASSES = {"vmamba": "VSSM", "mambaout": "MambaOut", "efficientvim": "EfficientViM",
                "mambavision": "MambaVision"}


@pytest.mark.parametrize("arch", NEW_ARCHITECTURES)
@pytest.mark.parametrize("task_name", ["shapes", "digits"])
def test_each_shipped_model_loads_by_its_keys_and_scores_its_training_record(arch, task_name):
    checkpoint = checkpoint_file(task_name, arch=arch)
    model = load_image_model(checkpoint)  # the architecture told from the keys, the rest from training.json
    record = json.loads(checkpoint.with_name("training.json").read_text())
    assert type(model).__name__ == ARCH_CLASSES[arch] and record["family"] == arch
    assert model.class_names == record["class_names"] and len(model.class_names) == (4 if task_name == "shapes" else 10)
    assert input_size(model) == ((128, 128) if arch == "efficientvim" else (32, 32))
    assert sum(p.numel() for p in model.parameters()) == record["parameters"] <= 200_000
    assert model.token_layout().grid == (8, 8)  # every model's first stage: one token per 4×4 task pixels
    task = held_out(task_name)
    assert len(task) == record["held_out_examples"]
    # the record's held-out accuracy, recomputed (one near-tie may flip on another thread count)
    assert abs(vision_accuracy(model, task) - record["held_out_accuracy"]) <= 1 / len(task) + 1e-9
    assert record["held_out_accuracy"] >= 0.9


@pytest.fixture(scope="module")
def new_models():
    return {arch: load_trained_vim("shapes", arch=arch)[0] for arch in NEW_ARCHITECTURES}


@pytest.mark.parametrize("arch", NEW_ARCHITECTURES)
def test_every_method_gives_finite_task_pixel_maps(arch, new_models):
    task = held_out("shapes").subset(slice(0, 2))
    model = new_models[arch]
    methods = [m for m in image_methods() if m.applies_to(arch)]
    assert not any(m.group == "official" for m in methods)  # the official recipes read Vim's CLS token
    assert len(methods) == len(image_methods()) - 3
    for method in methods:
        maps = method.run(model, task.images, task.labels)
        assert maps.shape == (2, 32, 32) and bool(torch.isfinite(maps).all()), method.name
        if not method.class_agnostic and method.name != "LayerGradCam (last block)":
            assert float(maps.abs().sum()) > 0, method.name


@pytest.mark.parametrize("arch", NEW_ARCHITECTURES)
def test_grad_cam_sees_the_last_stages_feature_map_channels_first(arch, new_models):
    model = new_models[arch]
    view = _StageMapView(model)
    images = held_out("shapes").images[:3]
    seen = []
    handle = view.feature_map.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    with torch.no_grad():
        logits = view(images)
        assert torch.allclose(logits, on_task_pixels(model)(images), atol=1e-6)  # the hook changes nothing
    handle.remove()
    rows, cols = model.token_layout().stages[-1].grid
    channels = {"vmamba": 64, "mambaout": 64, "efficientvim": 48, "mambavision": 64}[arch]
    assert seen == [torch.Size((3, channels, rows, cols))]


def test_efficientvim_runs_on_upsampled_images_and_its_maps_come_back_averaged(new_models):
    model = new_models["efficientvim"]
    images = held_out("shapes").images[:2]
    big = model_pixels(model, images)
    assert big.shape == (2, 3, 128, 128)
    with torch.no_grad():
        assert torch.equal(Upsampled(model)(images), model(big))
    maps = torch.arange(2 * 128 * 128, dtype=torch.float64).reshape(2, 128, 128)
    small = task_pixels(maps)
    assert small.shape == (2, 32, 32) and float(small[1, 3, 5]) == float(maps[1, 12:16, 20:24].mean())
    mask = patch_feature_mask(model)  # one ablation feature per first-stage token: 4×4 task pixels
    assert mask.shape == (1, 1, 32, 32) and int(mask.max()) == 63 and int(mask[0, 0, 5, 9]) == 8 + 2


def test_the_report_puts_every_architecture_beside_vims():
    def row(arch, method, group, miou):
        return dict(arch=arch, task="shapes", method=method, group=group, seconds=1.0, examples=8,
                    clean_accuracy=1.0, pixel_accuracy=0.5, miou=miou, map=0.9, binary_auc=0.8,
                    positive_predicted=20.0, positive_target=20.0, negative_predicted=80.0, negative_target=80.0)
    record = dict(task="shapes", config=dict(num_classes=4, img_size=[128, 128]), held_out_accuracy=1.0,
                  held_out_examples=512, steps=200, train_seconds=9.0, parameters=1000)
    results = dict(models=[dict(record, family="efficientvim"), dict(record, config=dict(num_classes=4))],
                   rows=[row("vim", "Attribution (unified)", "ours", 0.5),  # a Vim row of before: no "arch"
                         row("vim", "UIA official (unified attribution)", "official", 0.4),
                         row("efficientvim", "Attribution (unified)", "ours", 0.3)])
    del results["rows"][0]["arch"]
    text = _tables(results)
    assert "| method | Vim | EfficientViM |" in text
    assert "| Attribution (unified) | 50.0 / 0.800 | 30.0 / 0.800 |" in text
    assert "| UIA official (unified attribution) | 40.0 / 0.800 | – |" in text
    assert "| EfficientViM | shapes | 4 | 128² (32² upsampled to 128²) | 100.0% (512) |" in text
    assert "<summary>EfficientViM: every score</summary>" in text


def test_scoring_one_architecture_keeps_the_others_rows_and_commands(tmp_path, monkeypatch):
    from mamba_captum.evaluation import vision, vision_compare

    def row(arch, method):
        return dict(arch=arch, task="digits", method=method, group="captum", seconds=1.0, examples=8,
                    clean_accuracy=1.0, positive_predicted=20.0, positive_target=20.0, negative_predicted=80.0,
                    negative_target=80.0, curves={k: [0.5] * 9 for k in (
                        "positive_predicted", "positive_target", "negative_predicted", "negative_target")})
    record = dict(task="digits", config=dict(num_classes=10), held_out_accuracy=1.0, held_out_examples=449,
                  steps=1, train_seconds=1.0, parameters=1)
    old_vim = row("vim", "Saliency")
    del old_vim["arch"]  # a row of the run before there were several architectures
    old_mambaout = row("mambaout", "stale")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "images.json").write_text(json.dumps(dict(
        models=[record, dict(record, family="mambaout")], rows=[old_vim, old_mambaout], command="vim's command",
        seconds=5.0)))
    doc = tmp_path / "doc.md"
    doc.write_text(f"{vision_compare.BEGIN}\n{vision_compare.END}\n")
    scored = []
    monkeypatch.setattr(vision_compare, "evaluate_images", lambda tasks, archs, **k: scored.append(archs) or dict(
        models=[dict(record, family=archs[0])], rows=[row(archs[0], "Saliency")]))
    monkeypatch.setattr(vision_compare, "example_figure", lambda *a, **k: None)
    vision.main(["--arch", "mambaout", "--doc", str(doc), "--assets", str(tmp_path / "assets")])
    assert scored == [["mambaout"]]
    results = json.loads((tmp_path / "assets" / "images.json").read_text())
    assert [(r.get("arch", "vim"), r["method"]) for r in results["rows"]] == [("vim", "Saliency"),
                                                                            ("mambaout", "Saliency")]
    assert results["commands"]["vim"] == dict(command="vim's command", seconds=5.0)
    assert results["commands"]["mambaout"]["command"].endswith("--arch mambaout --doc " + str(doc) + " --assets " +
                                                               str(tmp_path / "assets"))
    text = doc.read_text()
    assert "| Saliency | 20.0 / 80.0 | 20.0 / 80.0 |" in text and "Vim: `vim's command` (5.0 s)" in text
