"""as_hf_attentions: the implicit attention in HF's output_attentions layout, rendered by bertviz."""
import torch
from tiny_models import make_model

import mamba_captum as mc


def test_layout_is_one_head_per_decoder_layer():
    model = make_model("jamba").eval()  # 4 layers: Mamba, Mamba, attention, Mamba
    ids = torch.randint(3, 60, (2, 9))
    attentions = mc.as_hf_attentions(model, ids)
    maps = mc.implicit_attention(model, ids, reduce="abs_mean")
    assert len(attentions) == model.config.num_hidden_layers
    for layer, value in enumerate(attentions):
        assert value.shape == (2, 1, 9, 9)
        assert torch.equal(value[:, 0], maps[layer])
        assert torch.equal(value, value.tril())  # causal
    (probabilities,) = [a for a in model(ids, output_attentions=True).attentions if a is not None]
    softmax_layer = model.config.attn_layer_offset  # HF returns the softmax layer's heads; ours is their mean
    assert torch.allclose(attentions[softmax_layer][:, 0], probabilities.mean(1), atol=1e-6)


def test_bertviz_head_view_renders_it():
    from bertviz import head_view

    model = make_model("mamba").eval()
    ids = torch.randint(3, 60, (1, 6))
    tokens = [f"t{i}" for i in ids[0].tolist()]
    page = head_view(mc.as_hf_attentions(model, ids), tokens, html_action="return").data
    assert all(f'"{token}"' in page for token in tokens)
    assert page.count('"attn"') >= 1
