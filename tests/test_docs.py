"""The docs site builds with --strict (broken links, bad docstrings fail) and the notebooks run as shipped."""
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_mkdocs_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "MambaAttribution" in api and "AttributionCallback" in api  # the reference came from the docstrings


def test_there_are_the_four_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["causal_lm_walkthrough.ipynb", "hybrid_jamba.ipynb", "quickstart.ipynb",
                                          "vision_vim.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    book = nbformat.read(path, as_version=4)
    NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for cell in book.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
    assert all(cell.outputs for cell in book.cells if cell.cell_type == "code" and "print(" in cell.source)


# what the README's opening paragraph calls each family of the adapter registry
README_INTRO_NAMES = {
    "mamba": ["Mamba,", "Jamba", "FalconH1"], "mamba2": ["Mamba-2", "Bamba", "Zamba2", "NemotronH", "Granite-4"],
    "rwkv": ["RWKV-4"], "recurrent_gemma": ["Griffin (RecurrentGemma)"], "vim": ["Vision Mamba (Vim)"], "vmamba": ["VMamba"], "mambavision": ["MambaVision"],
    "efficientvim": ["EfficientViM"], "mambaout": ["MambaOut"],
    "gated_deltanet": ["gated delta-nets", "Qwen3-Next", "Qwen3.5", "OLMo-hybrid", "LaraMini"],
    "kda": ["KDA", "Kimi Linear", "Bailing hybrid", "GLM-5-Next"], "lightning": ["MiniMax's lightning attention"],
    "mlstm": ["xLSTM"], "short_conv": ["LFM2 / LFM3's short convolutions"], "zamba": ["Zamba,"],
    "conv_attention": ["ZAYA"], "vision_short_conv": ["LFM3-VL's vision tower"],
    "packed_attention": ["LFM3-VL's vision tower"], "inkling": ["Inkling"], "inkling2": ["Inkling2"],
    "fla_gla": ["flash-linear-attention's models", "GLA"], "fla_retnet": ["RetNet"], "fla_hgrn": ["HGRN,"],
    "fla_hgrn2": ["HGRN-2"], "fla_linear_attn": ["linear attention"], "fla_lightnet": ["LightNet"],
    "fla_delta_net": ["DeltaNet"], "fla_gated_deltanet": ["gated DeltaNet"], "fla_kda": ["fla's KDA"],
    "fla_comba": ["Comba"], "fla_gated_deltaproduct": ["Gated DeltaProduct"], "fla_rwkv7": ["RWKV-7"],
    "fla_rwkv6": ["RWKV-6"], "fla_mamba": ["fla's Mamba"], "fla_mamba2": ["Mamba-2 layers"],
    "fla_precond_gated_deltanet": ["preconditioned gated DeltaNet"], "fla_precond_kda": ["DeltaNet and KDA"],
    "fla_gsa": ["gated slot attention (GSA)"], "fla_abc": ["ABC"], "fla_raven": ["Raven"], "fla_rodimus": ["Rodimus"],
    "fla_mom": ["MoM"], "fla_mesa_net": ["MesaNet"], "fla_cyfa": ["cyclic flow attention"],
    "fla_log_linear_mamba2": ["log-linear Mamba-2"],
}


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_opening_names_every_family(page):
    """The first paragraph of the README and of the docs' home page names every family the registry supports (a
    new family must be named there too)."""
    from mamba_captum.families.registry import FAMILY_MIXERS

    text = (ROOT / page).read_text(encoding="utf-8")
    opening = " ".join(text.split("\n\n")[1].split())  # the paragraph after the title, one line
    assert set(README_INTRO_NAMES) == set(FAMILY_MIXERS)
    missing = [name for names in README_INTRO_NAMES.values() for name in names if name not in opening]
    assert not missing, missing
