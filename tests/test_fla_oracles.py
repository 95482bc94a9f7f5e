"""flash-linear-attention's plain-torch references (``fla/ops/<op>/naive.py``, fla-core 0.6.0) as independent
oracles of the hidden maps: the gated delta rule (Qwen3-Next, Qwen3.5, Qwen4-Exp, OLMo-Hybrid), KDA (Kimi Linear,
Bailing-Hybrid, GLM-5-Next) and the constant-decay linear attention of MiniMax (fla's simple GLA).

Each oracle is run on what the HF layer itself computed (the arguments its kernel received, or its q / k read with
the test's own hook) with one-hot values: value channel s of token s is 1, so the oracle's output at token t, channel
s is the weight of token s in token t's output, α[t, s]. fla's references compute in float32; the maps come from
the float64 model. fla is installed with the test extras (the fla extra): with it, transformers sends its delta-rule
kernels to fla's Triton ones, which fail on a CPU, so the forwards run inside ``mc.fla_on_cpu()`` (transformers'
own torch bodies). The ``naive.py`` files are loaded by path, so that nothing of fla's Triton code is involved."""
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import relative_error
from test_linear_families import KERNEL_FUNCTIONS, KernelRecorder, linear_operators, make, mixers, padded_batch

import mamba_captum as mc

ORACLE_TOL = 1e-5  # fla's float32 recurrences against the float64 maps


@pytest.fixture(scope="module")
def fla_root() -> Path:
    """The installed ``fla`` package's folder (fla-core 0.6)."""
    import importlib.util as util
    return Path(util.find_spec("fla").origin).parent


def fla_naive(root: Path, op: str):
    """The module ``fla/ops/<op>/naive.py``, loaded by file path (the ``fla`` package itself is never imported)."""
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", root / "ops" / op / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_hot_values(batch: int, length: int, heads: int, dtype=torch.float32) -> torch.Tensor:
    """(B, L, H, L): value channel s of token s is 1."""
    return torch.eye(length, dtype=dtype).expand(batch, heads, length, length).permute(0, 2, 1, 3).contiguous()


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """HF's in-kernel l2 norm of queries and keys (``use_qk_l2norm_in_kernel``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kernel_inputs(args, kwargs):
    """(q, k, v, g, beta) as HF's delta-rule kernel saw them, q / k l2-normalised as it does, heads matched."""
    query, key, value = (a.float() for a in args[:3])
    if kwargs.get("use_qk_l2norm_in_kernel"):
        query, key = l2_normalised(query), l2_normalised(key)
    repeat = value.shape[2] // query.shape[2]
    return (query.repeat_interleave(repeat, 2), key.repeat_interleave(repeat, 2), value, kwargs["g"].float(),
            kwargs["beta"].float())


DELTA_RULE = {"torch_chunk_gated_delta_rule": ("gated_delta_rule", "naive_recurrent_gated_delta_rule"),
              "chunk_kimi_delta_attention": ("kda", "naive_recurrent_kda")}


def run_oracle(root, kernel, q, k, v, g, beta):
    op, name = DELTA_RULE[kernel]
    function = getattr(fla_naive(root, op), name)
    if op == "kda":  # (q, k, v, g, beta); g per key channel
        return function(q, k, v, g, beta)[0]
    return function(q, k, v, beta, g)[0]


@pytest.mark.parametrize("family", list(KERNEL_FUNCTIONS))
def test_delta_rule_maps_equal_fla_naive_recurrence_on_one_hot_values(family, fla_root):
    model = make(family, torch.float64)
    ids, mask = padded_batch(family=family)
    # fla_on_cpu first: with fla installed, transformers sends these kernels to fla's Triton ones, even on a CPU
    with mc.fla_on_cpu(), KernelRecorder(family) as recorder, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    operators = linear_operators(model, ids, mask, "hidden")
    assert len(recorder.calls) == len(operators) > 0
    kernel = KERNEL_FUNCTIONS[family][1]
    keep = (mask[:, None, :, None] * mask[:, None, None, :]).double()  # the maps zero pad rows and columns
    for (key, op), (args, kwargs, out) in zip(operators.items(), recorder.calls):
        q, k, v, g, beta = kernel_inputs(args, kwargs)
        batch, length, heads = v.shape[:3]
        oracle = run_oracle(fla_root, kernel, q, k, one_hot_values(batch, length, heads), g, beta)  # (B, L_t, H, L_s)
        alpha = op.maps(reduce=None)  # (B, H_v, L, L)
        assert relative_error(alpha, oracle.permute(0, 2, 1, 3).double() * keep) <= ORACLE_TOL, (family, key)
        # the oracle on the real values is HF's kernel output, and α v
        real = run_oracle(fla_root, kernel, q, k, v, g, beta).double()
        assert relative_error(torch.einsum("bhts,bshp->bthp", alpha, v.double()), real * mask[:, :, None, None]) \
            <= ORACLE_TOL, (family, key)
        assert relative_error(real, out.double()) <= ORACLE_TOL


def test_minimax_maps_equal_fla_simple_gla_on_one_hot_values(fla_root):
    model = make("minimax", torch.float64)
    ids, mask = padded_batch(family="minimax")
    lightning = [m for m in mixers(model) if type(m).__name__ == "MiniMaxLightningAttention"]
    seen = {}
    handles = [m.qkv_proj.register_forward_hook(lambda mod, args, out, m=m: seen.__setitem__(m, out.detach()))
               for m in lightning]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for handle in handles:
        handle.remove()
    operators = linear_operators(model, ids, mask, "hidden")
    assert len(operators) == len(lightning) > 0
    simple_gla = fla_naive(fla_root, "simple_gla").naive_recurrent_simple_gla
    for mixer, (key, op) in zip(lightning, operators.items()):
        # HF: act(qkv_proj(x)), pads zeroed, split per head into q, k, v; α[t, s] = (q_t · k_s) e^{−slope (t − s)}
        qkv = (mixer.act_fn(seen[mixer]) * mask[:, :, None]).float()
        qkv = qkv.reshape(*qkv.shape[:2], mixer.num_attention_heads, 3 * mixer.head_dim)
        q, k, _ = qkv.split(mixer.head_dim, dim=-1)
        batch, length, heads = q.shape[:3]
        g = (-mixer.slope_rate.reshape(1, 1, heads)).expand(batch, length, heads).float()
        oracle = simple_gla(q, k, one_hot_values(batch, length, heads), g, scale=1.0)[0]
        keep = (mask[:, None, :, None] * mask[:, None, None, :]).double()
        assert relative_error(op.maps(reduce=None), oracle.permute(0, 2, 1, 3).double() * keep) <= ORACLE_TOL, key
