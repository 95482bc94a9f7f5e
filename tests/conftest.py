import os

# Triton kernels run on CPU through Triton's interpreter (exact, slow); it is chosen when the kernels are defined,
# so before anything imports them. Run with TRITON_INTERPRET=0 on a CUDA machine to test the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One torch thread, in this process and in those the tests start (the CLI, the notebooks' kernels), unless
# OMP_NUM_THREADS says otherwise: the test models are tiny, a second thread gains nothing on them, and on a busy
# machine two threads wait for each other (a test of 3 s CPU took 65 s with two threads on 2 loaded cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))  # tiny_models

# HF logs a one-time "falling back to the PyTorch implementation" per kernel function on CPU; keep output readable.
transformers.logging.set_verbosity_error()
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also if torch was imported before this file


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the project's exactness measure)."""
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    return error / scale if scale > 0 else error


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _transformers_layers_off_fla_kernels():
    """With flash-linear-attention installed (the test extras install it), transformers sends its KDA and
    gated-delta-rule kernels to fla's Triton ones, even on a CPU, where they cannot run. The tests' own forwards of
    those HF models (their references) run inside ``mc.fla_on_cpu()``, which gives transformers' own torch bodies back:
    what they computed before fla was installed. The library enters it by itself around its own forwards;
    tests/test_fla_families.py checks that in a thread of its own, outside this context."""
    from mamba_captum.fla_cpu import fla_available, fla_on_cpu, import_fla_models

    if not fla_available():
        yield
        return
    import_fla_models()  # `import fla` registers fla's mamba / mamba2 / bitnet over transformers' own: undone
    with fla_on_cpu():
        yield
