"""The adapter contract as code (mamba_captum.families.registry): every adapter satisfies it, a broken one is refused
by name and piece, and adapters load only when a model needs them."""
import copy
import pickle
import subprocess
import sys
import types

import pytest

from mamba_captum import families
from mamba_captum.families import registry
from mamba_captum.families.registry import Adapter, AdapterContractError, adapter_from_module, load_adapter


def test_every_registered_adapter_satisfies_the_contract():
    adapters = families.ADAPTERS
    assert set(adapters) == set(families.SUPPORTED_MIXERS) == set(registry.MIXER_FAMILIES)
    for class_name, adapter in adapters.items():
        assert isinstance(adapter, Adapter)
        assert class_name in adapter.MIXER_CLASSES == adapter.module.MIXER_CLASSES
        assert adapter.name == f"mamba_captum.families.{registry.MIXER_FAMILIES[class_name]}"
        assert (adapter.lrp is None) == (adapter.LRP_UNSUPPORTED is not None), adapter
    assert families.DEPTH_ATTENTION == {name for a in adapters.values() for name in a.DEPTH_ATTENTION_CLASSES}
    # optional pieces read from the module, absent ones defaulted
    assert load_adapter("rwkv").IGNORES_ATTENTION_MASK is True and load_adapter("mamba").IGNORES_ATTENTION_MASK is False
    assert load_adapter("rwkv").preserved_state is not None and load_adapter("mamba").preserved_state is None
    assert load_adapter("inkling").follows is not None and load_adapter("mamba").INNER_MIXERS == {}


def test_an_adapter_is_one_object_through_copies_and_pickles():
    adapter = load_adapter("mamba2")
    assert load_adapter("mamba2") is adapter
    assert copy.deepcopy(adapter) is adapter and pickle.loads(pickle.dumps(adapter)) is adapter
    located = families.LocatedMixer(0, "0.mixer", None, adapter)
    assert pickle.loads(pickle.dumps(located)).adapter is adapter


def _fake(**pieces):
    module = types.ModuleType("mamba_captum.families.fake")
    for name, value in pieces.items():
        setattr(module, name, value)
    return module


def _rebuild(call, formulation, components, work_dtype):
    return None


MAMBA_CLASSES = registry.FAMILY_MIXERS["mamba"]


@pytest.mark.parametrize("pieces, named", [
    (dict(MIXER_CLASSES=MAMBA_CLASSES, LRP_UNSUPPORTED="no rules"), "has no rebuild"),
    (dict(rebuild=_rebuild, LRP_UNSUPPORTED="no rules"), "has no MIXER_CLASSES"),
    (dict(MIXER_CLASSES=MAMBA_CLASSES, rebuild=_rebuild), "neither lrp"),
    (dict(MIXER_CLASSES=MAMBA_CLASSES, rebuild=lambda call: None, LRP_UNSUPPORTED="x"), "rebuild takes 1 arguments"),
    (dict(MIXER_CLASSES=MAMBA_CLASSES, rebuild=_rebuild, lrp="not callable"), "gives lrp = 'not callable'"),
    (dict(MIXER_CLASSES=list(MAMBA_CLASSES), rebuild=_rebuild, lrp=_rebuild), "gives MIXER_CLASSES"),
    (dict(MIXER_CLASSES=MAMBA_CLASSES, rebuild=_rebuild, lrp=_rebuild, NONCAUSAL="yes"), "gives NONCAUSAL = 'yes'"),
    (dict(MIXER_CLASSES=MAMBA_CLASSES, rebuild=_rebuild, lrp=_rebuild, INNER_MIXERS={"MambaMixer": "conv1d"}),
     "gives INNER_MIXERS"),
    (dict(MIXER_CLASSES=("MambaMixer",), rebuild=_rebuild, lrp=_rebuild), "the registry (mamba_captum/families"),
])
def test_a_broken_adapter_is_refused_naming_the_adapter_and_the_piece(pieces, named):
    with pytest.raises(AdapterContractError, match="mamba_captum.families.mamba") as raised:
        adapter_from_module("mamba", _fake(**pieces))
    assert named in str(raised.value)


def test_a_complete_fake_adapter_passes():
    adapter = adapter_from_module("mamba", _fake(MIXER_CLASSES=MAMBA_CLASSES, rebuild=_rebuild, lrp=_rebuild))
    assert adapter.rebuild is _rebuild and adapter.CONSUMES_ATTENTION is False and adapter.INNER_MIXERS == {}


def test_an_unknown_adapter_name_is_refused():
    with pytest.raises(KeyError, match="no adapter named 'selective'"):
        load_adapter("selective")
    assert registry.adapter_for("LlamaAttention") is None


def test_a_model_loads_only_its_own_adapters():
    run = """
import sys, torch
from transformers import MambaConfig, MambaForCausalLM
import mamba_captum
torch.manual_seed(0)
model = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, state_size=4, num_hidden_layers=2,
                                     intermediate_size=32, time_step_rank=2)).eval()
maps = mamba_captum.implicit_attention(model, torch.tensor([[1, 2, 3, 4]]))
print(len(maps), ' '.join(sorted(m for m in sys.modules if m.startswith('mamba_captum.families.'))))
"""
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, check=True)
    count, *loaded = done.stdout.split()
    assert count == "2"
    adapters = {f"mamba_captum.families.{family}" for family in registry.FAMILY_MIXERS}
    assert sorted(set(loaded) & adapters) == ["mamba_captum.families.mamba"]
