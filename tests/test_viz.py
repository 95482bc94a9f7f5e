"""Captum visualisation hand-offs: VisualizationDataRecord scaling and visualize_text rendering."""
import pytest
import torch
from captum.attr import visualization

import mamba_captum as mc


def test_records_are_scaled_to_unit_range_and_skip_padding():
    relevance = torch.tensor([[0.0, 2.0, -4.0, 1.0], [0.0, 0.0, 3.0, 1.5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    records = mc.to_visualization_record(relevance, [list("abcd"), list("wxyz")], attention_mask=mask,
                                         pred_class=["p", "q"], attr_class="c")
    assert len(records) == 2
    assert torch.allclose(records[0].word_attributions, torch.tensor([0.0, 0.5, -1.0, 0.25]))
    assert records[0].attr_score == pytest.approx(-1.0) and records[0].raw_input_ids == list("abcd")
    assert torch.allclose(records[1].word_attributions, torch.tensor([1.0, 0.5]))
    assert records[1].raw_input_ids == ["y", "z"] and records[1].pred_class == "q" and records[1].attr_class == "c"
    single = mc.to_visualization_record(torch.zeros(3), list("abc"))
    assert torch.equal(single.word_attributions, torch.zeros(3))
    with pytest.raises(ValueError, match="3 tokens"):
        mc.to_visualization_record(torch.zeros(4), list("abc"))


def test_visualize_text_renders_the_records():
    record = mc.to_visualization_record(torch.tensor([0.1, -0.5, 1.0]), ["the", "cat", "sat"])
    html = visualization.visualize_text([record], legend=False).data
    assert html.count("<mark") == 3 and "cat" in html
