"""flash-linear-attention's log-linear Mamba-2 (``LogLinearMamba2``, model type ``log_linear_mamba2``) on a CPU.

fla runs the layer on CUDA only (its forward raises NotImplementedError elsewhere); inside fla_on_cpu() its own CUDA
code path runs with a torch conv and the torch ``chunk_log_linear_attn`` (mamba_captum.fla_cpu.ops_log_linear), which
equals fla's naive reference (outputs and gradients, float64) and carries fla's state layout across calls. The
operators (mamba_captum.families.fla_log_linear_mamba2) are checked against references built here from the layer's
recorded tensors: α through fla's naive op on one-hot values, the unified H from its factors, and the layer's output.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla_models import VOCAB, OpRecorder, fla_mixers, fla_models, padded_batch, run_hooked
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from fla.ops.log_linear_attn.naive import naive_log_linear_attn
from mamba_captum.fla_cpu import ops_log_linear
from mamba_captum.fla_cpu.ops_log_linear import chunk_log_linear_attn

CONFIGS = {
    # two groups of B, C (head h reads group h // 2), the conv's and in_proj's biases on (the default)
    "log_linear_mamba2": dict(head_dim=8, state_size=4, expand=2, n_groups=2),
    # D per channel, the gate after the norm
    "log_linear_mamba2_variant": dict(head_dim=8, state_size=4, expand=2, D_has_hdim=True, norm_before_gate=True),
    "log_linear_mamba2_no_norm": dict(head_dim=8, state_size=4, expand=2, rmsnorm=False, use_conv_bias=False),
}


def make_model(name: str, dtype=torch.float64, seed: int = 0):
    config = fla_models.LogLinearMamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0,
                                              bos_token_id=1, eos_token_id=2, fuse_cross_entropy=False,
                                              **CONFIGS[name])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every factor large enough to matter (fla's init leaves B, C and the skips tiny)
        for mixer in fla_mixers(model):
            for parameter_name, parameter in mixer.named_parameters():
                if (parameter.dim() == 2 and parameter_name.endswith("weight")) or parameter_name == "conv1d.weight":
                    parameter.normal_(0.0, 0.4, generator=generator)
                elif parameter_name in ("conv1d.bias", "in_proj.bias", "out_proj.bias", "D", "L"):
                    parameter.normal_(0.5 if parameter_name == "L" else 0.0, 0.3, generator=generator)
    return model


def op_inputs(length, batch=2, groups=1, heads=2, levels=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(q=randn(batch, length, groups, 4), k=randn(batch, length, groups, 4), v=randn(batch, length, heads, 3),
                g=-torch.rand(batch, length, heads, generator=g, dtype=torch.float64) * 0.1,
                level_scales=torch.rand(batch, length, heads, levels, generator=g, dtype=torch.float64) + 0.1)


def sliced(inputs, start, end):
    return {name: t[:, start:end] for name, t in inputs.items()}


# -- the op -----------------------------------------------------------------------------------------------------------
def test_the_op_equals_fla_naive_reference_with_gradients():
    """Two blocks of query rows (70 tokens, levels 0-7), two value heads per key group, a scale: outputs and the
    gradients of every input equal fla's naive_log_linear_attn in float64."""
    inputs = {n: t.requires_grad_() for n, t in op_inputs(70, groups=1, heads=2).items()}
    cotangent = torch.randn(2, 70, 2, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours, state = chunk_log_linear_attn(**inputs, scale=0.5)
    theirs = naive_log_linear_attn(**inputs, scale=0.5)
    assert state is None
    assert relative_error(ours, theirs) <= 1e-13
    ours_grads = torch.autograd.grad(ours, list(inputs.values()), cotangent)
    theirs_grads = torch.autograd.grad(theirs, list(inputs.values()), cotangent)
    for name, got, expected in zip(inputs, ours_grads, theirs_grads):
        assert expected.abs().max() > 0 and relative_error(got, expected) <= 1e-12, name


def test_the_state_has_fla_layout_and_continues_the_sequence():
    """The final state of 200 tokens (3 completed chunks of 64): level 0 holds chunk 2, level 1 chunks 0-1, both
    decayed to token 191; the 8 tokens after them are kept raw (the log decays before any sum); fla's 3 level slots
    and token count. Continued from states cut inside a chunk, at a chunk's end and one token at a time, the outputs
    equal the naive op over the whole sequence."""
    inputs = op_inputs(200, heads=2, levels=9)
    _, state = chunk_log_linear_attn(**inputs, output_final_state=True)
    q, k, v, g = (inputs[n] for n in ("q", "k", "v", "g"))
    cumulative = g.cumsum(1)

    def level_state(low, high):
        decay = (cumulative[:, 191:192] - cumulative[:, low:high]).exp()  # (B, S, H)
        return torch.einsum("bsk,bsh,bshv->bhkv", k[:, low:high, 0], decay, v[:, low:high])

    assert state.ht.shape == (2, 3, 2, 4, 3) and state.ht.dtype == torch.float64
    assert relative_error(state.ht[:, 0], level_state(128, 192)) <= 1e-13
    assert relative_error(state.ht[:, 1], level_state(0, 128)) <= 1e-13
    assert state.ht[:, 2].abs().max() == 0
    assert state.offsets.tolist() == [200, 200] and state.offsets.dtype == torch.int32
    for kept, name in zip((state.q_prev, state.k_prev, state.v_prev, state.g_prev, state.level_scales_prev),
                          ("q", "k", "v", "g", "level_scales")):
        assert kept.shape[1] == 64 and torch.equal(kept[:, :8], inputs[name][:, 192:]), name
        assert kept[:, 8:].abs().max() == 0, name

    expected = naive_log_linear_attn(**inputs)
    for cut in (37, 64, 130):
        first, state = chunk_log_linear_attn(**sliced(inputs, 0, cut), output_final_state=True)
        second, _ = chunk_log_linear_attn(**sliced(inputs, cut, 200), initial_state=state)
        assert relative_error(torch.cat([first, second], 1), expected) <= 1e-13, cut
    _, state = chunk_log_linear_attn(**sliced(inputs, 0, 126), output_final_state=True)
    steps = []
    for t in range(126, 131):  # across the end of chunk 1 (a carry from level 0 into level 1)
        out, state = chunk_log_linear_attn(**sliced(inputs, t, t + 1), initial_state=state, output_final_state=True)
        steps.append(out)
    assert relative_error(torch.cat(steps, 1), expected[:, 126:131]) <= 1e-13
    assert state.offsets.tolist() == [131, 131]


def test_packed_sequences_equal_each_sequence_alone():
    """cu_seqlens: outputs and final states (levels, token counts, partial chunks) equal each sequence run alone."""
    inputs = op_inputs(150, batch=1, heads=2, levels=9)
    bounds = [0, 70, 80, 150]
    packed, packed_state = chunk_log_linear_attn(**inputs, output_final_state=True,
                                                 cu_seqlens=torch.tensor(bounds))
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone, state = chunk_log_linear_attn(**sliced(inputs, start, end), output_final_state=True)
        assert relative_error(packed[:, start:end], alone) <= 1e-14
        levels = state.ht.shape[1]
        assert torch.equal(packed_state.ht[n, :levels], state.ht[0]) and packed_state.ht[n, levels:].abs().sum() == 0
        assert packed_state.offsets[n] == end - start
        assert torch.equal(packed_state.v_prev[n], state.v_prev[0])


def test_what_the_torch_versions_cannot_honour_is_refused_by_name():
    inputs = op_inputs(12, levels=4)  # 12 tokens use 5 levels
    with pytest.raises(ValueError, match="uses 5 levels; level_scales has 4"):
        chunk_log_linear_attn(**inputs)
    x, weight = torch.randn(1, 4, 6), torch.randn(4, 3)
    with pytest.raises(NotImplementedError, match="seq_idx"):
        ops_log_linear._causal_conv1d(x, weight, seq_idx=torch.zeros(1, 6, dtype=torch.int32))
    model = make_model("log_linear_mamba2")
    for mixer in fla_mixers(model):
        mixer.chunk_size = 32  # fla's own scan refuses it with a bare NotImplementedError
    with mc.fla_on_cpu(), pytest.raises(NotImplementedError, match="chunk_size=32"):
        model(torch.randint(3, VOCAB, (1, 8)), use_cache=False)


# -- the model on a CPU -----------------------------------------------------------------------------------------------
def test_the_model_trains_and_decodes_on_cpu_as_fla_naive_op_has_it():
    """fla's own forward refuses a CPU (the swap replaced it); inside fla_on_cpu() a training step's gradients equal
    those of the same step with the layer's op replaced by fla's naive reference, and cached one-token decoding (the
    op continuing its state, the conv its cache) equals the full forward."""
    model = make_model("log_linear_mamba2")
    ids, mask = padded_batch(length=10, left=False)
    mixer = fla_mixers(model)[0]
    with mc.fla_on_cpu():
        fla_forward = type(mixer).forward.__mamba_captum_original__
        with pytest.raises(NotImplementedError):
            fla_forward(mixer, torch.randn(1, 4, 32, dtype=torch.float64))
    layer_module = sys.modules[type(mixer).__module__]

    def gradients(naive: bool):
        model.zero_grad()
        model.train()
        with mc.fla_on_cpu():
            swapped = layer_module.chunk_log_linear_attn
            if naive:
                layer_module.chunk_log_linear_attn = lambda **kw: (naive_log_linear_attn(
                    **{n: kw[n] for n in ("q", "k", "v", "g", "level_scales", "scale")}), None)
            try:
                logits = model(input_ids=ids, attention_mask=mask).logits
                F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
            finally:
                layer_module.chunk_log_linear_attn = swapped
        model.eval()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours, theirs = gradients(naive=False), gradients(naive=True)
    for name, grad in ours.items():
        assert theirs[name].abs().max() > 0 and relative_error(grad, theirs[name]) <= 1e-12, name

    with mc.fla_on_cpu(), torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        out = model(input_ids=ids[:, :6], use_cache=True)
        steps = [out.logits]
        for t in range(6, 10):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits)
    assert relative_error(torch.cat(steps, 1), full) <= 1e-12


# -- the operators ----------------------------------------------------------------------------------------------------
def record(model, ids, mask):
    """Per mixer: its in_proj output, conv output (pre-activation, before the crop), out_proj input and the op call."""
    records, handles = [], []
    for mixer in fla_mixers(model):
        seen = {}
        records.append((mixer, seen))

        def keep(name, seen=seen, output=True):
            def hook(module, args, out=None):
                seen[name] = (out if output else args[0]).detach()
            return hook

        handles.append(mixer.in_proj.register_forward_hook(keep("in_proj")))
        handles.append(mixer.out_proj.register_forward_pre_hook(keep("out_in", output=False)))
    with OpRecorder(model, ["chunk_log_linear_attn"]) as recorder:
        run_hooked(model, ids, mask, handles)
    for (_, seen), (_, kwargs, out) in zip(records, recorder.calls):
        seen.update(op=kwargs, op_out=out)
    return records


def conv_band(taps, length):
    """(C, L, L) band of a depthwise causal conv with taps (C, K): band[c, i, j] = taps[c, K−1−(i−j)]."""
    channels, kernel = taps.shape
    band = torch.zeros(channels, length, length, dtype=taps.dtype)
    for i in range(length):
        for j in range(max(0, i - kernel + 1), i + 1):
            band[:, i, j] = taps[:, kernel - 1 - (i - j)]
    return band


def reference(mixer, seen, mask):
    """The references of one layer (float64) from its recorded tensors: α (b, H, L, L) over x after the conv, by
    fla's naive op on one-hot values times Δ_s; the unified H (b, H·P, L, L) over x before it; the out_proj input's
    parts."""
    d = lambda t: t.double()  # noqa: E731
    m = d(mask)[:, :, None]
    batch, length = mask.shape
    heads, head_dim, d_inner = mixer.num_heads, mixer.head_dim, mixer.intermediate_size
    z, xbc, dt, _ = d(seen["in_proj"]).split([d_inner, mixer.conv_dim, heads, heads * mixer.num_lambda_dims], -1)
    xbc = xbc * m
    conv = mixer.conv1d
    bias = torch.zeros(mixer.conv_dim, dtype=torch.float64) if conv.bias is None else d(conv.bias)
    band = conv_band(d(conv.weight[:, 0]), length)
    pre = torch.einsum("cij,bjc->bic", band, xbc) + bias
    x_post = (F.silu(pre) * m)[..., :d_inner]
    delta = F.softplus(dt + d(mixer.dt_bias))
    kwargs = seen["op"]
    eye = torch.eye(length, dtype=torch.float64)[None, :, None, :].expand(batch, length, heads, length)
    impulse = naive_log_linear_attn(d(kwargs["q"]), d(kwargs["k"]), eye.contiguous(), d(kwargs["g"]),
                                    d(kwargs["level_scales"]), scale=kwargs["scale"])  # (b, t, H, s)
    alpha = impulse.permute(0, 2, 1, 3) * delta.transpose(1, 2)[:, :, None, :]
    per_channel = alpha.repeat_interleave(head_dim, dim=1)
    D = d(mixer.D) if mixer.D_has_hdim else d(mixer.D).repeat_interleave(head_dim)
    y = torch.einsum("bcij,bjc->bic", per_channel, x_post) + D * x_post
    gate = F.silu(z)
    row = gate
    if mixer.norm is not None:
        norm = mixer.norm
        normed = y if norm.norm_before_gate else y * gate
        grouped = normed.reshape(*normed.shape[:2], -1, norm.group_size)
        nu = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.eps).expand_as(grouped).reshape(y.shape)
        row = nu * d(norm.weight) * gate
    column = torch.sigmoid(pre[..., :d_inner]) * m
    unified = torch.einsum("bic,bcij,bjc,cjs->bcis", row, per_channel, column, band[:d_inner])
    bias_share = row * torch.einsum("bcij,bjc->bic", per_channel, column * bias[:d_inner])
    return dict(x=xbc[..., :d_inner], values=x_post, alpha=alpha, unified=unified, bias_share=bias_share,
                skip_share=row * D * x_post, out_in=d(seen["out_in"]))


def masked_maps(maps, mask):
    m = mask.double()
    return maps * (m[:, :, None] * m[:, None, :])[:, None]


def operators_of(model, ids, mask, formulation):
    operators, _, _ = mc.build_operators(model, ids, mask, formulation=formulation)
    return list(operators.values())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_maps_equal_the_references_and_the_references_reproduce_the_layer(name):
    """Left padding included (fla does not unpad: the padded row is what the layer computed)."""
    model = make_model(name)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    hidden, unified = operators_of(model, ids, mask, "hidden"), operators_of(model, ids, mask, "unified")
    records = record(model, ids, mask)
    assert len(hidden) == len(unified) == len(records) == 2
    real_rows = mask.bool()
    for op_hidden, op_unified, (mixer, seen) in zip(hidden, unified, records):
        ref = reference(mixer, seen, mask)
        assert relative_error(op_hidden.maps(reduce=None), masked_maps(ref["alpha"], mask)) <= 1e-10, name
        assert relative_error(op_unified.maps(reduce=None), masked_maps(ref["unified"], mask)) <= 1e-10, name
        # the real layer: out_proj's input = H x + the conv bias's share + the D skip's share
        rebuilt = torch.einsum("bcis,bsc->bic", op_unified.maps(reduce=None), ref["x"])
        expected = ref["out_in"] - ref["bias_share"] - ref["skip_share"]
        assert relative_error(rebuilt[real_rows], expected[real_rows]) <= 1e-10, name
        assert ref["skip_share"].abs().max() > 1e-2
        assert mixer.conv1d.bias is None or ref["bias_share"].abs().max() > 1e-2
        # the hidden operator's values and output are the layer's (the op's output is α · x)
        assert relative_error(op_hidden.values.reshape(ref["values"].shape), ref["values"]) <= 1e-12
        values = ref["values"].reshape(op_hidden.values.shape)
        assert relative_error(torch.einsum("bhts,bshp->bthp", ref["alpha"], values), seen["op_out"].double()) <= 1e-12
    assert_untouched(model, before)


def test_float32_models_reproduce_the_layer():
    model = make_model("log_linear_mamba2", torch.float32)
    ids, mask = padded_batch(length=12)
    for op, (mixer, seen) in zip(operators_of(model, ids, mask, "unified"), record(model, ids, mask)):
        ref = reference(mixer, seen, mask)
        rebuilt = torch.einsum("bcis,bsc->bic", op.maps(reduce=None).double(), ref["x"])
        expected = ref["out_in"] - ref["bias_share"] - ref["skip_share"]
        assert relative_error(rebuilt[mask.bool()], expected[mask.bool()]) <= 3e-5


def test_batch_equals_single_examples_with_right_padding():
    """Right padding changes nothing. Left padding moves the real tokens to other absolute positions, hence other
    Fenwick levels: fla's layer itself then gives the row other outputs than the same tokens alone."""
    model = make_model("log_linear_mamba2")
    ids, mask = padded_batch(length=12, left=False)
    for formulation in ("hidden", "unified"):
        batched = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
        for b in range(2):
            real = mask[b].bool()
            single = mc.implicit_attention(model, ids[b:b + 1, real], formulation=formulation)
            for key in batched:
                assert relative_error(batched[key][b][real][:, real], single[key][0]) <= 1e-12, (formulation, key)
    left_ids, left_mask = padded_batch(length=12)
    with mc.fla_on_cpu(), torch.no_grad():
        padded = model(input_ids=left_ids, attention_mask=left_mask).logits[0, 3:]
        alone = model(input_ids=left_ids[:1, 3:]).logits[0]
    assert relative_error(padded, alone) > 1e-3
