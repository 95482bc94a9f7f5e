"""Evaluation metrics against hand-computed values: localisation, trapezoid, perturbation curves, segmentation."""
import math

import pytest
import torch

from mamba_captum.evaluation import metrics


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---------------------------------------------------------------------------------------------------------------
# A. Localisation
# ---------------------------------------------------------------------------------------------------------------

def brute_force_auc(scores, positive):
    """Independent check: mean over (positive, negative) pairs of [s+ > s-] + 0.5 [s+ == s-]."""
    pos = [s for s, p in zip(scores, positive) if p]
    neg = [s for s, p in zip(scores, positive) if not p]
    return sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))


def test_roc_auc_hand_case_with_ties_and_exclude():
    relevance = torch.tensor([[0.9, 0.1, 0.5, 0.5]])
    relevant = torch.tensor([[1, 0, 1, 0]])
    # pairs (0.9, 0.1)=1, (0.9, 0.5)=1, (0.5, 0.1)=1, (0.5, 0.5)=0.5 -> 3.5 / 4
    assert metrics.roc_auc(relevance, relevant).item() == pytest.approx(0.875)
    # excluding the tied negative leaves only the won pairs; excluding the low negative leaves one win, one tie
    assert metrics.roc_auc(relevance, relevant, torch.tensor([[0, 0, 0, 1]])).item() == pytest.approx(1.0)
    assert metrics.roc_auc(relevance, relevant, torch.tensor([[0, 1, 0, 0]])).item() == pytest.approx(0.75)


def test_roc_auc_extremes_and_undefined():
    relevant = torch.tensor([[1, 1, 0, 0]])
    assert metrics.roc_auc(torch.tensor([[4.0, 3.0, 2.0, 1.0]]), relevant).item() == 1.0
    assert metrics.roc_auc(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), relevant).item() == 0.0
    assert metrics.roc_auc(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), relevant).item() == 0.5
    assert math.isnan(metrics.roc_auc(torch.rand(1, 4), torch.ones(1, 4)).item())
    assert math.isnan(metrics.roc_auc(torch.rand(1, 4), torch.zeros(1, 4, dtype=torch.bool)).item())
    # excluding the only negative also leaves the example undefined
    assert math.isnan(metrics.roc_auc(torch.rand(1, 3), torch.tensor([[1, 1, 0]]), torch.tensor([[0, 0, 1]])).item())


def test_localisation_batch_equals_per_example():
    generator = torch.Generator().manual_seed(1)
    relevance = torch.round(torch.randn(5, 12, generator=generator) * 2) / 2  # coarse values -> many ties
    relevant = torch.rand(5, 12, generator=generator) < 0.4
    exclude = torch.zeros(5, 12, dtype=torch.bool)
    exclude[:, 0] = True
    relevant[:, 1], relevant[:, 2] = True, False  # every example has both classes
    batch = metrics.localisation_scores(relevance, relevant, exclude)
    assert set(batch) == {"roc_auc", "precision_at_k", "relevance_mass"}
    for b in range(5):
        single = metrics.localisation_scores(relevance[b:b + 1], relevant[b:b + 1], exclude[b:b + 1])
        for name in batch:
            torch.testing.assert_close(batch[name][b:b + 1], single[name], equal_nan=True)
        scored = ~exclude[b]
        assert batch["roc_auc"][b].item() == pytest.approx(
            brute_force_auc(relevance[b][scored].tolist(), relevant[b][scored].tolist()))
    assert batch["roc_auc"].dtype == torch.float64 and batch["roc_auc"].shape == (5,)


def test_precision_at_k_with_ties_is_the_expectation():
    relevance = torch.tensor([[0.9, 0.5, 0.5, 0.5, 0.1]])
    relevant = torch.tensor([[1, 0, 1, 0, 0]])
    # k = 2: 0.9 is relevant; one pick among three tied 0.5s, one of them relevant -> (1 + 1/3) / 2
    assert metrics.precision_at_k(relevance, relevant).item() == pytest.approx(2 / 3)
    # the result does not depend on where the relevant tied token sits
    assert metrics.precision_at_k(relevance, torch.tensor([[1, 0, 0, 1, 0]])).item() == pytest.approx(2 / 3)
    # perfect and worst rankings
    assert metrics.precision_at_k(torch.tensor([[3.0, 2.0, 1.0]]), torch.tensor([[1, 1, 0]])).item() == 1.0
    assert metrics.precision_at_k(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1, 0, 0]])).item() == 0.0
    # exclude changes k: without position 2, k = 1 and the top token (0.9) is relevant
    assert metrics.precision_at_k(relevance, relevant, torch.tensor([[0, 0, 1, 0, 0]])).item() == 1.0
    assert math.isnan(metrics.precision_at_k(relevance, torch.zeros(1, 5)).item())


def test_relevance_mass_uses_positive_part():
    relevance = torch.tensor([[2.0, -1.0, 1.0, 3.0]])
    relevant = torch.tensor([[1, 1, 0, 0]])
    # R+ = [2, 0, 1, 3]: 2 / 6
    assert metrics.relevance_mass(relevance, relevant).item() == pytest.approx(1 / 3)
    assert metrics.relevance_mass(relevance, relevant, torch.tensor([[0, 0, 0, 1]])).item() == pytest.approx(2 / 3)
    assert math.isnan(metrics.relevance_mass(torch.tensor([[-1.0, 0.0, -2.0, 0.0]]), relevant).item())


def test_localisation_bad_input_messages():
    with pytest.raises(ValueError, match=r"relevant has shape \(1, 3\).*\(1, 4\)"):
        metrics.roc_auc(torch.rand(1, 4), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"relevance\[None\]"):
        metrics.roc_auc(torch.rand(4), torch.ones(4))
    with pytest.raises(ValueError, match="0/1"):
        metrics.precision_at_k(torch.rand(1, 4), torch.tensor([[0.0, 0.3, 1.0, 0.0]]))
    with pytest.raises(ValueError, match="NaN"):
        metrics.relevance_mass(torch.tensor([[math.nan, 1.0]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="exclude has shape"):
        metrics.localisation_scores(torch.rand(2, 4), torch.ones(2, 4), torch.zeros(2, 5))


# ---------------------------------------------------------------------------------------------------------------
# B. Trapezoid
# ---------------------------------------------------------------------------------------------------------------

def test_trapezoid_known_values():
    x = torch.tensor([0.0, 0.5, 1.0])
    # y = x^2 at three points: 0.5 * (0 + 0.25) / 2 + 0.5 * (0.25 + 1) / 2
    assert metrics.trapezoid(x ** 2, x).item() == pytest.approx(0.375)
    # uneven spacing, batched y, no normalisation by the x range
    y = torch.tensor([[1.0, 1.0, 1.0], [0.0, 2.0, 0.0]])
    torch.testing.assert_close(metrics.trapezoid(y, torch.tensor([1.0, 2.0, 4.0])),
                               torch.tensor([3.0, 3.0], dtype=torch.float64))
    assert metrics.trapezoid(torch.tensor([5.0]), torch.tensor([0.3])).item() == 0.0
    with pytest.raises(ValueError, match="non-decreasing"):
        metrics.trapezoid(torch.ones(3), torch.tensor([0.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match="same N"):
        metrics.trapezoid(torch.ones(3), torch.ones(4))


# ---------------------------------------------------------------------------------------------------------------
# C. Perturbation curves with a bag-of-tokens model whose logits are sums of per-token weights
# ---------------------------------------------------------------------------------------------------------------

UNK = 0
TOKEN_WEIGHTS = torch.tensor([
    [0.0, 0.0],  # 0: [UNK], the replacement
    [2.0, 0.0],  # 1
    [1.0, 0.0],  # 2
    [0.0, 1.0],  # 3
    [0.0, 3.0],  # 4
])


def bag_of_tokens(input_ids):
    return TOKEN_WEIGHTS[input_ids].sum(1)


QUARTERS = [0.0, 0.25, 0.5, 0.75, 1.0]  # k = 0, 1, 2, 3, 4 of N = 4


def test_activation_curve_hand_values():
    input_ids = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    relevance = torch.tensor([[0.5, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    target = torch.tensor([0, 1])
    # example 0, most positive first with ties by position: pos 1 (id 2), pos 0 (id 1), pos 3 (id 4), pos 2 (id 3)
    # logits [0,0], [1,0], [3,0], [3,3], [3,4]; evidence of class 0 = sigmoid(l0 - l1)
    first = [0.5, sigmoid(1), sigmoid(3), 0.5, sigmoid(-1)]
    # example 1, all tied -> position order: id 4, 3, 2, 1 -> logits [0,0], [0,3], [0,4], [1,4], [3,4]; class 1
    second = [0.5, sigmoid(3), sigmoid(4), sigmoid(3), sigmoid(1)]
    expected = torch.tensor([(a + b) / 2 for a, b in zip(first, second)], dtype=torch.float64)
    for batch_size in (1, 3, 64):
        curve = metrics.activation_curve(bag_of_tokens, input_ids, relevance, target, UNK, fractions=QUARTERS,
                                         batch_size=batch_size)
        torch.testing.assert_close(curve, expected)
    single = metrics.activation_curve(bag_of_tokens, input_ids[:1], relevance[:1], target[:1], UNK,
                                      fractions=QUARTERS)
    torch.testing.assert_close(single, torch.tensor(first, dtype=torch.float64))
    # AUAC: trapezoid with step 0.25
    area = 0.25 * (first[0] / 2 + first[1] + first[2] + first[3] + first[4] / 2)
    assert metrics.auac(single, QUARTERS) == pytest.approx(area)


def test_pruning_curve_hand_values():
    input_ids = torch.tensor([[1, 2, 3, 4]])
    relevance = torch.tensor([[0.5, 2.0, -1.0, 0.5]])
    # |R| smallest first: pos 0 (id 1), pos 3 (id 4), pos 2 (id 3), pos 1 (id 2); clean logits [3, 4]
    # after removal: [1,4] -> 4, [1,1] -> 4 + 9, [1,0] -> 4 + 16, [0,0] -> 9 + 16
    curve = metrics.pruning_curve(bag_of_tokens, input_ids, relevance, torch.tensor([1]), UNK, fractions=QUARTERS)
    torch.testing.assert_close(curve, torch.tensor([0.0, 4.0, 13.0, 20.0, 25.0], dtype=torch.float64))
    assert metrics.au_mse(curve, QUARTERS) == pytest.approx(0.25 * (4 + 13 + 20 + 25 / 2))
    # the batch curve is the mean of the per-example curves
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 5, (3, 7), generator=generator)
    scores = torch.randn(3, 7, generator=generator)
    target = torch.tensor([0, 1, 0])
    batch = metrics.pruning_curve(bag_of_tokens, ids, scores, target, UNK, batch_size=4)
    per_example = torch.stack([metrics.pruning_curve(bag_of_tokens, ids[b:b + 1], scores[b:b + 1],
                                                     target[b:b + 1], UNK) for b in range(3)])
    torch.testing.assert_close(batch, per_example.mean(0))
    assert batch.shape == (11,)


def counting_class_zero(input_ids):
    """Class 0 logit = number of id-1 tokens left; class 1 is a constant 1.5, so class 0 wins with >= 2 left."""
    ones = (input_ids == 1).sum(1).double()
    return torch.stack([ones, torch.full_like(ones, 1.5)], 1)


DELETION_IDS = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2]])  # N = 10: step t removes exactly 10 t tokens
DELETION_RELEVANCE = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])


def test_deletion_curve_morf_lerf_and_auc_conventions():
    target = torch.tensor([0])
    morf = metrics.deletion_curve(counting_class_zero, DELETION_IDS, DELETION_RELEVANCE, target, UNK)
    # removing the 1s first: 3 and 2 left -> hit, then 1, 0 -> miss
    torch.testing.assert_close(morf, torch.tensor([1.0, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64))
    lerf = metrics.deletion_curve(counting_class_zero, DELETION_IDS, DELETION_RELEVANCE, target, UNK,
                                  most_relevant_first=False)
    # zeros go first (positions 4..9), then positions 3, 2, 1: at 9 tokens only one 1 is left
    torch.testing.assert_close(lerf, torch.tensor([1.0] * 8 + [0.0], dtype=torch.float64))
    # 9-point convention over x = 0.1..0.9: (0.1 + 0.05) and (0.7 + 0.05), times 100
    assert metrics.deletion_auc(morf) == pytest.approx(15.0)
    assert metrics.deletion_auc(lerf) == pytest.approx(75.0)
    # clean accuracy prepended at x = 0 adds the first interval (1 + 1) / 2 * 0.1
    assert metrics.deletion_auc(morf, clean_accuracy=1.0) == pytest.approx(25.0)
    assert metrics.deletion_auc(lerf, clean_accuracy=1.0) == pytest.approx(85.0)
    assert metrics.deletion_auc(morf, clean_accuracy=0.0) == pytest.approx(20.0)
    # batch mean: the second example's relevance is reversed, so its MoRF order is the first's LeRF order
    batch = metrics.deletion_curve(counting_class_zero, DELETION_IDS.repeat(2, 1),
                                   torch.cat([DELETION_RELEVANCE, -DELETION_RELEVANCE]), torch.tensor([0, 0]), UNK,
                                   batch_size=5)
    torch.testing.assert_close(batch, (morf + lerf) / 2)


class Recorder:
    """forward_func that remembers its inputs and returns constant logits."""

    def __init__(self):
        self.inputs = []

    def __call__(self, input_ids):
        assert not torch.is_grad_enabled()
        self.inputs.append(input_ids.clone())
        return torch.zeros(input_ids.shape[0], 2)

    def rows(self):
        return torch.cat(self.inputs)


def test_counts_are_ceil_of_fraction_times_free_tokens_and_fixed_positions_stay():
    # position 0 is the fixed query token and has the largest relevance: it must be neither ranked nor replaced
    input_ids = torch.arange(1, 12)[None]
    relevance = torch.cat([torch.tensor([100.0]), torch.arange(10.0)])[None]
    fixed = torch.zeros(1, 11, dtype=torch.bool)
    fixed[0, 0] = True
    target = torch.tensor([0])
    for fractions in (None, torch.linspace(0, 1, 11), torch.linspace(0, 1, 11, dtype=torch.float64)):
        # N = 10, so fraction i/10 changes exactly i tokens, also for float32 0.3 and 0.6
        recorder = Recorder()
        metrics.pruning_curve(recorder, input_ids, relevance, target, UNK, fixed=fixed, fractions=fractions)
        pruned = recorder.rows()[1:]  # the first call is the clean input
        assert (pruned == UNK).sum(1).tolist() == list(range(11))
        assert (pruned[:, 0] == 1).all()
        recorder = Recorder()
        metrics.activation_curve(recorder, input_ids, relevance, target, UNK, fixed=fixed, fractions=fractions)
        restored = recorder.rows()
        assert (restored[:, 1:] != UNK).sum(1).tolist() == list(range(11))
        assert (restored[:, 0] == 1).all()
        # most positive first: the tokens put back are the highest-relevance non-fixed ones (ids 11, 10, ...)
        assert restored[1].tolist() == [1] + [UNK] * 9 + [11]
    # N = 3 (three fixed): ceil(0.1 * 3) = 1, ceil(0.4 * 3) = 2, ceil(0.7 * 3) = 3, ceil(0.6 * 3) = 2
    fixed_three = torch.tensor([[True, False, True, False, True, False]])
    recorder = Recorder()
    metrics.deletion_curve(recorder, torch.arange(1, 7)[None], torch.zeros(1, 6), target, UNK, fixed=fixed_three)
    deleted = recorder.rows()
    assert (deleted == UNK).sum(1).tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert (deleted[:, [0, 2, 4]] == torch.tensor([1, 3, 5])).all()
    # ties in relevance are taken in position order
    assert deleted[0].tolist() == [1, UNK, 3, 4, 5, 6]
    # rows are chunked to batch_size
    recorder = Recorder()
    metrics.deletion_curve(recorder, torch.arange(1, 7)[None].repeat(5, 1), torch.zeros(5, 6),
                           torch.zeros(5, dtype=torch.long), UNK, batch_size=7)
    assert [len(chunk) for chunk in recorder.inputs] == [7] * 6 + [3]


def test_random_relevance_is_reproducible_uniform():
    first = metrics.random_relevance((3, 5), torch.Generator().manual_seed(7))
    second = metrics.random_relevance((3, 5), torch.Generator().manual_seed(7))
    assert torch.equal(first, second) and first.shape == (3, 5) and first.dtype == torch.float64
    assert ((first >= 0) & (first < 1)).all()
    assert metrics.random_relevance(4, torch.Generator().manual_seed(0)).shape == (4,)


def test_perturbation_bad_input_messages():
    ids, relevance, target = torch.tensor([[1, 2, 3]]), torch.rand(1, 3), torch.tensor([0])
    with pytest.raises(ValueError, match="relevance has shape"):
        metrics.activation_curve(bag_of_tokens, ids, torch.rand(1, 4), target, UNK)
    with pytest.raises(ValueError, match="integer"):
        metrics.pruning_curve(bag_of_tokens, ids.float(), relevance, target, UNK)
    with pytest.raises(ValueError, match="target must be a"):
        metrics.deletion_curve(bag_of_tokens, ids, relevance, torch.tensor([0, 1]), UNK)
    with pytest.raises(ValueError, match="2 logits"):
        metrics.deletion_curve(bag_of_tokens, ids, relevance, torch.tensor([2]), UNK)
    with pytest.raises(ValueError, match="nothing to perturb"):
        metrics.activation_curve(bag_of_tokens, ids, relevance, target, UNK, fixed=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        metrics.activation_curve(bag_of_tokens, ids, relevance, target, UNK, fractions=[0.0, 1.5])
    with pytest.raises(ValueError, match="class logits"):
        metrics.activation_curve(lambda x: torch.zeros(len(x)), ids, relevance, target, UNK)
    with pytest.raises(ValueError, match="replacement_id"):
        metrics.activation_curve(bag_of_tokens, ids, relevance, target, 0.0)
    with pytest.raises(ValueError, match="percentages"):
        metrics.deletion_auc(torch.full((9,), 80.0))
    with pytest.raises(ValueError, match="x values"):
        metrics.auac(torch.ones(5))
    with pytest.raises(ValueError, match="start above 0"):
        metrics.deletion_auc(torch.ones(3), steps=[0.0, 0.5, 1.0], clean_accuracy=1.0)


# ---------------------------------------------------------------------------------------------------------------
# D. Images
# ---------------------------------------------------------------------------------------------------------------

def test_segmentation_scores_hand_case_with_tied_ap():
    maps = torch.tensor([[[0.0, 0.5, 0.5, 1.0]]])
    masks = torch.tensor([[[0, 1, 0, 1]]])
    # mean 0.5 -> FG only at the last pixel: 3 of 4 correct; IoU BG 2/3, FG 1/2
    # AP over [1 - R', R'] vs [1 - mask, mask]: score 1 holds 2 positives (P 1, R 1/2); score 0.5 holds 2
    # positives and 2 negatives entering together (P 4/6, R 1): 1/2 + 1/2 * 2/3
    expected = {"pixel_accuracy": 0.75, "miou": 7 / 12, "map": 5 / 6}
    scores = metrics.segmentation_scores(maps, masks)
    assert scores == pytest.approx(expected)
    # min-max normalisation and the mean threshold make an affine rescaling irrelevant
    assert metrics.segmentation_scores(maps * 10 + 3, masks.bool()) == pytest.approx(expected)


def test_segmentation_scores_sum_over_the_dataset():
    maps = torch.tensor([[[0.0, 0.5, 0.5, 1.0]], [[1.0, 0.0, 0.0, 0.0]]])
    masks = torch.tensor([[[0, 1, 0, 1]], [[1, 0, 0, 0]]])
    # second image is perfect; pooled: accuracy 7/8, IoU BG (2+3)/(3+3), FG (1+1)/(2+1); AP 5/6 and 1
    scores = metrics.segmentation_scores(maps, masks)
    assert scores == pytest.approx({"pixel_accuracy": 7 / 8, "miou": (5 / 6 + 2 / 3) / 2, "map": (5 / 6 + 1) / 2})


def test_segmentation_scores_bilinear_upsampling():
    # 2x2 -> 4x4 bilinear (align_corners=False) turns each row [0, 1] into [0, 0.25, 0.75, 1]
    maps = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    masks = torch.tensor([[[0, 1, 1, 1]] * 4])
    # FG predicted at columns 2, 3: column 1 is wrong -> 12/16; IoU BG 4/8, FG 8/12
    # AP: score 1 -> 8 positives (P 1, R 1/2); 0.75 -> 4 pos + 4 neg (P 12/16, R 3/4); 0.25 -> 4 pos + 4 neg
    # (P 16/24, R 1): 1/2 + 1/4 * 3/4 + 1/4 * 2/3 = 41/48
    scores = metrics.segmentation_scores(maps, masks)
    assert scores == pytest.approx({"pixel_accuracy": 0.75, "miou": (1 / 2 + 2 / 3) / 2, "map": 41 / 48})
    perfect = metrics.segmentation_scores(maps, torch.tensor([[[0, 0, 1, 1]] * 4]))
    assert perfect == pytest.approx({"pixel_accuracy": 1.0, "miou": 1.0, "map": 1.0})


def test_binary_auc_symmetric_and_downsampled_masks():
    maps = torch.tensor([[[0.9, 0.1], [0.5, 0.5]]])
    masks = torch.tensor([[[1, 0], [1, 0]]])
    # flattened as the roc_auc hand case: 0.875; the inverted map scores 0.125 and is reported as 0.875
    assert metrics.binary_auc(maps, masks).item() == pytest.approx(0.875)
    assert metrics.binary_auc(-maps, masks).item() == pytest.approx(0.875)
    # a 4x4 mask is area-downsampled to 2x2: cells with 2 or 3 of 4 pixels foreground count, 1 of 4 does not
    large = torch.tensor([[[1, 1, 1, 0],
                           [0, 0, 0, 0],
                           [1, 1, 0, 0],
                           [1, 0, 0, 0]]])
    assert metrics.binary_auc(maps, large).item() == pytest.approx(0.875)
    # an image without foreground is NaN and skipped by the mean
    both = metrics.binary_auc(maps.repeat(2, 1, 1), torch.cat([masks, torch.zeros_like(masks)]))
    assert both[0].item() == pytest.approx(0.875) and math.isnan(both[1].item())
    assert metrics.mean_binary_auc(maps.repeat(2, 1, 1), torch.cat([masks, torch.zeros_like(masks)])) == \
        pytest.approx(0.875)


def test_image_bad_input_messages():
    with pytest.raises(ValueError, match="smaller than maps"):
        metrics.segmentation_scores(torch.rand(1, 4, 4), torch.ones(1, 2, 2))
    with pytest.raises(ValueError, match="smaller than maps"):
        metrics.binary_auc(torch.rand(1, 4, 4), torch.ones(1, 2, 2))
    with pytest.raises(ValueError, match="B = 2"):
        metrics.segmentation_scores(torch.rand(2, 2, 2), torch.ones(1, 2, 2))
    with pytest.raises(ValueError, match="0/1"):
        metrics.binary_auc(torch.rand(1, 2, 2), torch.full((1, 2, 2), 0.5))
    with pytest.raises(ValueError, match=r"maps\[None\]"):
        metrics.segmentation_scores(torch.rand(2, 2), torch.ones(2, 2))
