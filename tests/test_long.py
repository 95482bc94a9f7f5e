"""Long sequences (issue 20): implicit_attention computes each decoder layer's maps as soon as the layer's forward
returned and drops what was recorded for it, so one layer's inputs and outputs are alive at a time; the maps are the
ones the operators of the whole forward give, in execution order."""
import pytest
import torch
from conftest import relative_error
from test_inkling import inkling_text
from tiny_models import make_model

import mamba_captum as mc
from mamba_captum.rebuild import MapStream


# a pure SSM, softmax layers, Zamba2's shared block ("{i}.shared_attention"), FalconH1's parallel sum, Inkling's
# parts after the MLP ("{i}.mlp_sconv")
@pytest.mark.parametrize("family", ["mamba", "jamba", "zamba2", "falcon_h1", "inkling"])
def test_streamed_maps_are_the_operators_maps_with_one_layer_alive(family, monkeypatch):
    model = inkling_text() if family == "inkling" else make_model(family)
    ids = torch.randint(3, 64, (2, 11))
    operators, _, _ = mc.build_operators(model, ids)
    expected = {key: operator.maps("mean", torch.tensor([3, 10])) for key, operator in operators.items()}
    alive = []
    streamed = MapStream.__call__

    def watched(self, trace, index):
        recorded = [call.located.layer for call in trace.mixer_calls if call.hidden_states is not None]
        alive.append((index, sorted(set(recorded))))
        return streamed(self, trace, index)

    monkeypatch.setattr(MapStream, "__call__", watched)
    maps = mc.implicit_attention(model, ids, rows=[3, -1])
    assert list(maps) == list(expected)  # the same keys, in execution order
    for key, value in expected.items():
        assert relative_error(maps[key], value) <= 1e-6, key
    # each time a layer is done, only that layer's recorded inputs are still held
    assert alive and all(layers in ([], [index]) for index, layers in alive)
