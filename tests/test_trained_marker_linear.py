"""The trained marker-token sanity check of test_trained_marker.py for the linear token mixers of the faithfulness
suite: a tiny Qwen3-Next (gated delta-net layers only), a tiny LFM2 (short conv, attention, short conv) and a tiny
xLSTM (two mLSTM blocks), built
as the suite builds them (``mamba_captum.evaluation.models.new_classifier``), trained here on the same recall task
and explained on the same held-out sequences. The evidence for the answer is the marker and the recalled token
right after it; each method listed must rank that pair first, and must not on an untrained model of the same shape.
(A file of its own: the gated delta-net trains on HF's torch delta-rule fallback, about 30 s; the xLSTM on HF's
native chunkwise mLSTM, about 25 s.)"""
import pytest
import torch

import mamba_captum as mc
from mamba_captum.evaluation.models import new_classifier
from test_trained_marker import ANSWERS, LENGTH, sequences
from test_trained_marker_recurrent import _train, share

VOCAB = int(ANSWERS.max()) + 1


def linear_recall_model(family, steps=200):
    """The suite's tiny ``family`` classifier shape on the recall vocabulary, trained from seed 0. Eval mode."""
    return _train(new_classifier(family, VOCAB, LENGTH, seed=0), steps)


@pytest.fixture(scope="module")
def held_out():
    return sequences(32, torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def trained(held_out):
    models = {}

    def get(family):
        if family not in models:
            model = linear_recall_model(family)
            with torch.no_grad():
                logits = model(held_out[0], use_cache=False).logits[:, -1]
            accuracy = (logits.argmax(-1) == held_out[1]).float().mean().item()
            assert accuracy == 1.0, f"the tiny {family} model did not learn the task (held-out accuracy {accuracy})"
            models[family] = model
        return models[family]
    return get


# Hit rates measured at seed 0 (200 Adam steps, lr 3e-3; held-out accuracy 1.0 for all three), chance 2/9 ≈ 22 %:
#   family        default rule  residual rule  official  rollout abs_mean  raw attention
#   qwen3_next        72 %          78 %         34 %          94 %            66 %
#   lfm2              78 %         100 %         16 %         100 %           100 %
#   xlstm             97 %         100 %        100 %         100 %           100 %
# Untrained models of the same shape (seed 0), same column order: qwen3_next 19 / 19 / 28 / 16 / 19 %,
# lfm2 12 / 25 / 16 / 16 / 16 %, xlstm 12 / 12 / 6 / 28 / 59 %. The official recipe (positive part, no
# normalisation) stays near chance on Qwen3-Next and LFM2 and is checked on xLSTM only; every floor below is above
# its untrained score (the untrained xLSTM's raw attention, 59 %, included).
# Qwen3-Next's training (HF's torch delta-rule fallback) is the heavy profile's: about 15 s, as long as the rest of
# this file. The default profile keeps LFM2 and xLSTM here, and a trained Qwen3-Next classifier is explained on its
# planted needle in test_shipped_classifiers.py.
QWEN3_NEXT = pytest.mark.heavy


@pytest.mark.parametrize("family,method,options,floor", [
    pytest.param("qwen3_next", mc.MambaAttribution, {}, 0.6, marks=QWEN3_NEXT),
    pytest.param("qwen3_next", mc.MambaAttribution, {"gradient_rule": "residual"}, 0.65, marks=QWEN3_NEXT),
    pytest.param("qwen3_next", mc.MambaRollout, {"reduce": "abs_mean"}, 0.85, marks=QWEN3_NEXT),
    pytest.param("qwen3_next", mc.MambaRawAttention, {}, 0.55, marks=QWEN3_NEXT),
    ("lfm2", mc.MambaAttribution, {}, 0.65),
    ("lfm2", mc.MambaAttribution, {"gradient_rule": "residual"}, 0.9),
    ("lfm2", mc.MambaRollout, {"reduce": "abs_mean"}, 0.9),
    ("lfm2", mc.MambaRawAttention, {}, 0.9),
    ("xlstm", mc.MambaAttribution, {}, 0.85),
    ("xlstm", mc.MambaAttribution, {"gradient_rule": "residual"}, 0.9),
    ("xlstm", mc.MambaAttribution, {"recipe": "official"}, 0.9),
    ("xlstm", mc.MambaRollout, {"reduce": "abs_mean"}, 0.9),
    ("xlstm", mc.MambaRawAttention, {}, 0.9),
])
def test_the_marker_pair_is_ranked_first(trained, held_out, family, method, options, floor):
    rate = share(method, trained(family), held_out, options)
    assert rate >= floor, f"{family}: marker pair ranked first in {rate:.0%} of held-out sequences"


@pytest.mark.parametrize("family,method,options", [
    ("qwen3_next", mc.MambaRollout, {"reduce": "abs_mean"}),
    ("lfm2", mc.MambaRollout, {"reduce": "abs_mean"}),
    ("xlstm", mc.MambaRollout, {"reduce": "abs_mean"}),
    ("xlstm", mc.MambaAttribution, {}),
])
def test_an_untrained_model_does_not_pass_the_check(held_out, family, method, options):
    untrained = new_classifier(family, VOCAB, LENGTH, seed=0).eval()
    assert share(method, untrained, held_out, options) < 0.5
