"""flash-linear-attention's GLA family beyond GLA itself: RetNet, HGRN, HGRN-2, linear attention, LightNet.

The torch versions of ``normalize_with_z_state`` (linear attention's normaliser) and ``fused_additive_gate``
(LightNet's key gate) against float64 references written here (and fla's own naive ops), outputs, final states,
gradients and packed sequences; then the adapters of the layers whose o_proj runs inside a fused norm (HGRN, HGRN-2,
LightNet) or after the repadding (linear attention), which the generic ``tests/test_fla_families.py`` cannot read
with its o_proj hook: readout(H x) equals the layer's output, the hidden maps equal an impulse reference through the
recorded op inputs, batches equal single examples, and a CPU training step runs through the chunked ops.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from conftest import relative_error
from fla_models import (OpRecorder, assert_a_cpu_training_step_matches_eval, assert_batch_equals_single_examples,
                        common_config, fla_mixers, fla_models, gla_impulse, one_hot_values, padded_batch, run_hooked,
                        scale_up_mixer_weights)
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from mamba_captum.fla_cpu import ops_gla_family

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fla.layers import MultiScaleRetention
    from fla.ops.gla.naive import naive_recurrent_gla
    from fla.ops.hgrn.naive import naive_recurrent_hgrn
    from fla.ops.lightnet import fused_recurrent_lightnet
    from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn


def _randn(generator, *shape):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


# -- linear attention's normaliser -------------------------------------------------------------------------------------
def normalised_linear_attention(q, k, v, scale, kv_init, z_init):
    """The float64 reference: o_t = scale q_tᵀ (S_0 + Σ_{s≤t} k_s v_sᵀ) / (scale q_t · (z_0 + Σ_{s≤t} k_s) + 1e-10),
    and the final (S, z) — written densely, without the kernels."""
    state = kv_init[:, None] + torch.einsum("bshk,bshv->bshkv", k, v).cumsum(1)  # (B, T, H, K, V)
    key_sum = z_init + k.cumsum(1)  # (B, T, H, K)
    o = torch.einsum("bthk,bthkv->bthv", q * scale, state)
    o = o / ((q * scale * key_sum).sum(-1, keepdim=True) + 1e-10)
    return o, state[:, -1], key_sum[:, -1:]


@pytest.mark.parametrize("op", [chunk_linear_attn, fused_recurrent_linear_attn])
def test_normalised_linear_attention_ops_equal_the_reference_with_gradients(op):
    g = torch.Generator().manual_seed(0)
    q, k = _randn(g, 2, 9, 2, 4).softmax(-1), _randn(g, 2, 9, 2, 4).softmax(-1)  # positive features
    v, kv_init, z_init = _randn(g, 2, 9, 2, 3), _randn(g, 2, 2, 4, 3), _randn(g, 2, 1, 2, 4).abs()
    weights = _randn(g, 2, 9, 2, 3)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, kv_init, z_init)]
    with mc.fla_on_cpu():
        o, (state, key_sum) = op(*inputs[:3], initial_state=(inputs[3], inputs[4]), output_final_state=True,
                                 normalize=True)
    expected = normalised_linear_attention(q, k, v, 4 ** -0.5, kv_init, z_init)
    for got, want in zip((o, state, key_sum), expected):
        assert relative_error(got, want) <= 1e-12
    references = [t.clone().requires_grad_(True) for t in (q, k, v, kv_init, z_init)]
    (o * weights).sum().backward()
    (normalised_linear_attention(*references[:3], 4 ** -0.5, *references[3:])[0] * weights).sum().backward()
    for got, want in zip(inputs, references):
        assert relative_error(got.grad, want.grad) <= 1e-10
    # fla's own (float32) reference agrees on the convention
    naive, (naive_state, naive_sum) = naive_recurrent_linear_attn(
        *(t.float() for t in (q, k, v)), initial_state=(kv_init.float(), z_init.float()), output_final_state=True,
        normalize=True)
    assert relative_error(o, naive) <= 1e-5 and relative_error(key_sum, naive_sum) <= 1e-6


def test_normalize_with_z_state_packed_and_reversed_equal_each_sequence():
    g = torch.Generator().manual_seed(1)
    lengths = [4, 0, 6]
    cu_seqlens = torch.tensor([0, 4, 4, 10])
    q, k, o = _randn(g, 1, 10, 2, 3).exp(), _randn(g, 1, 10, 2, 3).exp(), _randn(g, 1, 10, 2, 5)
    z_init = _randn(g, 3, 1, 2, 3).exp()
    for reverse in (False, True):
        packed, states = ops_gla_family.normalize_with_z_state(o, q, k, 0.5, z_init, reverse, cu_seqlens)
        start = 0
        for n, length in enumerate(lengths):
            part = slice(start, start + length)
            key_sum = k[:, part].flip(1).cumsum(1).flip(1) if reverse else k[:, part].cumsum(1)
            key_sum = key_sum + z_init[n:n + 1]
            expected = o[:, part] / ((q[:, part] * 0.5 * key_sum).sum(-1, keepdim=True) + 1e-10)
            if length:
                assert relative_error(packed[:, part], expected) <= 1e-13
            boundary = (key_sum[:, :1] if reverse else key_sum[:, -1:]) if length else z_init[n:n + 1]
            assert torch.equal(states[n:n + 1], boundary)
            start += length


# -- LightNet's additive gate ------------------------------------------------------------------------------------------
def additive_gate_reference(x, z0=None):
    """fla GSA reference's gate (``fla/ops/gsa/naive.py``), float64, with a starting log-normaliser z0 (B, 1, H, K):
    z_t = log(e^{z_0} + Σ_{s≤t} e^{x_s}), k_t = e^{x_t − z_t}, g_t = z_{t−1} − z_t (g_0 = 0 without z0)."""
    z = x.logcumsumexp(1) if z0 is None else torch.logaddexp(x.logcumsumexp(1), z0)
    previous = torch.cat([z[:, :1] if z0 is None else z0, z[:, :-1]], dim=1)
    return (x - z).exp(), previous - z, z[:, -1:]


def test_fused_additive_gate_equals_the_reference_with_gradients_and_packed_sequences():
    g = torch.Generator().manual_seed(2)
    x, z0, weights = _randn(g, 2, 7, 2, 3), _randn(g, 2, 1, 2, 3), [_randn(g, 2, 7, 2, 3) for _ in range(2)]
    for start in (None, z0):
        ours = [x.clone().requires_grad_(True), None if start is None else start.clone().requires_grad_(True)]
        theirs = [t if t is None else t.clone().requires_grad_(True) for t in (x, start)]
        got, want = ops_gla_family.fused_additive_gate(*ours), additive_gate_reference(*theirs)
        for a, b in zip(got, want):
            assert relative_error(a, b) <= 1e-13
        sum(((a * w).sum() for a, w in zip(got[:2], weights))).backward()
        sum(((a * w).sum() for a, w in zip(want[:2], weights))).backward()
        for a, b in zip(ours, theirs):
            assert b is None or relative_error(a.grad, b.grad) <= 1e-12
    # packed: each sequence on its own, an empty one keeps its initial state
    packed = torch.cat([x[:1, :3], x[1:, :7]], dim=1)
    k, gate, final = ops_gla_family.fused_additive_gate(packed, torch.cat([z0, z0[:1]]), torch.tensor([0, 3, 10, 10]))
    for n, (part, sequence) in enumerate([(slice(0, 3), x[:1, :3]), (slice(3, 10), x[1:, :7])]):
        want = additive_gate_reference(sequence, z0[n:n + 1])
        assert relative_error(k[:, part], want[0]) <= 1e-13 and relative_error(gate[:, part], want[1]) <= 1e-13
        assert relative_error(final[n:n + 1], want[2]) <= 1e-13
    assert torch.equal(final[2:], z0[:1])


def gated_linear_reference(q, k, v, log_decay):
    """o_t = K^−½ Σ_{s≤t} (q_t ⊙ e^{Γ_t − Γ_s} · k_s) v_s and S_T = Σ_s diag(e^{Γ_T − Γ_s}) k_s v_sᵀ, densely in
    float64 (Γ the cumulative log decays, (B, T, H, K))."""
    cumulative = log_decay.cumsum(1)
    decay = (cumulative[:, :, None] - cumulative[:, None, :]).exp()  # (B, T, S, H, K)
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()[None, :, :, None]
    alpha = torch.einsum("bthk,btshk,bshk->bhts", q * q.shape[-1] ** -0.5, decay, k) * causal.permute(0, 3, 1, 2)
    state = torch.einsum("bshk,bshv->bhkv", (cumulative[:, -1:] - cumulative).exp() * k, v)
    return torch.einsum("bhts,bshv->bthv", alpha, v), state


def test_lightnet_op_equals_the_gated_reference_through_the_gate():
    g = torch.Generator().manual_seed(3)
    q, logits, v = _randn(g, 2, 8, 2, 4), _randn(g, 2, 8, 2, 4), _randn(g, 2, 8, 2, 3)
    with mc.fla_on_cpu():
        o, (state, z) = fused_recurrent_lightnet(q, logits, v, output_final_state=True)
    k, gate, z_end = additive_gate_reference(logits)
    expected, expected_state = gated_linear_reference(q, k, v, gate)
    assert relative_error(o, expected) <= 1e-12 and relative_error(state, expected_state) <= 1e-12
    assert relative_error(z, z_end) <= 1e-13
    assert relative_error(o, naive_recurrent_gla(q, k, v, gate)[0]) <= 1e-6  # fla's own (float32) reference


# -- the adapters ------------------------------------------------------------------------------------------------------
def retention_with_conv(config, layer_idx):
    """RetNet's layer with its SiLU short convs (RetNetConfig does not pass use_short_conv to the layer)."""
    return "attn", MultiScaleRetention(hidden_size=config.hidden_size, expand_k=config.expand_k,
                                       expand_v=config.expand_v, num_heads=config.num_heads, use_short_conv=True,
                                       conv_size=4, norm_eps=config.norm_eps, layer_idx=layer_idx)


# name -> (config class, tiny kwargs, the values' submodule (the unified x), the layer's op names, replacement mixer)
MODELS = {
    "hgrn": ("HGRNConfig", common_config(), "i_proj", ("fused_recurrent_hgrn", "chunk_hgrn"), None),
    "hgrn_conv": ("HGRNConfig", common_config(use_short_conv=True, conv_size=4), "i_proj",
                  ("fused_recurrent_hgrn", "chunk_hgrn"), None),
    # 4 heads of 8 key and 8 value channels; layer 1 takes the model's lower bound
    "hgrn2": ("HGRN2Config", common_config(expand_ratio=8), "i_proj", ("fused_recurrent_gla", "chunk_gla"), None),
    "hgrn2_conv": ("HGRN2Config", common_config(expand_ratio=8, use_short_conv=True, conv_size=4), "i_proj",
                   ("fused_recurrent_gla", "chunk_gla"), None),
    "lightnet_conv": ("LightNetConfig", common_config(expand_ratio=8, gate_low_rank_dim=8, use_short_conv=True,
                                                      conv_size=4), "v_proj",
                      ("fused_recurrent_lightnet", "chunk_lightnet"), None),
    "linear_attn": ("LinearAttentionConfig", common_config(num_heads=2, feature_map="hedgehog", norm_feature_map=True),
                    "v_proj", ("fused_recurrent_linear_attn", "chunk_linear_attn"), None),
    "retnet_conv": ("RetNetConfig", common_config(num_heads=2, expand_k=0.5, expand_v=1.0), "v_proj",
                    ("fused_recurrent_retention", "chunk_retention"), retention_with_conv),
    "retnet_gqa": ("RetNetConfig", common_config(num_heads=4, num_kv_heads=2, expand_k=1.0, expand_v=1.0,
                                                 feature_map="relu", fuse_norm=False), "v_proj",
                   ("fused_recurrent_retention", "chunk_retention"), None),
}


def make_model(name, dtype=torch.float64, seed=0, **overrides):
    """The tiny model ``name`` of :data:`MODELS` (eval mode), its layers' 2-D weights redrawn larger as
    ``fla_models.make_fla_model`` does (fla's init gives tiny gates)."""
    config_class, kwargs, _, _, replacement = MODELS[name]
    config = getattr(fla_models, config_class)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if replacement is not None:
        for index, layer in enumerate(model.model.layers):
            setattr(layer, *replacement(config, index))
    return scale_up_mixer_weights(model.to(dtype).eval(), seed)


def lightnet_impulse(kwargs):
    """α (B, H, T, T) of LightNet's op from its recorded inputs: the reference gate, then fla's naive GLA on one-hot
    values."""
    q, logits = kwargs["q"].double(), kwargs["k"].double()
    batch, length, heads, _ = q.shape
    k, gate, _ = additive_gate_reference(logits)
    return naive_recurrent_gla(q, k, one_hot_values(batch, length, heads), gate)[0].permute(0, 2, 1, 3)


def linear_attn_impulse(kwargs):
    """α (B, H, T, T) of fla's linear-attention op (its normaliser included): ``naive_recurrent_linear_attn`` on
    one-hot values."""
    q, k = kwargs["q"].double(), kwargs["k"].double()
    batch, length, heads, _ = q.shape
    out, _ = naive_recurrent_linear_attn(q, k, one_hot_values(batch, length, heads), scale=kwargs.get("scale"),
                                         normalize=bool(kwargs.get("normalize", False)))
    return out.double().permute(0, 2, 1, 3)


def hgrn_impulse(kwargs):
    """α (B, D, T, T) of HGRN's elementwise op: fla's ``naive_recurrent_hgrn`` run once per source token s on
    x = e_s in every channel (column s of each channel's α)."""
    g = kwargs["g"].double()
    batch, length, width = g.shape
    one_hot = torch.eye(length, dtype=torch.float64)[None, :, :, None].expand(batch, length, length, width)
    out, _ = naive_recurrent_hgrn(one_hot.reshape(-1, length, width),
                                  g.repeat_interleave(length, dim=0))  # (B·S, T, D)
    return out.double().reshape(batch, length, length, width).permute(0, 3, 2, 1)


IMPULSES = {"hgrn": (hgrn_impulse, "x"), "hgrn2": (gla_impulse, "v"), "lightnet": (lightnet_impulse, "v"),
            "linear_attn": (linear_attn_impulse, "v"), "retnet": (None, "v")}


def records_of(name, model, ids, mask):
    """(x: the values' submodule output (B, L, C), the mixer's output (B, L, D)) of each mixer, by hooks."""
    records, handles = {}, []
    for mixer in fla_mixers(model):
        handles.append(mixer.get_submodule(MODELS[name][2]).register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=out.detach().clone())))
        handles.append(mixer.register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(out=out[0].detach())))
    run_hooked(model, ids, mask, handles)
    return records


@pytest.mark.parametrize("name,dtype", [(name, torch.float64) for name in MODELS if name != "retnet_gqa"]
                         + [("hgrn_conv", torch.float32), ("hgrn2", torch.float32)])
def test_unified_readout_of_H_x_equals_the_layer_output(name, dtype):
    model = make_model(name, dtype)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    operators = list(mc.build_operators(model, ids, mask, formulation="unified")[0].values())
    records = records_of(name, model, ids, mask)
    real = mask.bool()
    for mixer, op in zip(fla_mixers(model), operators):
        x = records[mixer]["x"].double()
        if x.shape[:2] != ids.shape:  # fla unpacked the batch: the hook saw the real tokens packed
            x = torch.zeros(*ids.shape, x.shape[-1], dtype=torch.float64).index_put_((real,),
                                                                                     x.reshape(-1, x.shape[-1]))
        H = op.maps(reduce=None).double()  # (B, C, L, L)
        got = op.readout(torch.einsum("bcis,bsc->bic", H, x).reshape(op.output.shape))
        expected = records[mixer]["out"].double()
        assert relative_error(got[real], expected[real]) <= (1e-6 if dtype == torch.float64 else 3e-5), name
    assert_untouched(model, before)


@pytest.mark.parametrize("name", ["hgrn_conv", "hgrn2_conv", "lightnet_conv", "linear_attn"])
def test_hidden_maps_equal_the_impulse_reference(name):
    model = make_model(name)
    ids = padded_batch(length=10)[0]
    impulse, value_key = IMPULSES[name.removesuffix("_conv")]
    with mc.fla_on_cpu(), OpRecorder(model, MODELS[name][3]) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators = list(mc.build_operators(model, ids, None, formulation="hidden")[0].values())
    assert len(recorder.calls) == len(operators) == 2
    for op, (_, kwargs, out) in zip(operators, recorder.calls):
        alpha = op.maps(reduce=None)  # (B, H, L, L)
        assert relative_error(alpha, impulse(kwargs)) <= 1e-6, name
        values = kwargs[value_key].double()
        got = torch.einsum("bhts,bshp->bthp", alpha, values if values.dim() == 4 else values[..., None])
        assert relative_error(got.reshape(out.shape), out.double()) <= 1e-6


@pytest.mark.parametrize("name,left", [("hgrn_conv", True), ("hgrn_conv", False), ("hgrn2_conv", True),
                                       ("lightnet_conv", True), ("linear_attn", True), ("retnet_conv", True)])
@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_batch_equals_single_examples_and_padding_equals_none(name, left, formulation):
    """HGRN runs its pads (a right pad's output is the decaying state): the rebuild reproduces them too."""
    model = make_model(name)
    assert_batch_equals_single_examples(model, *padded_batch(length=12, left=left), formulation=formulation)


@pytest.mark.parametrize("name", ["hgrn", "hgrn2", "lightnet_conv", "linear_attn", "retnet_conv"])
def test_a_cpu_training_step_runs_the_chunked_ops_and_matches_eval(name):
    """With gradients the layers take their chunked ops (fla's mode switch): the training loss equals the eval loss
    (the fused-recurrent path), and every mixer weight gets a finite gradient."""
    model = make_model(name, num_hidden_layers=1)
    assert_a_cpu_training_step_matches_eval(model, padded_batch(length=10)[0], 1e-10, every_weight=False)


@pytest.mark.parametrize("feature_map,extra", [("elementwise_product", {}), ("t2r", {}), ("dpfp", {}),
                                               ("elu", dict(norm_q=True, norm_k=True)), ("relu", dict(num_kv_heads=1)),
                                               ("identity", {})])
def test_linear_attention_feature_maps_rebuild_exactly(feature_map, extra):
    """The unified operator (checked against the layer's output by the library) for each feature map fla offers."""
    model = make_model("linear_attn", num_hidden_layers=1, feature_map=feature_map, norm_feature_map=False, **extra)
    ids, mask = padded_batch(length=10)
    maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")
    assert len(maps) == 1 and all(torch.isfinite(m).all() for m in maps.values())


@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_retnet_with_shared_key_value_heads_and_a_feature_map_rebuilds_exactly(formulation):
    """num_kv_heads < num_heads (keys and values repeated per head), a feature map before the rotary embedding, the
    unfused norm and gate: the library checks the operator against the layer's output and its maps."""
    model = make_model("retnet_gqa", num_hidden_layers=1)
    ids, mask = padded_batch(length=10)
    maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
    assert len(maps) == 1 and all(torch.isfinite(m).all() for m in maps.values())


def test_refusals_name_what_is_not_supported():
    model = make_model("hgrn2_conv", num_hidden_layers=1)
    conv = fla_mixers(model)[0].i_conv1d
    conv.bias = torch.nn.Parameter(torch.ones(conv.weight.shape[0], dtype=torch.float64))
    ids, mask = padded_batch(length=10)
    with pytest.raises(NotImplementedError, match="value conv has a bias"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")
    mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")  # the bias is a token's own input
    model = make_model("hgrn2", num_hidden_layers=1, attn_mode="fused_chunk")
    ids, mask = padded_batch(length=70)
    with pytest.raises(NotImplementedError, match="fused_chunk"):
        mc.implicit_attention(model, ids, attention_mask=mask)
