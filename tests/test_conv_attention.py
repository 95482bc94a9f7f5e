"""Softmax attention with a band on the values (mamba_captum.families.conv_attention).

ZAYA (zaya): y = H x per value channel against the test's own hooks (the value projections before the shift, the
value the attention interface received, o_proj's input), float32 and float64, unified and hidden, with and without
attention_bias, one or two key/value heads; padding, batched == single; the three Captum classes.
The refusal of a known token mixer by name (families.REFUSED, empty since inkling and inkling2 are explained by
mamba_captum.families.inkling / .inkling2, tests/test_inkling.py): still a TypeError naming the class, the model
type and why, for every entry point. The probabilities of inkling's and inkling2's attention calls take their
position_bias and sinks.
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import mamba_captum as mc
from conftest import relative_error

V = 64
BOUND = {torch.float64: 1e-5, torch.float32: 3e-5}


def _build(config, dtype):
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager").eval()


def zaya(dtype=torch.float64, **kw):
    options = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=1, router_hidden_size=16,
                   layer_types=["hybrid", "hybrid_sliding"], sliding_window=6, pad_token_id=0)
    options.update(kw)
    model = _build(tf.AutoConfig.for_model("zaya", **options), dtype)
    # sdpa: HF's eager softmax gives NaN rows at left pads in float64
    model.config._attn_implementation = "sdpa"
    return model


def _inkling_text():
    return dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                sliding_window_size=6, d_rel=4, rel_extent=8, conv_kernel_size=3, intermediate_size=64,
                moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"],
                log_scaling_n_floor=4, pad_token_id=0)


def inkling_text():
    return _build(tf.AutoConfig.for_model("inkling_text", **_inkling_text()), torch.float32)


def inkling_mm_model():
    config = tf.AutoConfig.for_model("inkling_mm_model", text_config=dict(model_type="inkling_text",
                                                                         **_inkling_text()))
    return _build(config.get_text_config(), torch.float32)


def inkling2_text():
    config = tf.AutoConfig.for_model(
        "inkling2_text", vocab_size=V, unpadded_vocab_size=V, hidden_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=6, d_rel=4, rel_extent=8, conv_kernel_size=3,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, log_scaling_n_floor=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], n_layers_per_attn_res_block=2, pad_token_id=0)
    return _build(config, torch.float32)


def padded_batch(length=12, pads=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V - 4, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pads] = 0
    ids[1, :pads] = 0
    return ids, mask


def hooked_run(model, ids, mask):
    """The model's own value path, per attention layer: the value projections before the shift (B, L, Hkv, d),
    the value the attention interface received (B, L, Hkv, d) and o_proj's input (B, L, Hq, d)."""
    seen, handles = {}, []
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        shape = (attention.num_key_value_heads, attention.head_dim)

        def keep(name, index=index):  # the first call: v_proj_delayed runs again on zeros (token 0's value)
            def hook(module, args, output):
                seen.setdefault(index, {}).setdefault(name, output.detach())  # returns None: output unchanged
            return hook

        handles += [attention.qkv_proj.v_proj_current.register_forward_hook(keep("current")),
                    attention.qkv_proj.v_proj_delayed.register_forward_hook(keep("delayed")),
                    attention.qkv_proj.register_forward_hook(
                        lambda module, args, output, index=index: seen[index].__setitem__("value",
                                                                                         output[2].detach())),
                    attention.o_proj.register_forward_pre_hook(
                        lambda module, args, index=index, shape=shape: seen[index].__setitem__(
                            "attended", args[0].detach().unflatten(-1, (-1, shape[1]))))]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    for index, layer in enumerate(model.model.layers):
        kv, d = layer.self_attn.num_key_value_heads, layer.self_attn.head_dim
        record = seen[index]
        record["pre"] = torch.cat([record["current"], record["delayed"]], -1).unflatten(-1, (kv, d))
    return seen


def _dense_apply(maps, values):
    """Σ_j H_c[i, j] x_c[j]: maps (B, C, L, L), values (B, L, C) -> (B, L, C)."""
    return torch.einsum("bcij,bjc->bic", maps.double(), values.double())


def _real_rows(tensor, mask):
    return tensor * mask.to(tensor.dtype).reshape(*mask.shape, *([1] * (tensor.dim() - 2)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("options", [{}, {"num_key_value_heads": 1}], ids=["kv2", "kv1"])
def test_zaya_unified_is_exact_over_the_unshifted_values(dtype, options):
    model = zaya(dtype, **options)
    ids, mask = padded_batch()
    seen = hooked_run(model, ids, mask)
    maps = mc.implicit_attention(model, ids, attention_mask=mask, reduce=None)
    assert sorted(maps) == [0, 1]  # one map per layer: the attention call is not a map of its own
    for index, layer in enumerate(model.model.layers):
        heads, d = layer.self_attn.num_attention_heads, layer.self_attn.head_dim
        groups = layer.self_attn.num_key_value_groups
        assert maps[index].shape == (2, heads * d, 12, 12) and maps[index].dtype == dtype
        x = seen[index]["pre"].repeat_interleave(groups, dim=2).flatten(2)  # (B, L, Hq·d), before the shift
        y = _dense_apply(maps[index], x)
        expected = seen[index]["attended"].flatten(2)
        assert relative_error(_real_rows(y, mask), _real_rows(expected, mask)) <= BOUND[dtype]
        # the band is a one-token shift on the delayed half of the channels: nothing above the diagonal, and on
        # those channels nothing on it
        assert maps[index].triu(1).abs().max() == 0
        value = seen[index]["value"]  # the interface's value: the delayed channels shifted
        current = layer.self_attn.qkv_proj.v_proj_current.out_features
        flat_pre, flat_value = seen[index]["pre"].flatten(2), value.flatten(2)
        assert torch.equal(flat_value[:, 1:, current:], flat_pre[:, :-1, current:])


def test_zaya_attention_bias_shares_go_to_the_readout():
    """With attention_bias the pads' values and token 0's shifted-in value are the bias: no real token's. H x over
    the real tokens plus P · (what the interface's value holds beyond the band of the real tokens) is o_proj's
    input; the operator's readout gives the layer output."""
    model = zaya(torch.float64, attention_bias=True)
    with torch.no_grad():  # HF initialises biases to 0
        for layer in model.model.layers:
            for projection in (layer.self_attn.qkv_proj.v_proj_current, layer.self_attn.qkv_proj.v_proj_delayed):
                projection.bias.normal_()
    ids, mask = padded_batch()
    seen = hooked_run(model, ids, mask)
    operators, _, errors = mc.build_operators(model, ids, attention_mask=mask)
    assert max(errors.values()) < 1e-12
    for index, layer in enumerate(model.model.layers):
        operator, groups = operators[index], layer.self_attn.num_key_value_groups
        maps = operator.maps(None)
        real = mask[:, :, None, None].double()
        pre = seen[index]["pre"] * real
        x = pre.repeat_interleave(groups, dim=2).flatten(2)
        y = _dense_apply(maps, x)
        # the band of the real tokens' values, by hand; the rest of the interface's value is no token's
        current = layer.self_attn.qkv_proj.v_proj_current.out_features
        band = pre.flatten(2).clone()
        band[:, :, current:] = 0
        band[:, 1:, current:] = pre.flatten(2)[:, :-1, current:]
        rest = (seen[index]["value"].flatten(2) - band).unflatten(-1, pre.shape[-2:]).repeat_interleave(groups, 2)
        probs = operator.core.probs  # (B, Hq, L, L)
        constant = (probs @ rest.transpose(1, 2)).transpose(1, 2).flatten(2)
        assert constant[1].abs().max() > 1e-3  # the pads' bias reaches the first real tokens
        expected = seen[index]["attended"].flatten(2)
        assert relative_error(_real_rows(y + constant, mask), _real_rows(expected, mask)) <= 1e-10
        assert relative_error(operator.output.flatten(2), y) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zaya_hidden_is_the_probabilities_over_the_interface_value(dtype):
    model = zaya(dtype)
    ids, mask = padded_batch()
    seen = hooked_run(model, ids, mask)
    maps = mc.implicit_attention(model, ids, attention_mask=mask, reduce=None, formulation="hidden")
    for index, layer in enumerate(model.model.layers):
        heads, groups = layer.self_attn.num_attention_heads, layer.self_attn.num_key_value_groups
        assert maps[index].shape == (2, heads, 12, 12)
        value = seen[index]["value"].repeat_interleave(groups, dim=2)  # (B, L, Hq, d)
        y = torch.einsum("bhij,bjhd->bihd", maps[index].double(), value.double())
        assert relative_error(_real_rows(y, mask), _real_rows(seen[index]["attended"], mask)) <= BOUND[dtype]
        rows = maps[index].sum(-1) * mask[:, None]  # probabilities: real rows sum to 1
        assert torch.allclose(rows, mask[:, None].expand_as(rows).to(rows.dtype), atol=1e-5)


def test_zaya_band_alone_is_the_shift():
    model = zaya(torch.float64)
    ids, _ = padded_batch()
    maps = mc.implicit_attention(model, ids[:1], reduce=None, components={"s6": False})
    layer = model.model.layers[0].self_attn
    current = layer.qkv_proj.v_proj_current.out_features  # channels of the current half, per key/value layout
    d, groups = layer.head_dim, layer.num_key_value_groups
    eye, shift = torch.eye(12, dtype=torch.float64), torch.diag(torch.ones(11, dtype=torch.float64), -1)
    for channel in range(layer.num_attention_heads * d):
        head, p = divmod(channel, d)
        kv_channel = (head // groups) * d + p
        expected = eye if kv_channel < current else shift
        assert torch.equal(maps[0][0, channel], expected)


def test_zaya_padding_and_batching_give_the_single_sequence_maps():
    model = zaya(torch.float64)
    ids, mask = padded_batch(pads=3)
    batched = mc.implicit_attention(model, ids, attention_mask=mask)
    for row, pads in ((0, 0), (1, 3)):
        single = mc.implicit_attention(model, ids[row:row + 1, pads:])
        for index in batched:
            assert relative_error(batched[index][row, pads:, pads:], single[index][0]) <= 1e-10
            assert batched[index][row, :pads].abs().max() == 0 if pads else True
            assert batched[index][row, :, :pads].abs().max() == 0 if pads else True


@pytest.mark.parametrize("method", [mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution])
def test_zaya_captum_methods_run(method):
    model = zaya(torch.float32)
    ids, mask = padded_batch()
    relevance = method(model).attribute(ids, additional_forward_args=(mask,), start_layer=0)
    assert relevance.shape == ids.shape and bool(torch.isfinite(relevance).all())
    assert relevance[1, :3].abs().max() == 0  # pads
    assert relevance[0].abs().max() > 0


def test_zaya_attribution_rows_sum_to_the_target_share():
    """Gradient × operator: Σ_j of a layer's contributions = Σ_c g_c[i] y_c[i] (y = H x, o_proj's input without the
    no-token share), checked on the operator the methods use."""
    model = zaya(torch.float64)
    ids, mask = padded_batch()
    operators, _, _ = mc.build_operators(model, ids, attention_mask=mask)
    torch.manual_seed(3)
    for operator in operators.values():
        grad = torch.randn_like(operator.output)
        contributions = operator.contributions(grad)  # (B, L, L)
        expected = (grad * operator.output).sum((-2, -1)) * mask
        assert relative_error(contributions.sum(-1), expected) <= 1e-10


def test_a_refused_mixer_is_named_with_its_model_type_and_why(monkeypatch):
    """A class in families.REFUSED is refused by name (never skipped), with the reason, by every entry point; the
    first one met is the convolution after the attention (k_sconv / v_sconv, inside the located attention, are part
    of its operator and never checked as mixers of their own)."""
    from mamba_captum import families

    monkeypatch.setitem(families.REFUSED, "InklingShortConvolution", "a reason given by the library")
    model = inkling_text()
    ids, mask = padded_batch()
    pattern = (r"layer 0 \(attn_sconv\) uses the token mixer InklingShortConvolution \(model type 'inkling_text'\), "
               r"which cannot be explained exactly: a reason given by the library")
    with pytest.raises(TypeError, match=pattern):
        mc.implicit_attention(model, ids, attention_mask=mask)
    for method in (mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution):
        with pytest.raises(TypeError, match=pattern):
            method(model).attribute(ids, additional_forward_args=(mask,), start_layer=0)


def test_nothing_is_refused_now():
    from mamba_captum import families

    assert families.REFUSED == {}
    assert {"InklingAttention", "InklingShortConvolution", "Inkling2SlidingAttention", "Inkling2FullAttention",
            "Inkling2ShortConvolution"} <= set(mc.SUPPORTED_MIXERS)


@pytest.mark.parametrize("name, dtype, implementation", [("inkling_text", torch.float64, "sdpa"),
                                                         ("inkling_text", torch.float32, "eager"),
                                                         ("inkling2_text", torch.float64, "eager")])
def test_probabilities_take_position_bias_and_sinks(name, dtype, implementation):
    """The attention interface's data-dependent relative logits (position_bias) and sink logits (sinks) are
    recorded and enter the rebuilt probabilities: P v reproduces the interface's output (on real rows). inkling2's
    eager softmax with sinks runs in float32 even in a float64 model, hence its bound."""
    from mamba_captum.capture import LayerCapture
    from mamba_captum.families import softmax

    model = {"inkling_text": inkling_text, "inkling2_text": inkling2_text}[name]().to(dtype)
    if name == "inkling2_text":
        for layer in model.model.layers:  # its router multiplies float32 hidden states by the gate's weight
            layer.mlp.gate.float()
    model.config._attn_implementation = implementation
    ids, mask = padded_batch()
    with torch.no_grad(), LayerCapture(model.model.layers, []) as capture:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    calls = capture.trace.attention_calls
    assert len(calls) == len(model.model.layers)
    keep = mask[:, :, None, None].double()
    bound = 1e-12 if (dtype == torch.float64 and name == "inkling_text") else 1e-6
    for call in calls:
        assert "position_bias" in call.options and ("sinks" in call.options) == (name == "inkling2_text")
        _, rebuilt, real = softmax.rebuild(call, torch.float64, mask.double())
        assert relative_error(rebuilt * keep, real * keep) <= bound
        call.options.pop("position_bias")  # without the relative logits the probabilities are another function
        _, rebuilt, real = softmax.rebuild(call, torch.float64, mask.double())
        assert relative_error(rebuilt * keep, real * keep) > 1e-3
