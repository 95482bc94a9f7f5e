"""Imports run one way, bottom to top (docs/architecture.md): the import-linter contracts of pyproject.toml hold,
no module imports another module's private name, and ``import mamba_captum`` loads no application module."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, KERNELS = ROOT / "mamba_captum", ROOT / "kernels"
# what the package ships: source only (not the trained weights of the suite and the demo)
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "weights", "model")


def installed_layout(target: Path) -> Path:
    """A copy of the package as a wheel installs it, ``kernels/`` as ``mamba_captum/kernels`` (pyproject.toml's
    package-dir). import-linter (grimp) reads the modules from the package's directory, and an editable install
    maps ``mamba_captum.kernels`` from elsewhere, where grimp does not look."""
    shutil.copytree(PACKAGE, target / "mamba_captum", ignore=SKIP)
    shutil.copytree(KERNELS, target / "mamba_captum" / "kernels", ignore=SKIP)
    return target


def test_the_import_contracts_hold(tmp_path):
    source = installed_layout(tmp_path / "src")
    run = (f"import sys; sys.path.insert(0, {str(source)!r}); from importlinter.cli import lint_imports; "
           f"sys.exit(lint_imports({str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", run], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, f"broken import contracts (docs/architecture.md):\n{done.stdout}\n{done.stderr}"


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module the package installs (the kernels under mamba_captum.kernels)."""
    files = {}
    for root, package in ((PACKAGE, "mamba_captum"), (KERNELS, "mamba_captum.kernels")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = path
    return files


def private_imports(name: str, path: Path, modules: set[str]) -> list[str]:
    """``from M import _x`` in module ``name``, where M is another module of the package and _x is not a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")
            source = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source == name or not source.startswith("mamba_captum"):
            continue
        found += [f"{name}:{node.lineno}: from {source} import {alias.name}" for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__")
                  and f"{source}.{alias.name}" not in modules]  # a private module: the private_modules contract
    return found


def test_no_module_imports_a_private_name_of_another():
    files = module_files()
    assert "mamba_captum.kernels.ssd.blocked" in files  # the kernels are read too
    found = [line for name, path in sorted(files.items()) for line in private_imports(name, path, set(files))]
    assert not found, "private names imported across modules (make them public in the lower module):\n" + \
        "\n".join(found)


def test_importing_the_package_loads_no_adapter_zoo_or_application():
    # the facade's names load on first use (the engine, the attribution classes, the visualisation records), the
    # family adapters when a model needs them, the vision model zoo on first use of mamba_captum.vision, the
    # applications when used: `import mamba_captum` loads its version and nothing else (no torch)
    show = ("import sys, mamba_captum; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('mamba_captum', 'torch')))))")
    done = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True)
    loaded = set(done.stdout.split())
    assert loaded == {"mamba_captum", "mamba_captum._version"}
    from mamba_captum.families.registry import FAMILY_MIXERS
    adapters = tuple(f"mamba_captum.families.{family}" for family in FAMILY_MIXERS)
    assert "mamba_captum.families.mamba" in adapters
    not_at_import = ("mamba_captum.cli", "mamba_captum.callback", "mamba_captum.inseq_method", "mamba_captum.evaluation",
                     "mamba_captum.demo", "mamba_captum.explain", "mamba_captum.html_report", "mamba_captum.vision",
                     *adapters)
    assert not sorted(m for m in loaded
                      if m in not_at_import or m.startswith(tuple(name + "." for name in not_at_import)))
