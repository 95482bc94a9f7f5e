"""The image faithfulness suite: the planted task, the perturbation metric by hand, the Grad-CAM view, and the
shipped tiny Vims (trained by ``python -m mamba_captum.evaluation.vision --train``)."""
import pytest
import torch

import mamba_captum as mc
from mamba_captum.evaluation import metrics
from mamba_captum.evaluation.images import (OBJECT_SIZE, RED, SHAPE_NAMES, load_digits, make_shapes,
                                            shape_stamp)
from mamba_captum.evaluation.vision_compare import _GridView, evaluate_images, image_methods
from mamba_captum.evaluation.vision_models import held_out, load_trained_vim, vision_accuracy


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
