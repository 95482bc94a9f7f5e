"""The inseq method "mamba_attention": inseq.load_model(model, "mamba_attention") returns our maps' rows."""
import inseq
import torch

import mamba_captum as mc
import mamba_captum.inseq_method  # noqa: F401  (registers the method)
from mamba_captum.demo import load_demo


def test_registered_and_equal_to_the_maps():
    assert "mamba_attention" in inseq.list_feature_attribution_methods()
    model, tokenizer = load_demo()
    attribution_model = inseq.load_model(model, "mamba_attention", tokenizer=tokenizer)
    out = attribution_model.attribute("the plot was not", generation_args={"max_new_tokens": 2},
                                      show_progress=False)
    (sequence,) = out.sequence_attributions
    scores = sequence.target_attributions  # (target length, steps, layers, 1 head)
    ids = torch.tensor([tokenizer.convert_tokens_to_ids([t.token for t in sequence.target])])
    maps = mc.as_hf_attentions(model, ids)
    length, steps = ids.shape[1], scores.shape[1]
    assert scores.shape == (length, steps, model.config.num_hidden_layers, 1)
    for step in range(steps):
        row = length - steps - 1 + step  # the position that predicts the step's token
        for layer, value in enumerate(maps):
            got = scores[:row + 1, step, layer, 0]
            assert torch.allclose(got, value[0, 0, row, :row + 1], atol=1e-6)
            assert torch.isnan(scores[row + 1:, step, layer, 0]).all()  # inseq's "not yet generated"
