"""README.md's and docs/methods/'s fenced blocks run as a reader runs them, each alone in a fresh interpreter
(tests/doc_blocks.py says how); test_doc_blocks_guides.py takes the other pages, so the two test workers share them."""
from __future__ import annotations

import re

import pytest
from doc_blocks import BLOCKS, DOC_FILES, FENCE, ROOT, check_block, on_first_pages


def test_every_fence_is_found():
    """The parser saw every fence line: each file has two per block (so no block escapes the tests)."""
    for path in DOC_FILES:
        fences = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if FENCE.match(line))
        assert fences == 2 * sum(1 for block in BLOCKS if block.path == str(path.relative_to(ROOT))), path
    assert any(block.path == "README.md" and block.info == "python" for block in BLOCKS)


def test_hub_blocks_stand_beside_offline_ones():
    """Only hub blocks may be skipped, and each page that has one also has an offline python block to run."""
    for path in {block.path for block in BLOCKS if block.needs_hub}:
        assert any(b.path == path and b.info == "python" and not b.needs_hub for b in BLOCKS), path


def test_a_hub_mark_needs_a_hub_download_in_the_code(tmp_path):
    """The mark skips a block only when its code (not a comment) loads a hub checkpoint."""
    from doc_blocks import Block, check_python

    fake = Block("x.md", 0, "python", '# needs the HF hub\n# from_pretrained("a/b")\nraise SystemExit(1)\n', 1)
    with pytest.raises(AssertionError, match="loads no hub checkpoint"):
        check_python(fake, tmp_path)


@pytest.mark.parametrize("block", [b for b in BLOCKS if on_first_pages(b)], ids=lambda block: block.name)
def test_doc_block_runs(block, tmp_path):
    check_block(block, tmp_path)


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with their own requirements (no extras), normalised names."""
    import importlib.metadata as metadata
    from packaging.requirements import Requirement

    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in seen or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(requirement.name) or []]
        except metadata.PackageNotFoundError:  # a requirement for another platform
            pass
    return seen


def test_every_python_block_imports_only_what_the_install_line_installs():
    """A reader runs the blocks after `pip install -e .`: the modules a block imports come from the package's own
    requirements (and theirs), unless the block names the extra it needs (`pip install -e ".[viz]"`)."""
    import ast
    import importlib.metadata as metadata
    import sys

    requires = metadata.requires("mamba-captum")
    base = _closure([r for r in requires if "extra ==" not in r]) | {"mamba-captum"}
    owners = metadata.packages_distributions()
    problems = []
    for block in BLOCKS:
        if block.info != "python" or block.needs_hub:
            continue
        allowed = set(base)
        for extra in re.findall(r'pip install -e "\.\[(\w+)\]"', block.source):
            allowed |= _closure([r.split(";")[0] for r in requires if f'extra == "{extra}"' in r])
        modules = {alias.name.split(".")[0] for node in ast.walk(ast.parse(block.source))
                   if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module.split(".")[0] for node in ast.walk(ast.parse(block.source))
                    if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        for module in sorted(modules - set(sys.stdlib_module_names)):
            dists = {d.lower().replace("_", "-") for d in owners.get(module, [])}
            if module != "mamba_captum" and not dists & allowed:
                problems.append(f"{block.name}: imports {module} ({', '.join(dists) or 'not installed'})")
    assert not problems, problems
