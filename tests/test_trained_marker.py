"""Sanity check on a model with a known answer: a tiny Mamba trained here (seconds) to recall the token that follows
a marker. The evidence for its answer is the marker and the recalled token right after it; MambaAttribution must
rank that pair first on held-out sequences."""
import pytest
import torch
import transformers as tf

import mamba_captum as mc

MARKER, QUERY, LENGTH = 2, 1, 10
ANSWERS = torch.tensor([12, 13, 14, 15])


def sequences(count, generator):
    ids = torch.randint(3, 10, (count, LENGTH), generator=generator)
    ids[:, -1] = QUERY
    where = torch.randint(0, LENGTH - 2, (count,), generator=generator)
    answer = ANSWERS[torch.randint(0, len(ANSWERS), (count,), generator=generator)]
    rows = torch.arange(count)
    ids[rows, where], ids[rows, where + 1] = MARKER, answer
    return ids, answer, where


def recall_config():
    return tf.MambaConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
                          time_step_rank=4, pad_token_id=0, tie_word_embeddings=False)


def train_recall_model(steps=200):
    """The tiny Mamba of this check, trained from seed 0 (also used by docs/assets/make_figures.py). Eval mode."""
    torch.manual_seed(0)
    model = tf.MambaForCausalLM(recall_config())
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids, answer, _ = sequences(64, generator)
        loss = torch.nn.functional.cross_entropy(model(ids).logits[:, -1], answer)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    model = train_recall_model()
    held_out = sequences(32, torch.Generator().manual_seed(1))
    with torch.no_grad():
        accuracy = (model(held_out[0]).logits[:, -1].argmax(-1) == held_out[1]).float().mean().item()
    assert accuracy == 1.0, f"the tiny model did not learn the task (held-out accuracy {accuracy})"
    return model, held_out


def hits(relevance, where):
    top = relevance[:, :-1].argmax(-1)  # the query token itself holds the residual path's share
    return ((top == where) | (top == where + 1)).float().mean().item()


# Measured at this seed: 84 % (default gradient × operator rule), 75 % (official recipe), 97 % (class-agnostic
# rollout of the abs-mean maps); an untrained model of the same shape scores at chance (2 of 9 tokens).
@pytest.mark.parametrize("method,options,floor", [
    (mc.MambaAttribution, {}, 0.8),
    (mc.MambaAttribution, {"recipe": "official"}, 0.7),
    (mc.MambaRollout, {"reduce": "abs_mean"}, 0.9),
])
def test_the_marker_pair_is_ranked_first(trained, method, options, floor):
    model, (ids, answer, where) = trained
    share = hits(method(model).attribute(ids, target=answer, **options), where)
    assert share >= floor, f"marker pair ranked first in {share:.0%} of held-out sequences"


def test_an_untrained_model_does_not_pass_the_check(trained):
    _, (ids, answer, where) = trained
    torch.manual_seed(0)
    untrained = tf.MambaForCausalLM(recall_config()).eval()
    assert hits(mc.MambaAttribution(untrained).attribute(ids, target=answer), where) < 0.5
