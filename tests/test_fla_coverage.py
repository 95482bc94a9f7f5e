"""docs/families/fla.md against flash-linear-attention itself: every model type `fla.models` registers has a row,
each row's status is what the library does (supported: every mixer has an adapter; excluded: every mixer that is not
supported is refused with a reason; not yet: a mixer without an adapter, refused as not supported), and every
token-mixer layer fla exports is named by some row."""
from __future__ import annotations

import re
from pathlib import Path

import fla_models  # noqa: F401  (imports fla.models the library's way)
import pytest
from transformers import PretrainedConfig

import mamba_captum as mc
from mamba_captum.families import catalogue

PAGE = Path(__file__).resolve().parents[1] / "docs" / "families" / "fla.md"


def rows():
    text = PAGE.read_text()
    table = text.split("<!-- fla-model-types -->")[1].split("<!-- /fla-model-types -->")[0]
    found = {}
    for line in table.strip().splitlines()[2:]:
        model_type, mixers, status, notes = (cell.strip() for cell in line.strip("|").split("|"))
        found[model_type] = ([m.strip() for m in mixers.split(",")], status, notes)
    return found


def registered_model_types():
    import fla.models
    return {value.model_type for value in vars(fla.models).values()
            if isinstance(value, type) and issubclass(value, PretrainedConfig) and value is not PretrainedConfig}


def test_every_fla_model_type_has_a_row_and_no_row_is_stale():
    assert set(rows()) == registered_model_types()


@pytest.mark.parametrize("model_type", sorted(rows()))
def test_the_status_of_each_row_is_what_the_library_does(model_type):
    mixers, status, notes = rows()[model_type]
    supported = [m in mc.SUPPORTED_MIXERS for m in mixers]
    assert status in ("supported", "excluded", "not yet") and notes
    if status == "supported":
        assert all(supported), mixers
    elif status == "excluded":
        refused = [m for m, ok in zip(mixers, supported) if not ok]
        assert refused and all(catalogue.refusal(m) for m in refused), mixers
    else:
        assert not all(supported) and not any(catalogue.refusal(m) for m in mixers), mixers


def test_every_fla_layer_is_in_the_table_or_inside_a_listed_model():
    import fla.layers
    named = {m for mixers, _, _ in rows().values() for m in mixers}
    # layers no registered model type uses on its own: Based / ReBased (only in fla's hybrid configs), BitAttention's
    # relatives, the YOCO builders and MoM's experts are covered by the rows of the models that contain them
    unlisted = sorted(set(fla.layers.__all__) - named)
    assert set(unlisted) <= {"BasedLinearAttention", "ReBasedLinearAttention", "GatedDeltaNet2", "MomentumDeltaNet",
                             "SlidingWindowSharedKeyAttention", "YOCOGatedRetention", "YOCOSharedKVBuilder"}, unlisted


def test_the_page_names_the_install_line_and_the_context_manager():
    text = PAGE.read_text()
    assert 'pip install "mamba-captum[fla]"' in text and "mc.fla_on_cpu()" in text
    assert re.search(r"\| rwkv7 \| RWKV7Attention \| supported \|", text)
