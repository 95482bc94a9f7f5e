"""The Triton map kernels (kernels/triton_maps.py and its three family wrappers) against the float64 references.

On CPU they run under TRITON_INTERPRET=1 (set in conftest.py); with TRITON_INTERPRET=0 on a CUDA machine the same
tests run the compiled kernels. L = 72 with 32-token tiles makes the rows 64..71 × columns 0..31 tile take the GEMM
path (every S6 column before every row, conv taps included); the tiles at the diagonal take the direct path.
"""
import os
import subprocess
import sys

import pytest
import torch
from conftest import relative_error

from mamba_captum.kernels.decay import decay_maps, decay_maps_naive, decay_maps_triton
from mamba_captum.kernels.dispatch import kernel_settings, use_triton
from mamba_captum.kernels.selective import selective_maps_naive, selective_maps_triton
from mamba_captum.kernels.ssd import ssd_maps, ssd_maps_naive, ssd_maps_triton
from mamba_captum.kernels.triton_maps import channel_decay_maps_triton

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
LENGTH = 72
LATE_ROWS = [71, 64, 66, 66, 70]  # all after column tile 0: GEMM tiles in the rows path too
MIXED_ROWS = [0, 71, 5, 40, 40, 33]
REDUCES = ["mean", "sum", "abs_mean", None]
TOLERANCE = 1e-5  # fp32 IEEE products, float64 exponents: measured ≤ 3e-7


def sweep(rows, reduces, weights, chosen):
    """``parametrize`` over every (rows, reduce, weights) combination (each axis a list of (id, value)), with the ids
    three stacked parametrize decorators gave them ("full-mean-all"). The default profile runs a pairwise subset,
    every value of each axis with every value of each other axis: the ``chosen`` axis (two values) takes the value
    (i + j) mod 2 of the other two axes' indices. The other combinations are marked heavy. Each kernel branch (every
    reduction, row / column / conv weights, the rows path, GEMM and direct tiles) still runs by default."""
    axes = {"rows": rows, "reduce": reduces, "weights": weights}
    assert len(axes[chosen]) == 2
    first, second = (name for name in axes if name != chosen)
    params = []
    for k, (row_id, row) in enumerate(rows):
        for i, (reduce_id, reduce) in enumerate(reduces):
            for j, (weight_id, weight) in enumerate(weights):
                index = {"rows": k, "reduce": i, "weights": j}
                default = index[chosen] == (index[first] + index[second]) % 2
                params.append(pytest.param(row, reduce, weight, id=f"{row_id}-{reduce_id}-{weight_id}",
                                           marks=() if default else pytest.mark.heavy))
    return pytest.mark.parametrize("rows,reduce,weights", params)


def _ids(values, ids=None):
    return list(zip(ids or [str(value) for value in values], values))


def _randn(*shape, scale=1.0):
    return torch.randn(*shape, dtype=torch.float64) * scale


def _on_device(kw):
    return {k: (v.float().to(DEVICE) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}


def _mamba1_inputs(weights, batch=2, channels=5, state=3, taps=4):
    inputs = dict(delta=torch.rand(batch, LENGTH, channels, dtype=torch.float64) * 0.5,
                  A=-torch.rand(channels, state, dtype=torch.float64) * 2, B=_randn(batch, LENGTH, state),
                  C=_randn(batch, LENGTH, state))
    if weights:
        inputs.update(row_weight=_randn(batch, LENGTH, channels), col_weight=_randn(batch, LENGTH, channels),
                      conv_weight=_randn(channels, taps))
    return inputs


@sweep(_ids([None, LATE_ROWS, MIXED_ROWS], ["full", "late_rows", "mixed_rows"]), _ids(REDUCES),
       _ids([False, True], ["hidden", "unified"]), chosen="weights")
def test_selective_triton_equals_reference(weights, reduce, rows):
    inputs = _mamba1_inputs(weights)
    expected = selective_maps_naive(**inputs, rows=rows, reduce=reduce)
    got = selective_maps_triton(**_on_device(inputs), rows=rows, reduce=reduce)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert relative_error(got.cpu(), expected) < TOLERANCE


def test_selective_triton_large_decays_stay_finite():
    # Σ delta·|A| reaches ~7000 over the sequence: factoring around a tile start would need exp(+thousands).
    inputs = _mamba1_inputs(True)
    inputs["delta"] = inputs["delta"] * 20
    inputs["A"] = inputs["A"] * 10
    expected = selective_maps_naive(**inputs, reduce="mean")
    got = selective_maps_triton(**_on_device(inputs), reduce="mean").cpu()
    assert torch.isfinite(got).all()
    assert relative_error(got, expected) < TOLERANCE


@sweep(_ids([None, LATE_ROWS], ["full", "late_rows"]), _ids(REDUCES), _ids(["none", "col", "all"]), chosen="rows")
def test_ssd_triton_equals_reference(weights, reduce, rows):
    batch, heads, groups, head_dim, state, taps = 2, 4, 2, 3, 5, 4
    inputs = dict(delta=torch.rand(batch, LENGTH, heads, dtype=torch.float64) * 0.5,
                  A=-torch.rand(heads, dtype=torch.float64) * 2, B=_randn(batch, LENGTH, groups, state),
                  C=_randn(batch, LENGTH, groups, state))
    if weights in ("col", "all"):
        inputs["col_weight"] = _randn(batch, LENGTH, heads, head_dim)
    if weights == "all":
        inputs.update(row_weight=_randn(batch, LENGTH, heads, head_dim), conv_weight=_randn(heads, head_dim, taps))
    expected = ssd_maps_naive(**inputs, rows=rows, reduce=reduce)
    got = ssd_maps_triton(**_on_device(inputs), rows=rows, reduce=reduce)
    assert got.shape == expected.shape
    assert relative_error(got.cpu(), expected) < TOLERANCE


def _rwkv_like(batch=2, channels=6, key_scale=30.0):
    """WKV pieces with large keys and the true row normaliser, so every α ≤ 1 (rows sum to 1)."""
    w = torch.rand(batch, LENGTH, channels, dtype=torch.float64) * 2
    k = _randn(batch, LENGTH, channels, scale=key_scale)
    u = _randn(batch, LENGTH, channels)
    S = w.cumsum(1)
    exponent = (k + S)[:, None] - S[:, :, None]  # k_j − (S_i − S_j), (B, i, j, C)
    strict = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(-1)[None, :, :, None]
    diag = (u + k)[:, :, None, :].expand(-1, -1, 1, -1)
    log_z = torch.logsumexp(torch.cat([exponent.masked_fill(~strict, float("-inf")), diag], 2), 2)
    return dict(log_decay=w, log_q=-log_z, log_k=k, log_diag=u + k - log_z)


@sweep(_ids([None, LATE_ROWS], ["full", "late_rows"]), _ids(REDUCES), _ids([False, True], ["hidden", "unified"]),
       chosen="weights")
def test_decay_triton_equals_reference_for_rwkv(weights, reduce, rows):
    inputs = _rwkv_like()
    if weights:
        inputs.update(row_weight=torch.rand(2, LENGTH, 6, dtype=torch.float64),
                      col_weight=_randn(2, LENGTH, 6), conv_weight=_randn(6, 3))
    expected = decay_maps_naive(**inputs, rows=rows, reduce=reduce)
    # the log-space pieces stay float64 (as DecayOperator keeps them); the kernel forms exponents in float64
    log_space = {k: v for k, v in inputs.items() if k.startswith("log_")}
    got = decay_maps_triton(**{**_on_device(inputs), **{k: v.to(DEVICE) for k, v in log_space.items()}},
                            rows=rows, reduce=reduce, out_dtype=torch.float32)
    assert torch.isfinite(got).all()
    assert relative_error(got.cpu(), expected) < TOLERANCE


@pytest.mark.parametrize("reduce", REDUCES)
def test_decay_triton_equals_reference_for_rg_lru_with_resets(reduce):
    batch, channels = 2, 6
    gate = torch.rand(batch, LENGTH, channels, dtype=torch.float64) * 0.9 + 0.05
    segments = torch.tensor([[0] * 20 + [1] * 30 + [2] * 22, [0] * LENGTH])
    inputs = dict(log_decay=-gate.log(), col_weight=(1 - gate ** 2).sqrt() * torch.rand_like(gate),
                  row_weight=_randn(batch, LENGTH, channels), conv_weight=_randn(channels, 4), segments=segments)
    expected = decay_maps_naive(**inputs, reduce=reduce)
    got = decay_maps_triton(**_on_device(inputs), reduce=reduce)
    assert relative_error(got.cpu(), expected) < TOLERANCE
    if reduce is not None:  # nothing crosses a reset (the conv may read 3 tokens back across it)
        assert got[0, 20:, :17].abs().max() == 0 and got[0, 50:, :47].abs().max() == 0


def test_tf32_mode_is_close_and_precision_is_checked():
    inputs = _on_device(_mamba1_inputs(True))
    ieee = selective_maps_triton(**inputs, reduce="mean")
    tf32 = selective_maps_triton(**inputs, reduce="mean", precision="tf32")
    assert relative_error(tf32, ieee) < 1e-2  # ~1e-3 on tensor cores; the interpreter computes it in fp32
    with pytest.raises(ValueError, match="precision"):
        selective_maps_triton(**inputs, reduce="mean", precision="fp16")


def test_empty_rows_and_bad_input():
    inputs = _on_device(_mamba1_inputs(False))
    assert selective_maps_triton(**inputs, rows=[], reduce="mean").shape == (2, 0, LENGTH)
    with pytest.raises(ValueError, match="rows must lie"):
        selective_maps_triton(**inputs, rows=[LENGTH], reduce="mean")
    with pytest.raises(ValueError, match="state size must be 1"):
        channel_decay_maps_triton(torch.zeros(1, 4, 2, dtype=torch.float64), torch.zeros(2, 3))


def test_dispatch_settings_and_restoration(monkeypatch):
    cpu, on_device = torch.zeros(2), torch.zeros(2, device=DEVICE)
    assert not use_triton(cpu)  # auto: CUDA only
    with kernel_settings(backend="triton", precision="tf32"):
        # float64 maps stay on the float64 torch kernels
        assert use_triton(on_device) and not use_triton(on_device.double())
        from mamba_captum.kernels.dispatch import precision
        assert precision() == "tf32"
        with monkeypatch.context() as patch:
            patch.setenv("TRITON_INTERPRET", "0")
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
                use_triton(cpu)
    assert not use_triton(cpu) and precision() == "ieee"
    with pytest.raises(ValueError, match="backend must be one of"):
        with kernel_settings(backend="cuda"):
            pass
    # float32 maps from float64 log-space pieces (DecayOperator) do go to Triton when asked
    inputs = _rwkv_like(batch=1, channels=2)
    with kernel_settings(backend="triton"):
        via_dispatch = decay_maps(**{k: v.to(DEVICE) for k, v in inputs.items()}, out_dtype=torch.float32)
    assert relative_error(via_dispatch.cpu(), decay_maps_naive(**inputs)) < TOLERANCE
    # a value weight after the conv: the Triton kernel takes none, the dispatcher splits the conv into its taps
    gate = torch.rand(1, LENGTH, 2, dtype=torch.float64) * 0.9 + 0.05
    inputs = dict(log_decay=-gate.log(), col_weight=(1 - gate ** 2).sqrt(), row_weight=_randn(1, LENGTH, 2),
                  conv_weight=_randn(2, 4), value_weight=_randn(1, LENGTH, 2))
    with kernel_settings(backend="triton"):
        via_dispatch = decay_maps(**_on_device(inputs), reduce="sum", out_dtype=torch.float32)
    assert relative_error(via_dispatch.cpu(), decay_maps_naive(**inputs, reduce="sum")) < TOLERANCE
    with kernel_settings(backend="triton"), pytest.raises(ValueError, match="value_weight applies to"):
        decay_maps(**_on_device(inputs), reduce="abs_mean", out_dtype=torch.float32)  # a tap split is no |·| of sums
    ssd = dict(delta=torch.rand(1, 12, 2), A=-torch.rand(2), B=torch.randn(1, 12, 1, 3), C=torch.randn(1, 12, 1, 3),
               conv_weight=torch.randn(2, 2, 4), value_weight=torch.randn(1, 12, 2, 2))
    with kernel_settings(backend="triton"), pytest.raises(ValueError, match="value_weight needs reduce"):
        ssd_maps(**{k: v.to(DEVICE) for k, v in ssd.items()}, reduce="abs_mean")  # as the blocked kernel refuses


# The interpreter's cost is per Mamba layer: the tiny Jamba's 3 Mamba layers take 12 s of CPU, the tiny Mamba-2's two
# layers 110 s. One Mamba layer (Jamba: a Mamba layer, an attention layer with the MoE block) runs the same kernels
# once; the full tiny models are the heavy repetition.
# Mamba-2 through the engine is heavy (60 s of CPU under the interpreter for one layer, either formulation): its SSD
# kernel against the reference is test_ssd_triton_equals_reference, the engine's dispatch to Triton the other rows.
BOTH = ("unified", "hidden")
ENGINE_MODELS = [pytest.param("mamba", dict(num_hidden_layers=1), BOTH, id="mamba"),
                 pytest.param("mamba2", dict(num_hidden_layers=1), BOTH, id="mamba2", marks=pytest.mark.heavy),
                 *(pytest.param(family, {}, BOTH, id=family) for family in ("rwkv", "recurrent_gemma")),
                 pytest.param("jamba", dict(num_hidden_layers=2, attn_layer_offset=1), BOTH, id="jamba"),
                 *(pytest.param(family, {}, BOTH, id=f"{family}-all_layers", marks=pytest.mark.heavy)
                   for family in ("mamba", "mamba2", "jamba"))]


@pytest.mark.parametrize("family,size,formulations", ENGINE_MODELS)
def test_engine_maps_through_triton_equal_the_torch_kernels(family, size, formulations):
    import mamba_captum as mc
    from test_rwkv_griffin import RESET_POSITIONS
    from tiny_models import VOCAB, make_model

    model = make_model(family, **size).to(DEVICE)
    ids = torch.randint(3, VOCAB, (2, 10)).to(DEVICE)
    kwargs = {"position_ids": RESET_POSITIONS[:, :10].to(DEVICE)} if family == "recurrent_gemma" else {}
    for formulation in formulations:
        with kernel_settings(backend="torch"):  # on CUDA "auto" would pick Triton too
            torch_maps = mc.implicit_attention(model, ids, formulation=formulation, **kwargs)
        with kernel_settings(backend="triton"):
            triton_maps = mc.implicit_attention(model, ids, formulation=formulation, **kwargs)
        assert set(triton_maps) == set(torch_maps)
        for layer in torch_maps:
            assert relative_error(triton_maps[layer], torch_maps[layer]) < TOLERANCE, (formulation, layer)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mamba_captum.kernels.triton_maps import _channel_decay_maps_kernel as kernel
pointers = dict(S="*fp64", A="*fp32", CQ="*fp32", BK="*fp32", LQ="*fp64", LK="*fp64", LDIAG="*fp64", ROW="*fp32",
                COL="*fp32", CONV="*fp32", ROWS="*i64", OUT="*fp32")
constants = dict(K=4, NP=16, BCH=4, BI=32, BJ=32, HAS_CB=True, HAS_LQ=False, HAS_LK=False, HAS_LDIAG=False,
                 HAS_ROW=True, HAS_COL=True, HAS_CONV=True, SHARED_RATE=False, MODE=0, PRECISION="ieee")
signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in kernel.arg_names}
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32))
print(len(compiled.asm["cubin"]))
from mamba_captum.kernels.selective_scan.triton import _scan_backward, _scan_forward
for kernel in (_scan_forward, _scan_backward):
    constants = dict(CHUNK=64, BD=16, NP=16)
    signature = {name: "constexpr" if name in constants else "i32" if name in ("D", "L", "N", "n_chunks", "n_blocks")
                 else "*fp32" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    print(len(compiled.asm["cubin"]))
"""


def test_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter does not type-check like the compiler does; compile the Mamba-1 reduced-map kernel and the
    # scan's forward and backward to sm_90 cubins (Triton ships ptxas): a kernel that only runs interpreted cannot
    # pass unnoticed.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = [int(size) for size in done.stdout.split()]
    assert len(sizes) == 3 and min(sizes) > 0


@pytest.mark.parametrize("reduce", ["sum", None])
def test_selective_value_weight_through_triton_equals_reference(reduce):
    from mamba_captum.kernels.selective import selective_maps

    inputs = _mamba1_inputs(True)
    values = _randn(2, LENGTH, 5)
    expected = selective_maps_naive(**inputs, value_weight=values, rows=MIXED_ROWS, reduce=reduce)
    with kernel_settings(backend="triton"):
        got = selective_maps(**_on_device(dict(inputs, value_weight=values)), rows=MIXED_ROWS, reduce=reduce)
    assert relative_error(got.cpu(), expected) < TOLERANCE


@pytest.mark.heavy  # 50 s of CPU under the interpreter; the selective kernel's own tests and the engine rows stay
def test_vim_maps_and_attribution_through_triton_equal_the_torch_kernels():
    import mamba_captum as mc
    from tiny_models import make_vim

    model = make_vim().to(DEVICE)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for formulation in ("unified", "hidden"):
        with kernel_settings(backend="torch"):  # on CUDA "auto" would pick Triton too
            torch_maps = mc.implicit_attention(model, pixels, formulation=formulation, reduce="abs_mean")
        with kernel_settings(backend="triton"):
            triton_maps = mc.implicit_attention(model, pixels, formulation=formulation, reduce="abs_mean")
        for layer in torch_maps:
            assert relative_error(triton_maps[layer].cpu(), torch_maps[layer].cpu()) < TOLERANCE, (formulation, layer)
    with kernel_settings(backend="torch"):
        expected = mc.MambaAttribution(model).attribute(pixels, target=2)
    with kernel_settings(backend="triton"):
        got = mc.MambaAttribution(model).attribute(pixels, target=2)
    assert relative_error(got.cpu(), expected.cpu()) < 1e-4
