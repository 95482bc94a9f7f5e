"""The fenced code blocks of README.md and docs/**/*.md, and how a reader runs each one (used by the two
test_doc_blocks*.py files, which split the blocks between the two test workers).

Each block is classified by its info string:

- ``python``: the block alone, as a reader pastes it into a fresh interpreter after the install line: written to a
  file in an empty working directory and run by this environment's python in a new process, offline
  (``HF_HUB_OFFLINE=1``). Nothing in it is substituted. A block whose first line is ``# needs the HF hub`` is the
  real-world variant of an offline block beside it: it must name a hub checkpoint, and it is the only kind of block
  the test skips (the machines that run the tests have no hub).
- ``output``: what the python block just before it prints; the test compares the printed lines with it exactly
  (trailing spaces aside).
- ``bash``: every command (the parts of a line between ``&&``, ``||``, ``;`` and ``|``) must match a prefix of
  ``BASH_COMMANDS``: the project's cheap CLI calls run, setup and expensive commands are listed as not run, and an
  unlisted command fails the block. A block's commands run in order in an empty working directory that holds only a
  link to the package folder, as in the clone's root (where the README runs them), so a path such as
  ``mamba_captum/evaluation/weights/vim-shapes/vim.pth`` reads the clone's file and the outputs go to the directory.
- no info string: text (formulas, layouts). It must not parse as Python: such a block should be labelled ``python``.

Any other info string fails. Tracebacks of a python block point at its lines in the markdown file.
"""
from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
HUB_MARK = "# needs the HF hub"
# what a hub block must name: a from_pretrained / hf_hub_download of an "owner/name" id
HUB_ID = re.compile(r"""(from_pretrained|hf_hub_download)\(\s*["'][\w.-]+/[\w.-]+["']""")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    index: int  # position among the file's fenced blocks
    info: str  # the first word of the info string, "" when there is none
    source: str
    first_line: int  # 1-based line of the block's first content line in the file

    @property
    def name(self) -> str:
        return f"{self.path}-{self.index}-{self.info or 'text'}"

    @property
    def needs_hub(self) -> bool:
        return self.source.startswith(HUB_MARK)


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file (CommonMark fences: ``` or ~~~, closed by a fence at least as long)."""
    blocks, opening, lines = [], None, []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(line)
        if opening is None:
            if match:
                opening, lines, first = match, [], number + 1
        elif match and match["fence"][0] == opening["fence"][0] and len(match["fence"]) >= len(opening["fence"]) \
                and not match["info"].strip():
            info = opening["info"].split()[0] if opening["info"].strip() else ""
            blocks.append(Block(str(path.relative_to(ROOT)), len(blocks), info, "\n".join(lines) + "\n", first))
            opening = None
        else:
            lines.append(line[len(opening["indent"]):] if line.startswith(opening["indent"]) else line.lstrip())
    assert opening is None, f"{path}: a fence opened and never closed"
    return blocks


BLOCKS = [block for path in DOC_FILES for block in fenced_blocks(path)]
# the pages test_doc_blocks.py runs; test_doc_blocks_guides.py runs the others (one file per test worker)
FIRST_PAGES = ("README.md", "docs/methods/", "docs/quickstart.md", "docs/callback.md")


def on_first_pages(block: Block) -> bool:
    return block.path.startswith(FIRST_PAGES)


def expected_output(block: Block) -> Block | None:
    """The ``output`` block right after ``block`` in its file, if any."""
    after = [b for b in BLOCKS if b.path == block.path and b.index == block.index + 1]
    return after[0] if after and after[0].info == "output" else None


def reader_env() -> dict:
    """The environment of a reader's fresh interpreter: this environment's scripts first (as if activated),
    offline, one torch thread (two threads on 2 busy cores wait for each other on these tiny models), no plot
    window (plt.show() must not wait for one)."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg",
                PYTHONWARNINGS="default")


def run_python(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    """``block`` alone in a new interpreter, its working directory empty. Blank lines before the code make the
    file's line numbers those of the markdown file, so a traceback shows the failing doc line."""
    script = workdir / (re.sub(r"\W", "_", block.name) + ".py")
    script.write_text("\n" * (block.first_line - 1) + block.source, encoding="utf-8")
    return subprocess.run([sys.executable, script.name], cwd=workdir, env=reader_env(), capture_output=True,
                          text=True, timeout=300)


def check_python(block: Block, workdir: Path):
    if block.needs_hub:
        code = "\n".join(line.split("#")[0] for line in block.source.splitlines())  # a comment cannot qualify
        assert HUB_ID.search(code), f"{block.name} is marked {HUB_MARK!r} but its code loads no hub checkpoint"
        pytest.skip(f"{block.path}:{block.first_line}: needs the HF hub, which this machine has no access to "
                    "(the offline block beside it makes the same calls on a bundled model)")
    done = run_python(block, workdir)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stderr[-4000:]}"
    output = expected_output(block)
    if output is not None:
        printed = [line.rstrip() for line in done.stdout.strip().splitlines()]
        assert printed == [line.rstrip() for line in output.source.strip().splitlines()], \
            f"{block.name} printed\n{done.stdout}\nwhile the doc says\n{output.source}"


# -- bash blocks: an explicit list of what runs ----------------------------------------------------------------------
RUN, NOT_RUN = "run", "not run"
# (the command's first words, what the test does with it, why)
BASH_COMMANDS = [
    (("mamba-captum", "demo"), RUN, "the bundled demo model: seconds"),
    (("mamba-captum", "explain"), RUN, "one model, the texts given"),
    (("mamba-captum", "matrices"), RUN, "one model, the texts given"),
    (("python3", "-m", "venv"), NOT_RUN, "setup: the test runs in the environment it was installed in"),
    ((".", ".venv/bin/activate"), NOT_RUN, "setup"),
    (("pip", "install"), NOT_RUN, "setup"),
    (("command", "-v"), NOT_RUN, "setup: looks for Chromium before installing it"),
    (("apt-get",), NOT_RUN, "setup"),
    (("pytest",), NOT_RUN, "the whole test suite, this test included"),
    (("accelerate", "launch"), NOT_RUN, "several processes: tests/test_parallel.py launches them"),
    (("torchrun",), NOT_RUN, "several processes, as accelerate launch"),
    (("python", "benchmarks/bench_scale.py"), NOT_RUN, "benchmarks: minutes"),
    (("MAMBA_CAPTUM_HYPOTHESIS=long", "pytest"), NOT_RUN, "the property suite's long profile: many minutes"),
    (("python", "-m", "mamba_captum.evaluation"), NOT_RUN, "the faithfulness comparison: about an hour"),
    (("python", "-m", "mamba_captum.evaluation.train"), NOT_RUN, "training: minutes per model"),
    (("python", "-m", "mamba_captum.evaluation.vision"), NOT_RUN, "the image comparison (minutes) or training"),
]
SHELL_OPERATORS = {"&&", "||", ";", "|"}


def shell_commands(source: str) -> list[list[str]]:
    """The words of every command of a bash block, comments and subshell parentheses removed."""
    commands = []
    for line in source.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)  # operators and parentheses become tokens
        lexer.whitespace_split = True
        current = []
        for token in [*lexer, ";"]:
            if token in SHELL_OPERATORS:
                if current:
                    commands.append(current)
                current = []
            elif set(token) - set("()"):  # a run of parentheses only opens or closes subshells
                current.append(token)
    return commands


def classify(command: list[str]) -> str:
    for prefix, action, _why in BASH_COMMANDS:
        if tuple(command[:len(prefix)]) == prefix:
            return action
    pytest.fail(f"bash command {shlex.join(command)!r} is not in BASH_COMMANDS: add it, run or not run, and why")


def check_bash(block: Block, workdir: Path):
    commands = shell_commands(block.source)
    assert commands, f"{block.name} has no command"
    (workdir / "mamba_captum").symlink_to(ROOT / "mamba_captum", target_is_directory=True)  # the clone's root
    for command in commands:
        if classify(command) == RUN:
            done = subprocess.run(command, cwd=workdir, env=reader_env(), capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}"


# -- text blocks ----------------------------------------------------------------------------------------------------
def check_text(block: Block):
    try:
        ast.parse(block.source)
    except SyntaxError:
        return
    pytest.fail(f"{block.name} has no info string but parses as Python: label it ```python")


def check_block(block: Block, workdir: Path):
    """Run or check ``block`` as its info string says (module docstring)."""
    if block.info == "python":
        check_python(block, workdir)
    elif block.info == "bash":
        check_bash(block, workdir)
    elif block.info == "output":
        before = [b for b in BLOCKS if b.path == block.path and b.index == block.index - 1]
        assert before and before[0].info == "python", f"{block.name} follows no python block"
        assert not before[0].needs_hub, f"{block.name}: the output of a hub block is never checked; show it in text"
        # checked with that block
    elif block.info == "":
        check_text(block)
    else:
        pytest.fail(f"{block.name}: info string {block.info!r} is not classified (python, output, bash, or none "
                    "for text)")
