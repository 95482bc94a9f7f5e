"""Inkling (inkling_text, inkling_mm_model's language model), Inkling2 (inkling2_text) and Inkling2-Loop
(inkling2_loop_text, transformers >= 5.24): mamba_captum.families.inkling and .inkling2.

Each decoder layer has two token mixers: the attention branch, explained as the composition of the attention (the
probabilities over the convolved, for Inkling2 normalised and gated, values) with the convolution after o_proj,
over the D·C paths d ← c; and the convolution after the MLP, a band of its own under "{i}.mlp_sconv" /
"{i}.post_mlp_convolution". Checked against the test's own hooks: y = Σ_c W_o[d, c] · H_{d,c} x_c against the
real output of the convolution after o_proj, y = H u against the real output of the one after the MLP, float64 and
float32, unified and hidden; reductions and query rows against the paths; gradient × operator against the dense
paths; padding, batching, the three Captum classes (and rollout against the maps, one step per mixer in execution
order), where the convolutions are located, and what is refused. Inkling2's two layouts of the value path (5.23: on
the attention; 5.24: inside its key/value and gated output projections) are read from the modules, in the adapter
and in these tests alike. Inkling2-Loop runs its loop layers once per pass: every test runs per decoder-layer call
(the maps' keys, in execution order), its tensors taken from the hooks of that call.
"""
from __future__ import annotations

import pickle

import pytest
import torch
import transformers as tf
from conftest import relative_error
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import mamba_captum as mc
from mamba_captum import families

V = 64
BOUND = {torch.float64: 1e-5, torch.float32: 3e-5}
LENGTH, PADS = 12, 3
HAS_LOOP = "inkling2_loop" in tf.CONFIG_MAPPING
LOOP = pytest.param("inkling2_loop_text", marks=pytest.mark.skipif(
    not HAS_LOOP, reason="inkling2_loop is new in transformers 5.24"))


def _build(config, dtype):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager").eval()


def _inkling_options(**kw):
    options = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                   sliding_window_size=6, d_rel=4, rel_extent=8, conv_kernel_size=3, intermediate_size=64,
                   moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"],
                   log_scaling_n_floor=4, pad_token_id=0)
    options.update(kw)
    return options


def _liven_convolutions(model):
    """Taps of a trained size (HF initialises Conv1d uniformly in ±1/√K, and Inkling2's static taps to 0)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "sconv" in name or "convolution" in name:
                parameter.normal_(0.0, 0.3)
            if name.endswith(("attention_input.query", "mlp_input.query", "message_input.query")):
                parameter.normal_(0.0, 0.5)  # depth attention that is not uniform (it mixes layers, not tokens)
            if "message_gate" in name:
                parameter.normal_(0.0, 0.5)  # messages that change the looped layers' inputs
    return model


def inkling_text(dtype=torch.float32, **kw):
    model = _build(tf.AutoConfig.for_model("inkling_text", **_inkling_options(**kw)), dtype)
    model.config._attn_implementation = "sdpa"  # HF's eager softmax gives NaN rows at left pads in float64
    return _liven_convolutions(model)


def inkling_mm_model(dtype=torch.float32, **kw):
    config = tf.AutoConfig.for_model("inkling_mm_model", text_config=dict(model_type="inkling_text",
                                                                         **_inkling_options(**kw)))
    model = _build(config.get_text_config(), dtype)
    model.config._attn_implementation = "sdpa"
    return _liven_convolutions(model)


INKLING2_OPTIONS = dict(vocab_size=V, unpadded_vocab_size=V, hidden_size=32, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                        swa_head_dim=8, sliding_window_size=6, d_rel=4, rel_extent=8, conv_kernel_size=3,
                        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, log_scaling_n_floor=4,
                        n_layers_per_attn_res_block=2, pad_token_id=0)


def _inkling2(model_type, dtype, options):
    model = _build(tf.AutoConfig.for_model(model_type, **options), dtype)
    for layer in model.model.layers:  # its router multiplies float32 hidden states by the gate's weight
        layer.mlp.gate.float()
    return _liven_convolutions(model)


def inkling2_text(dtype=torch.float32, **kw):
    return _inkling2("inkling2_text", dtype, {**INKLING2_OPTIONS, "num_hidden_layers": 3,
                                              "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"], **kw})


def inkling2_loop_text(dtype=torch.float32, **kw):
    """Six layers, sliding and full in turn, blocks of two; layers 2 and 3 (one of each) run three times: the decoder-
    layer calls are 0, 1, 2, 3, 2, 3, 2, 3, 4, 5."""
    return _inkling2("inkling2_loop_text", dtype, {
        **INKLING2_OPTIONS, "num_hidden_layers": 6, "layer_types": ["hybrid_sliding", "hybrid"] * 3,
        "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 3, "loop_gate_rank": 8, **kw})


BUILDERS = {"inkling_text": inkling_text, "inkling_mm_model": inkling_mm_model, "inkling2_text": inkling2_text,
            "inkling2_loop_text": inkling2_loop_text}
ALL = ["inkling_text", "inkling_mm_model", "inkling2_text", LOOP]


def padded_batch(length=LENGTH, pads=PADS, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V - 4, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pads] = 0
    ids[1, :pads] = 0
    return ids, mask


def _convolutions(layer):
    """(after the attention, after the MLP) of a decoder layer of either family."""
    if hasattr(layer, "attn_sconv"):
        return layer.attn_sconv, layer.mlp_sconv
    return layer.post_attention_convolution, layer.post_mlp_convolution


def _mlp_key(model, call):
    return f"{call}.{'mlp_sconv' if hasattr(model.model.layers[0], 'mlp_sconv') else 'post_mlp_convolution'}"


def _value_modules(attention):
    """(value projection, value as the interface receives it, output projection, gate or None) of an attention, in
    either layout: Inkling and Inkling2 on transformers 5.23 keep them on the attention (Inkling2 normalises after
    the convolution), Inkling2 on 5.24 inside its key/value projection and its gated output projection. The output
    projection's input is the gated attention output in both."""
    if hasattr(attention, "v_sconv"):
        return (attention.v_proj, getattr(attention, "v_norm", attention.v_sconv), attention.o_proj,
                getattr(attention, "gate_proj", None))
    return attention.v_proj.linear, attention.v_proj.norm, attention.o_proj.linear, attention.o_proj.gate_proj


def hooked_run(model, ids, mask, **kw):
    """The model's own tensors per decoder-layer call, in execution order (a looped layer once per pass): a list of
    (decoder-layer index, tensors), the tensors being the value projection x (B, L, Hkv·d), the value the attention
    interface received (B, L, Hkv, d), o_proj's input (B, L, Hq·d), Inkling2's gate pre-activation (B, L, Hq·d), the
    output of the convolution after o_proj, and the input and output of the one after the MLP (B, L, D)."""
    calls, handles = [], []

    def start(index):
        def hook(module, args):
            calls.append((index, {}))
        return hook

    def keep(name, take=lambda args, output: output):
        def hook(module, args, output):  # decoder layers do not nest: the last call is the one running
            calls[-1][1][name] = take(args, output).detach()
        return hook

    for index, layer in enumerate(model.model.layers):
        after_attention, after_mlp = _convolutions(layer)
        projection, value, output, gate = _value_modules(layer.self_attn)
        handles += [layer.register_forward_pre_hook(start(index)),
                    projection.register_forward_hook(keep("x")),
                    value.register_forward_hook(keep("value")),
                    output.register_forward_hook(keep("attended", lambda args, out: args[0])),
                    after_attention.register_forward_hook(keep("branch")),
                    after_mlp.register_forward_hook(keep("mlp_in", lambda args, out: args[0])),
                    after_mlp.register_forward_hook(keep("mlp_out"))]
        if gate is not None:
            handles.append(gate.register_forward_hook(keep("gate")))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False, **kw)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def layer_calls(model, ids, mask):
    """The decoder-layer index of each decoder-layer call of the model's forward, in execution order."""
    return [index for index, _ in hooked_run(model, ids, mask)]


def _real_rows(tensor, mask):
    return tensor * mask.to(tensor.dtype).reshape(*mask.shape, *([1] * (tensor.dim() - 2)))


def _shape(layer):
    attention = layer.self_attn
    return attention.num_heads, attention.head_dim, attention.num_key_value_groups, _out_weight(layer).shape[0]


def _out_weight(layer):
    """o_proj's weight (D, Hq·d), float64."""
    return _value_modules(layer.self_attn)[2].weight.double()


def assert_no_hooks(model):
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
        assert not module._forward_hooks_with_kwargs and not module._forward_pre_hooks_with_kwargs
    assert "get_interface" not in vars(ALL_ATTENTION_FUNCTIONS)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ALL)
def test_unified_is_exact_over_the_value_projection_and_the_mlp_output(name, dtype):
    """Attention branch: y_d = Σ_c W_o[d, c] · Σ_j H_{d,c}[i, j] x_c[j] over the value projection is the output of the
    convolution after o_proj; MLP branch: y = H u over the MLP's output is the output of the convolution after it.
    One map per decoder-layer call, keyed by the call's position (the layer index where each layer runs once)."""
    model = BUILDERS[name](dtype)
    ids, mask = padded_batch()
    seen = hooked_run(model, ids, mask)
    maps = mc.implicit_attention(model, ids, attention_mask=mask, reduce=None)
    assert list(maps) == [key for call in range(len(seen)) for key in (call, _mlp_key(model, call))]
    errors = []
    for call, (index, tensors) in enumerate(seen):
        layer = model.model.layers[index]
        heads, d, groups, width = _shape(layer)
        channels = heads * d
        assert maps[call].shape == (2, width * channels, LENGTH, LENGTH) and maps[call].dtype == dtype
        x = tensors["x"].unflatten(-1, (-1, d)).repeat_interleave(groups, dim=2).flatten(2).double()
        paths = maps[call].double().view(2, width, channels, LENGTH, LENGTH)
        y = torch.einsum("bdcij,dc,bjc->bid", paths, _out_weight(layer), x)
        errors.append(relative_error(_real_rows(y, mask), _real_rows(tensors["branch"], mask)))
        band = maps[_mlp_key(model, call)]
        assert band.shape == (2, width, LENGTH, LENGTH)
        u = torch.einsum("bdij,bjd->bid", band.double(), tensors["mlp_in"].double())
        errors.append(relative_error(_real_rows(u, mask), _real_rows(tensors["mlp_out"], mask)))
        assert maps[call].triu(1).abs().max() == 0 and band.triu(1).abs().max() == 0  # causal
        assert band.tril(-3).abs().max() == 0  # K = 3 taps
    assert max(errors) <= BOUND[dtype], errors


@pytest.mark.parametrize("name", ["inkling_text", "inkling2_text", LOOP])
def test_path_reductions_and_rows_are_those_of_the_paths(name):
    """"mean" / "sum" / "abs_mean" over the D·C paths, and query rows, equal the dense per-path maps reduced; the
    path mean is the product of the parts' mean maps."""
    model = BUILDERS[name](torch.float64)
    ids, mask = padded_batch()
    operators, _, _ = mc.build_operators(model, ids, attention_mask=mask)
    rows = [11, 4, 4, 0]
    for call in range(len(layer_calls(model, ids, mask))):
        operator = operators[call]
        full = operator.maps(None)
        for reduce, fn in (("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1)),
                           ("abs_mean", lambda t: t.abs().mean(1))):
            assert relative_error(operator.maps(reduce), fn(full)) <= 1e-12
            assert relative_error(operator.maps(reduce, rows), fn(full)[:, rows]) <= 1e-12
        assert torch.equal(operator.maps(None, rows), full[:, :, rows])
        product = operator.outer.maps("mean") @ operator.inner.maps("mean")
        assert relative_error(operator.maps("mean"), product) <= 1e-12
        inner = operator.inner.maps(None)  # Inkling2's full layer (1): per-row taps of the dynamic convolution
        assert relative_error(operator.inner.maps("abs_mean", rows), inner.abs().mean(1)[:, rows]) <= 1e-12
        assert relative_error(operator.inner.maps("sum"), inner.sum(1)) <= 1e-12
        assert operator.maps("mean")[1, :PADS].abs().max() == 0 and operator.maps("mean")[1, :, :PADS].abs().max() == 0


@pytest.mark.parametrize("name", ["inkling_text", "inkling2_text", LOOP])
def test_maps_times_values_are_the_operator_output(name):
    """y = H x in float64, to rounding: the dense paths over the operator's own values x (the value projection of
    the real tokens) weighted by o_proj reproduce its output T W A x, Σ_c W_o[d, c] · Σ_j H_{d,c}[i, j] x_c[j], and
    the MLP band over its input gives its output; every decoder-layer call, real and pad rows."""
    model = BUILDERS[name](torch.float64)
    ids, mask = padded_batch()
    operators, _, _ = mc.build_operators(model, ids, attention_mask=mask)
    for call, index in enumerate(layer_calls(model, ids, mask)):
        layer = model.model.layers[index]
        operator = operators[call]
        heads, d, _, width = _shape(layer)
        paths = operator.maps(None).view(2, width, heads * d, LENGTH, LENGTH)
        y = torch.einsum("bdcij,dc,bjc->bid", paths, _out_weight(layer), operator.values.flatten(2))
        assert relative_error(y, operator.output) <= 1e-12
        band = operators[_mlp_key(model, call)]
        u = torch.einsum("bdij,bjd->bid", band.maps(None), band.values[..., 0])
        assert relative_error(u, band.output[..., 0]) <= 1e-12


@pytest.mark.parametrize("name", ["inkling_text", "inkling2_text", LOOP])
def test_gradient_x_operator_is_the_dense_path_sum(name):
    """contributions(g)[i, j] = Σ_{d,c} g_d[i] · W_o[d, c] · H_{d,c}[i, j] · x_c[j] (the K shifted calls of the
    attention's own rule against the dense paths); rows sum to Σ_d g_d[i] · y_d[i]; query rows alone agree."""
    model = BUILDERS[name](torch.float64)
    ids, mask = padded_batch()
    operators, _, _ = mc.build_operators(model, ids, attention_mask=mask)
    torch.manual_seed(3)
    for call, index in enumerate(layer_calls(model, ids, mask)):
        layer = model.model.layers[index]
        operator = operators[call]
        heads, d, _, width = _shape(layer)
        grad = torch.randn_like(operator.output)
        contributions = operator.contributions(grad)
        paths = operator.maps(None).view(2, width, heads * d, LENGTH, LENGTH)
        x = operator.values.flatten(2)
        dense = torch.einsum("bid,dc,bdcij,bjc->bij", grad, _out_weight(layer), paths, x)
        assert relative_error(contributions, dense) <= 1e-10
        expected = (grad * operator.output).sum(-1) * mask
        assert relative_error(contributions.sum(-1), expected) <= 1e-10
        assert relative_error(operator.contributions(grad, [11, 2]), contributions[:, [11, 2]]) <= 1e-12
        band = operators[_mlp_key(model, call)]
        grad = torch.randn_like(band.output)
        assert relative_error(band.contributions(grad).sum(-1), (grad * band.output).sum((-2, -1)) * mask) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["inkling_text", "inkling2_text", LOOP])
def test_hidden_is_the_probabilities_over_the_interface_value(name, dtype):
    """hidden: per head, the probabilities over the value the interface received reproduce the attention output
    (o_proj's input, before Inkling2's gate); composed with the band after o_proj over the paths (d, h). Without a
    gate between them (Inkling), Σ_{c ∈ h} W_o[d, c] · (T_d P_h v_c) is the branch output."""
    model = BUILDERS[name](dtype)
    ids, mask = padded_batch()
    seen = hooked_run(model, ids, mask)
    operators, _, _ = mc.build_operators(model, ids, attention_mask=mask, formulation="hidden")
    maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden", reduce=None)
    for call, (index, tensors) in enumerate(seen):
        layer = model.model.layers[index]
        heads, d, groups, width = _shape(layer)
        assert maps[call].shape == (2, width * heads, LENGTH, LENGTH)
        value = tensors["value"].reshape(2, LENGTH, -1, d).repeat_interleave(groups, dim=2).double()
        probs = operators[call].inner.maps(None)  # (B, Hq, L, L)
        attended = torch.einsum("bhij,bjhd->bihd", probs.double(), value)
        expected = tensors["attended"].double().unflatten(-1, (heads, d))
        if "gate" in tensors:
            expected = expected / torch.sigmoid(tensors["gate"].double()).unflatten(-1, (heads, d))
        assert relative_error(_real_rows(attended, mask), _real_rows(expected, mask)) <= BOUND[dtype]
        if "gate" not in tensors:
            paths = maps[call].double().view(2, width, heads, LENGTH, LENGTH)
            weight = _out_weight(layer).view(width, heads, d)
            y = torch.einsum("bdhij,dhp,bjhp->bid", paths, weight, value)
            assert relative_error(_real_rows(y, mask), _real_rows(tensors["branch"], mask)) <= BOUND[dtype]


def test_without_the_convolutions_the_branch_map_is_the_head_mean_probabilities():
    """Components: "conv" off leaves Inkling's skips (identities), so the attention branch's mean map is the
    head-mean probabilities and the MLP branch's is the identity; "s6" off leaves the bands alone."""
    model = inkling_text(torch.float64)
    ids, mask = padded_batch()
    operators, _, _ = mc.build_operators(model, ids, attention_mask=mask)
    ablated = mc.implicit_attention(model, ids, attention_mask=mask, components={"s6", "gate", "act", "norm"})
    bands = mc.implicit_attention(model, ids, attention_mask=mask, components={"conv", "gate", "act", "norm"})
    eye = torch.eye(LENGTH, dtype=torch.float64) * mask[:, :, None] * mask[:, None, :]
    for index in range(2):
        probs = operators[index].inner.core.probs.mean(1) * mask[:, :, None] * mask[:, None, :]
        assert relative_error(ablated[index], probs) <= 1e-12
        assert relative_error(ablated[f"{index}.mlp_sconv"], eye) <= 1e-12
        assert bands[index].tril(-5).abs().max() == 0  # the value band (3 taps) then the branch band (3 taps)
        assert relative_error(bands[f"{index}.mlp_sconv"], mc.implicit_attention(model, ids, attention_mask=mask)[
            f"{index}.mlp_sconv"]) <= 1e-12


@pytest.mark.parametrize("name", ALL)
def test_padding_and_batching_give_the_single_sequence_maps(name):
    """Left padding and batching change nothing for the real tokens. Inkling's log scaling counts the pads among the
    positions (HF computes it from the padded length), so here it starts after the sequence (n_floor = 64); Inkling2
    takes it from position_ids, which are given. The convolutions (and Inkling2's softmax with sinks) run in float32
    whatever the model's dtype, so batched and single runs round differently: 1e-6."""
    inkling2 = name.startswith("inkling2")
    options = {} if inkling2 else {"log_scaling_n_floor": 64}
    model = BUILDERS[name](torch.float64, **options)
    ids, mask = padded_batch()
    extra = {}
    if inkling2:
        extra = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    batched = mc.implicit_attention(model, ids, attention_mask=mask, **extra)
    for row, pads in ((0, 0), (1, PADS)):
        single_extra = {"position_ids": torch.arange(LENGTH - pads)[None]} if extra else {}
        single = mc.implicit_attention(model, ids[row:row + 1, pads:], **single_extra)
        assert list(single) == list(batched)
        for key in batched:
            assert relative_error(batched[key][row, pads:, pads:], single[key][0]) <= 1e-6
            if pads:
                assert batched[key][row, :pads].abs().max() == 0 and batched[key][row, :, :pads].abs().max() == 0


@pytest.mark.parametrize("method", [mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution])
@pytest.mark.parametrize("name", ALL)
def test_captum_methods_run_and_leave_no_hooks(name, method):
    model = BUILDERS[name](torch.float32)
    ids, mask = padded_batch()
    relevance = method(model).attribute(ids, additional_forward_args=(mask,), start_layer=0)
    assert relevance.shape == ids.shape and bool(torch.isfinite(relevance).all())
    assert relevance[1, :PADS].abs().max() == 0  # pads
    assert relevance[0].abs().max() > 0
    assert_no_hooks(model)


def test_rollout_takes_one_step_per_mixer_in_execution_order():
    """Rollout multiplies rownorm(I + A₊) over the maps in execution order: the attention branch (attention and the
    band after o_proj as one step: no residual between them), then the MLP branch's band, layer after layer."""
    from mamba_captum.attr._rollout import rollout_step

    model = inkling2_text(torch.float64)
    ids, mask = padded_batch()
    maps = mc.implicit_attention(model, ids, attention_mask=mask)
    assert list(maps) == sorted(maps) == [0, "0.post_mlp_convolution", 1, "1.post_mlp_convolution", 2,
                                          "2.post_mlp_convolution"]
    product = None
    for key in maps:
        factor = rollout_step(maps[key])
        product = factor if product is None else factor @ product
    expected = product[:, -1]
    relevance = mc.MambaRollout(model).attribute(ids, attention_mask=mask)
    assert relative_error(relevance, expected) <= 1e-12


def test_in_attention_convolutions_are_part_of_the_attention_and_the_branch_keys_round_trip(tmp_path):
    """k_sconv / v_sconv are never mixers of their own; the convolution after o_proj follows the attention, the one
    after the MLP is its own branch. Its key sorts after the layer's int key and survives pickle and torch.save."""
    for build, after, mlp in ((inkling_text, "attn_sconv", "mlp_sconv"),
                              (inkling2_text, "post_attention_convolution", "post_mlp_convolution")):
        model = build()
        _, found = families.locate(model)
        expected = []
        for index in range(len(model.model.layers)):
            expected += [(f"{index}.self_attn", None), (f"{index}.{after}", f"{index}.self_attn"),
                         (f"{index}.{mlp}", None)]
        assert [(m.name, m.follows) for m in found] == expected
        assert pickle.loads(pickle.dumps(found[1])).follows == found[1].follows
    maps = mc.implicit_attention(inkling_text(), padded_batch()[0])
    key = list(maps)[1]
    assert isinstance(key, mc.LayerPartKey) and key == "0.mlp_sconv" and key.layer == 0 and 0 < key < 1
    assert sorted([1, key, 0, mc.LayerPartKey(1, "mlp_sconv")]) == [0, "0.mlp_sconv", 1, "1.mlp_sconv"]
    copy = pickle.loads(pickle.dumps(key))
    assert copy == key and isinstance(copy, mc.LayerPartKey) and copy < 1
    torch.save(maps, tmp_path / "maps.pt")
    loaded = torch.load(tmp_path / "maps.pt")
    assert list(loaded) == list(maps) and isinstance(list(loaded)[1], mc.LayerPartKey)


def test_a_branch_convolution_at_an_unknown_place_is_refused():
    from transformers.models.inkling.modeling_inkling import InklingShortConvolution

    model = inkling_text()
    model.model.layers[1].extra_sconv = InklingShortConvolution(32, 3, layer_idx=1, conv_idx=4)
    with pytest.raises(TypeError, match=r"layer 1 has a InklingShortConvolution at 'extra_sconv'"):
        mc.implicit_attention(model, padded_batch()[0])


def test_a_hook_that_replaces_the_attention_output_is_refused():
    """The convolution after o_proj must receive the attention's own output for the two to compose."""
    model = inkling_text()
    handle = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: (out[0] * 2.0, out[1]))
    try:
        with pytest.raises(mc.ReconstructionError, match=r"0.attn_sconv .* did not receive the output of "
                                                          r"0.self_attn"):
            mc.implicit_attention(model, *padded_batch())
    finally:
        handle.remove()
    assert_no_hooks(model)


@pytest.mark.skipif(not HAS_LOOP, reason="inkling2_loop is new in transformers 5.24")
def test_looped_layers_give_one_map_per_call_numbered_as_hf_numbers_its_hidden_states():
    """Inkling2-Loop's layers 2 and 3 run once per pass (three): the maps are keyed by decoder-layer call in execution
    order, as HF numbers the model's output_hidden_states; the passes see different inputs (messages from the previous
    pass), so a looped layer's maps differ from pass to pass; layers= picks calls; rollout takes one step per mixer
    in that order; as_hf_attentions gives one map per call."""
    from mamba_captum.attr._rollout import rollout_step

    model = inkling2_loop_text(torch.float64)
    ids, mask = padded_batch()
    calls = layer_calls(model, ids, mask)
    assert calls == [0, 1, 2, 3, 2, 3, 2, 3, 4, 5] == families.layer_schedule(*families.locate(model))
    maps = mc.implicit_attention(model, ids, attention_mask=mask)
    assert list(maps) == sorted(maps) == [key for call in range(10) for key in (call, f"{call}.post_mlp_convolution")]
    for first, later in ((2, 4), (2, 6), (3, 7)):
        assert relative_error(maps[later], maps[first]) > 1e-3
    chosen = mc.implicit_attention(model, ids, attention_mask=mask, layers=[5, -1])
    assert list(chosen) == [5, "5.post_mlp_convolution", 9, "9.post_mlp_convolution"]
    assert all(torch.equal(chosen[key], maps[key]) for key in chosen)
    product = None
    for key in maps:
        factor = rollout_step(maps[key])
        product = factor if product is None else factor @ product
    assert relative_error(mc.MambaRollout(model).attribute(ids, attention_mask=mask), product[:, -1]) <= 1e-12
    attentions = mc.as_hf_attentions(model, ids, mask, reduce="mean")
    assert len(attentions) == 10 and torch.equal(attentions[7][:, 0], maps[7])
    assert_no_hooks(model)
    with torch.no_grad():  # (HF installs hooks of its own for output_hidden_states, which stay on the model)
        hidden_states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(hidden_states) == len(calls) + 1 == model.config.total_num_hidden_layers + 1


@pytest.mark.parametrize("name", ["inkling2_text", LOOP])
def test_attention_over_depth_is_not_recorded_as_token_attention(name):
    """The block (and message) attention residuals mix earlier layers' outputs at each token; where they call the
    attention interface (transformers 5.24) the capture passes them through: one recorded call per decoder-layer call,
    the layer's own attention over the tokens."""
    from mamba_captum.capture import LayerCapture

    model = BUILDERS[name](torch.float64)
    ids, mask = padded_batch()
    calls = layer_calls(model, ids, mask)
    with torch.no_grad(), LayerCapture(model.model.layers, [], schedule=calls) as capture:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    recorded = capture.trace.attention_calls
    assert [call.layer for call in recorded] == list(range(len(calls)))
    assert [call.module for call in recorded] == [model.model.layers[index].self_attn for index in calls]
    assert all(call.query.shape[-2] == LENGTH for call in recorded)
    assert_no_hooks(model)


@pytest.mark.parametrize("name", ["inkling2_text", LOOP])
def test_an_unrecognised_value_path_is_refused_by_name(name):
    """An attention whose value path is in neither known layout is refused, naming the class and the model type,
    before anything runs, by every entry point."""
    model = BUILDERS[name]()
    attention = model.model.layers[1].self_attn
    if hasattr(attention, "v_norm"):  # the layout on the attention
        attention.v_norm = torch.nn.Identity()
    else:  # the layout inside the key/value projection
        attention.v_proj.norm = torch.nn.Identity()
    model_type = model.config.model_type
    pattern = (rf"layer 1 \(self_attn\) is a {type(attention).__name__} \(model type '{model_type}'\) whose value "
               r"path the Inkling2 adapter does not recognise")
    ids, mask = padded_batch()
    with pytest.raises(TypeError, match=pattern):
        mc.implicit_attention(model, ids, attention_mask=mask)
    with pytest.raises(TypeError, match=pattern):
        mc.MambaAttribution(model).attribute(ids, additional_forward_args=(mask,))
    assert_no_hooks(model)


@pytest.mark.skipif(not HAS_LOOP, reason="inkling2_loop is new in transformers 5.24")
def test_a_forward_off_the_loop_schedule_is_refused():
    """The calls of a looped layer are told apart by their place in the schedule its config gives; a forward that runs
    another sequence of layers (here: the config read by the adapter says two passes, the model runs three) is
    refused, and the hooks are gone."""
    import copy

    model = inkling2_loop_text()
    attention = model.model.layers[0].self_attn  # the first attention, whose config gives the schedule
    attention.config = copy.copy(attention.config)
    attention.config.loop_num_passes = 2
    with pytest.raises(RuntimeError, match=r"decoder layer 2 ran as call 6 of the forward pass, where the model's "
                                           r"loop schedule has layer 4"):
        mc.implicit_attention(model, *padded_batch())
    assert_no_hooks(model)
