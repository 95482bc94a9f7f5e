"""The transformers range the library declares, and what a moved release must not do silently (issue 30).

- The installed transformers lies in the range ``pyproject.toml`` declares, and the README states the same range
  and the two ends the tests run on (``pytest`` on pip's newest, ``.ci/oldest`` on the lowest).
- transformers 5.24 renamed the cache keywords (``cache_params`` / ``past_key_values`` -> ``cache``; the old names
  warn until 5.40): every name continues a cached prefix the explanation cannot see, and each is refused.
- The library's own forward passes pass no deprecated keyword: no FutureWarning / DeprecationWarning reaches the
  user from a call on any family.
"""
import re
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from tiny_models import CONFIGS, LINEAR_CONFIGS, RECURRENT_CONFIGS, VOCAB, ZAMBA_CONFIGS, make_model

import mamba_captum as mc

ROOT = Path(__file__).resolve().parents[1]


def declared_transformers() -> str:
    """The transformers requirement of ``pyproject.toml``'s dependencies, as written (e.g. ``transformers>=5.23,<6``)."""
    text = (ROOT / "pyproject.toml").read_text()
    (line,) = re.findall(r'"(transformers[^"]*)"', text.split("[project.optional-dependencies]")[0])
    return line


def test_installed_transformers_is_in_the_declared_range_and_the_readme_says_the_same():
    written = declared_transformers()
    requirement = Requirement(written)
    installed = Version(version("transformers"))
    assert requirement.specifier.contains(installed), (installed, requirement)
    lowest = min(Version(spec.version) for spec in requirement.specifier if spec.operator == ">=")
    oldest_script = (ROOT / ".ci" / "oldest").read_text()
    assert f"transformers=={lowest}" in oldest_script  # .ci/oldest installs the declared lower end
    readme = (ROOT / "README.md").read_text()
    assert f"`{written}`" in readme
    assert f"transformers {lowest}" in readme  # the lowest tested version is named


@pytest.mark.parametrize("name", ["cache", "cache_params"])
def test_every_cache_keyword_is_refused(name):
    model = make_model("mamba")
    ids = torch.randint(3, VOCAB, (1, 8))
    output = model(ids[:, :4], use_cache=True)
    cache = getattr(output, "cache", None) or output.cache_params  # 5.24 renamed the field
    with pytest.raises(ValueError, match=f"{name}= continues a cached prefix"):
        mc.implicit_attention(model, ids[:, 4:], **{name: cache})
    with pytest.raises(ValueError, match=f"{name}= continues a cached prefix"):
        mc.MambaAttribution(model).attribute(ids[:, 4:], target=3, additional_forward_args={name: cache})


def test_past_key_values_of_a_hybrid_is_refused():
    model = make_model("qwen3_next")
    ids = torch.randint(3, VOCAB, (1, 8))
    output = model(ids[:, :4], use_cache=True)
    cache = getattr(output, "cache", None) or output.past_key_values
    with pytest.raises(ValueError, match="past_key_values= continues a cached prefix"):
        mc.implicit_attention(model, ids[:, 4:], past_key_values=cache)


FAMILIES = [*CONFIGS, *RECURRENT_CONFIGS, *LINEAR_CONFIGS, *ZAMBA_CONFIGS]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_deprecation_warning_from_the_library_s_own_calls(family):
    model = make_model(family)
    ids = torch.randint(3, VOCAB, (1, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if family != "glm5_next":  # its text model has no head: maps only
            mc.MambaAttribution(model).attribute(ids, target=3)
        mc.implicit_attention(model, ids)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecations, deprecations
