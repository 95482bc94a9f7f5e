"""Every fenced code block of README.md and docs/**/*.md runs as written.

Each block is classified by its info string:

- ``python``: the blocks of one file run in order in one namespace (like a notebook), in a fresh working directory
  per file. Hub ids given to ``from_pretrained`` are redirected to local stand-ins (``HUB_STAND_INS``); any other id
  that is not a local path fails the block.
- ``bash``: every command (the parts of a line between ``&&``, ``||``, ``;`` and ``|``) must match a prefix of
  ``BASH_COMMANDS``: the project's cheap CLI calls run, setup and expensive commands are listed as not run, and an
  unlisted command fails the block.
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
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot
import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from mamba_captum.demo import model_dir
from mamba_captum.demo.train import demo_config
from mamba_captum.evaluation.models import one_thread
from tiny_models import make_model

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


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


# -- hub ids -> local stand-ins -------------------------------------------------------------------------------------
def _demo_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(model_dir())


def _mamba_130m(directory: Path):
    """The demo model's architecture and tokenizer at mamba-130m's depth (random weights): the README reads layers
    5, 20 and 21, which the 2-layer demo model does not have."""
    tokenizer = _demo_tokenizer()
    config = demo_config(len(tokenizer))
    config.num_hidden_layers = 24
    torch.manual_seed(0)
    transformers.MambaForCausalLM(config).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _rwkv_4_169m(directory: Path):
    """A tiny random RWKV-4 causal LM with the demo tokenizer (its vocabulary sized to fit)."""
    tokenizer = _demo_tokenizer()
    make_model("rwkv", vocab_size=len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


HUB_STAND_INS = {
    "state-spaces/mamba-130m-hf": _mamba_130m,
    "RWKV/rwkv-4-169m-pile": _rwkv_4_169m,
}


# -- files a block reads as if downloaded -> stand-ins written into the block's working directory -------------------
def _vim_small_checkpoint(path: Path):
    """An official-format Vim-S checkpoint (random weights): what hustvl/Vim-small-midclstok publishes."""
    from mamba_captum.vision import vim_small

    torch.manual_seed(0)
    torch.save({"model": vim_small().state_dict(), "epoch": 300}, path)


def _photo(path: Path):
    """A real photograph: scikit-learn's sample image (a temple in China, 427×640)."""
    from PIL import Image
    from sklearn.datasets import load_sample_image

    Image.fromarray(load_sample_image("china.jpg")).save(path)


FILE_STAND_INS = {"vim_s_midclstok_80p5acc.pth": _vim_small_checkpoint, "photo.jpg": _photo}


def write_file_stand_ins(block: Block, workdir: Path):
    for name, make in FILE_STAND_INS.items():
        if name in block.source and not (workdir / name).exists():
            make(workdir / name)


@pytest.fixture(scope="session")
def stand_in_dirs(tmp_path_factory):
    """hub id -> local checkpoint directory, each built on first use."""
    built = {}

    def directory(hub_id: str) -> Path:
        if hub_id not in built:
            built[hub_id] = tmp_path_factory.mktemp(hub_id.replace("/", "--"))
            HUB_STAND_INS[hub_id](built[hub_id])
        return built[hub_id]

    return directory


def _from_pretrained_owners() -> list[type]:
    """The classes defining their own from_pretrained that a block can call (every Auto model class carries a copy;
    concrete model, tokenizer and config classes inherit the base classes' one)."""
    auto_models = [value for value in vars(modeling_auto).values() if isinstance(value, type)
                   and issubclass(value, modeling_auto._BaseAutoModelClass) and "from_pretrained" in vars(value)]
    return [*auto_models, transformers.AutoTokenizer, transformers.AutoConfig, transformers.PreTrainedModel,
            transformers.PreTrainedTokenizerBase, transformers.PretrainedConfig]


@pytest.fixture
def hub_redirect(monkeypatch, stand_in_dirs):
    """from_pretrained(hub id) loads the id's stand-in; local paths load as given; any other name fails the test
    (pytest.fail is not an Exception, so no except clause on the way swallows it)."""

    def local(name_or_path):
        if isinstance(name_or_path, os.PathLike) or Path(name_or_path).exists():
            return name_or_path
        if name_or_path in HUB_STAND_INS:
            return stand_in_dirs(name_or_path)
        pytest.fail(f"from_pretrained({name_or_path!r}): not a local path and no stand-in in HUB_STAND_INS")

    for owner in _from_pretrained_owners():
        original = vars(owner)["from_pretrained"].__func__

        def from_pretrained(cls, *args, _original=original, **kwargs):
            if args:
                args = (local(args[0]), *args[1:])
            else:  # the name given as a keyword
                kwargs["pretrained_model_name_or_path"] = local(kwargs["pretrained_model_name_or_path"])
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(owner, "from_pretrained", classmethod(from_pretrained))


# -- python blocks: one namespace per file ---------------------------------------------------------------------------
@dataclass
class Notebook:
    workdir: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__main__"})
    ran: set = field(default_factory=set)  # indices of the blocks that ran without error
    failed: Block | None = None


@pytest.fixture(scope="session")
def notebooks(tmp_path_factory):
    """file -> its Notebook (namespace and working directory), created on first use."""
    made = {}

    def notebook(path: str) -> Notebook:
        if path not in made:
            made[path] = Notebook(tmp_path_factory.mktemp(re.sub(r"\W", "_", path)))
        return made[path]

    return notebook


def execute(block: Block, namespace: dict):
    # Padding with blank lines makes the compiled line numbers those of the markdown file, so a traceback shows
    # the failing doc line.
    code = compile("\n" * (block.first_line - 1) + block.source, str(ROOT / block.path), "exec")
    exec(code, namespace)


def run_python(block: Block, notebook: Notebook):
    for earlier in BLOCKS:  # a block selected alone (pytest -k) still gets the names its predecessors define
        if earlier.path == block.path and earlier.info == "python" and earlier.index <= block.index \
                and earlier.index not in notebook.ran:
            if notebook.failed is not None:
                pytest.fail(f"{notebook.failed.name} failed, and this block runs in its namespace")
            try:
                execute(earlier, notebook.namespace)
            except BaseException:
                notebook.failed = earlier
                raise
            notebook.ran.add(earlier.index)


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


@pytest.fixture(scope="session")
def cli_results():
    """command words -> its CompletedProcess: a command written in several blocks (mamba-captum demo) runs once."""
    return {}


def run_bash(block: Block, workdir: Path, cli_results: dict):
    commands = shell_commands(block.source)
    assert commands, f"{block.name} has no command"
    # The environment's own scripts (mamba-captum, python) first, whether or not it was activated; one thread, as
    # for the python blocks.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    for command in commands:
        if classify(command) == RUN:
            key = tuple(command)
            if key not in cli_results:
                cli_results[key] = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                                                  timeout=300)
            done = cli_results[key]
            assert done.returncode == 0, f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}"


# -- text blocks ----------------------------------------------------------------------------------------------------
def check_text(block: Block):
    try:
        ast.parse(block.source)
    except SyntaxError:
        return
    pytest.fail(f"{block.name} has no info string but parses as Python: label it ```python")


# -- the tests -------------------------------------------------------------------------------------------------------
def test_every_fence_is_found():
    """The parser saw every fence line: each file has two per block (so no block escapes the test below)."""
    for path in DOC_FILES:
        fences = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if FENCE.match(line))
        assert fences == 2 * sum(1 for block in BLOCKS if block.path == str(path.relative_to(ROOT))), path
    assert any(block.path == "README.md" and block.info == "python" for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_doc_block_runs(block, notebooks, hub_redirect, cli_results, monkeypatch):
    notebook = notebooks(block.path)
    monkeypatch.chdir(notebook.workdir)
    write_file_stand_ins(block, notebook.workdir)
    if block.info == "python":
        matplotlib.use("Agg")  # plt.show() in a block must not open a window and wait
        # The models are tiny: on a busy machine two torch threads spend more time waiting for each other than
        # computing (a 4-token conv1d took milliseconds instead of 0.05 ms).
        try:
            with one_thread():
                run_python(block, notebook)
        finally:
            matplotlib.pyplot.close("all")
    elif block.info == "bash":
        run_bash(block, notebook.workdir, cli_results)
    elif block.info == "":
        check_text(block)
    else:
        pytest.fail(f"{block.name}: info string {block.info!r} is not classified (python, bash, or none for text)")
