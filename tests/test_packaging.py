"""The installed, non-editable wheel ships the kernels as mamba_captum.kernels (no top-level `kernels`), the
evaluation suite's tiny trained classifiers and the demo model."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_kernels_under_the_library_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True)
    wheel = next((tmp_path / "dist").glob("mamba_captum-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "mamba_captum/kernels/selective/blocked.py" in names
    assert "mamba_captum/kernels/ssd/naive.py" in names
    assert {"mamba_captum/kernels/taps.py", "mamba_captum/vision/modeling_vim.py", "mamba_captum/families/vim.py"} <= set(names)
    for task in ("shapes", "digits"):  # the image suite's tiny Vims, official checkpoint format
        assert {f"mamba_captum/evaluation/weights/vim-{task}/{f}" for f in ("vim.pth", "training.json")} <= set(names)
    assert not any(name.startswith("kernels/") for name in names)  # HF's kernel-hub package owns that name
    # every source module ships: pyproject's package list is explicit, and a package left out of it (a module split
    # into a package) would install a library that cannot import itself
    sources = {f"mamba_captum/{path.relative_to(ROOT / 'mamba_captum').as_posix()}"
               for path in (ROOT / "mamba_captum").rglob("*.py")}
    sources |= {f"mamba_captum/kernels/{path.relative_to(ROOT / 'kernels').as_posix()}"
                for path in (ROOT / "kernels").rglob("*.py")}
    assert {"mamba_captum/explain/images.py", "mamba_captum/operators/composite.py"} <= sources
    assert sorted(sources - set(names)) == []
    for shipped in ("config.json", "model.safetensors", "training.json"):  # the faithfulness suite's classifiers
        assert f"mamba_captum/evaluation/weights/rwkv-needle/{shipped}" in names
    for shipped in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json"):
        assert f"mamba_captum/demo/model/{shipped}" in names  # the demo model of `mamba-captum demo`
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    code = ("import mamba_captum, mamba_captum.vision, mamba_captum.kernels.selective as k, mamba_captum.kernels.ssd as s;"
            "import mamba_captum.cli, mamba_captum.explain, mamba_captum.evaluation.metrics;"
            "print(mamba_captum.__file__); print(k.selective_maps.__module__, s.ssd_maps.__module__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), *sys.path[1:]]))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True,
                         text=True).stdout.splitlines()
    assert out[0].startswith(str(target))  # the installed copy, not the source tree
    assert out[1] == "mamba_captum.kernels.selective mamba_captum.kernels.ssd"
