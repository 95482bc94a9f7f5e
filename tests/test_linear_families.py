"""Linear token mixers (delta rule, KDA, short convs, lightning attention, mLSTM, conv-V attention): the operators
reproduce each layer (y = H x against the test's own hooks and the HF kernels' own inputs), reductions and rows
agree with the per-channel maps, batches equal single examples, padding equals no padding, the three methods run,
and nothing is left on the model."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from test_engine import assert_untouched, model_state
from tiny_models import LINEAR_CONFIGS, VOCAB, make_model

import mamba_captum as mc
from mamba_captum.kernels.delta_rule import delta_rule_alpha_naive

TOL = 1e-5
LINEAR = list(LINEAR_CONFIGS)


def make(family, dtype=torch.float32, seed=0):
    # sdpa: HF's eager softmax gives NaN rows at left pads in float64
    model = make_model(family, dtype=dtype, seed=seed, attn_implementation="eager" if family == "xlstm" else "sdpa")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random-init projections give tiny gates: scale them so every factor matters
        for mixer in mixers(model):
            for name in ("in_proj", "qkv_proj"):
                if hasattr(mixer, name):
                    getattr(mixer, name).weight.mul_(8.0)
            for name in ("igate_preact", "fgate_preact"):  # xLSTM starts with constant gates (zero weights)
                if hasattr(mixer, name):
                    getattr(mixer, name).weight.normal_(0.0, 0.5, generator=generator)
            for name, parameter in mixer.named_parameters():  # KDA leaves these uninitialised (torch.empty)
                if name.endswith("A_log"):
                    parameter.copy_(torch.empty(parameter.shape).uniform_(0.0, 2.5, generator=generator))
                elif name.endswith("dt_bias"):
                    parameter.copy_(torch.empty(parameter.shape).uniform_(-3.0, 0.0, generator=generator))
    return model


def out_proj(mixer):
    return mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj


RIGHT_PADDED = {"xlstm"}  # mixers that ignore attention_mask: only right padding keeps the real tokens' result


def padded_batch(length=12, pads=3, seed=0, family=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    pad = slice(length - pads, None) if family in RIGHT_PADDED else slice(0, pads)
    ids[0, pad], mask[0, pad] = 0, 0  # padding in the first example (left, unless the family needs right)
    return ids, mask


def linear_operators(model, ids, mask, formulation, **kwargs):
    operators, _, _ = mc.build_operators(model, ids, mask, formulation=formulation, **kwargs)
    return {key: op for key, op in operators.items() if isinstance(op, mc.operators.HeadOperator)}


def mixers(model):
    names = set(mc.SUPPORTED_MIXERS)
    return [m for m in model.modules() if type(m).__name__ in names]


# How the test reads a layer's values (the unified operator's input) with its own hook: (submodule, function of
# the mixer and that submodule's output -> (B, L, H·P)).
def _gdn_values(mixer, projected):
    ba = projected.new_zeros(*projected.shape[:-1], 2 * mixer.num_v_heads)
    value = mixer.fix_query_key_value_ordering(projected, ba)[2]
    return value.reshape(*value.shape[:2], -1)


VALUE_TAPS = {
    "qwen3_next": ("in_proj_qkvz", _gdn_values),
    "qwen3_5": ("in_proj_qkv", lambda mixer, out: out[..., 2 * mixer.key_dim:]),
    "olmo_hybrid": ("v_proj", lambda mixer, out: out),
    "xlstm": ("v", lambda mixer, out: (lambda v: v - v.mean(-1, keepdim=True))(
        out.reshape(*out.shape[:2], mixer.config.num_heads, -1)).flatten(2)),  # the head-centred values
    "minimax": ("qkv_proj", lambda mixer, out: out.reshape(*out.shape[:2], mixer.num_attention_heads, 3, -1)[:, :, :, 2]
                .flatten(2)),
    "lfm2": ("in_proj", lambda mixer, out: out.chunk(3, dim=-1)[2]),
}
VALUE_TAPS["qwen3_5_moe"] = VALUE_TAPS["qwen4_exp"] = VALUE_TAPS["lara_mini"] = VALUE_TAPS["qwen3_5"]
VALUE_TAPS["kimi_linear"] = VALUE_TAPS["bailing_hybrid"] = VALUE_TAPS["glm5_next"] = VALUE_TAPS["olmo_hybrid"]
VALUE_TAPS["lfm2_moe"] = VALUE_TAPS["lfm3"] = VALUE_TAPS["lfm2"]
# The module-level kernel function each family's mixer calls, whose inputs and output the hidden identity reads.
KERNEL_FUNCTIONS = {
    **{family: (f"transformers.models.{family}.modeling_{family}", "torch_chunk_gated_delta_rule")
       for family in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "olmo_hybrid", "lara_mini")
       if family in LINEAR_CONFIGS},  # lara_mini: transformers >= 5.24
    **{family: (f"transformers.models.{family}.modeling_{family}", "chunk_kimi_delta_attention")
       for family in ("kimi_linear", "bailing_hybrid", "glm5_next")},
}


@pytest.mark.parametrize("family", LINEAR)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unified_identity_out_proj_input_equals_H_x(family, dtype):
    model = make(family, dtype)
    ids, mask = padded_batch(family=family)
    records, handles = {}, []
    tap, read_values = VALUE_TAPS[family]
    for mixer in mixers(model):
        handles.append(getattr(mixer, tap).register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=read_values(mixer, out))))
        handles.append(out_proj(mixer).register_forward_pre_hook(
            lambda mod, args, mixer=mixer: records.setdefault(mixer, {}).update(out_in=args[0].detach())))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in handles:
        h.remove()
    operators = linear_operators(model, ids, mask, "unified")
    assert len(operators) == len(mixers(model)) > 0
    for mixer, (key, op) in zip(mixers(model), operators.items()):
        H = op.maps(reduce=None).double()  # (B, C, L, L)
        assert H.shape[1] == op.value_channels
        x = records[mixer]["x"].double() * mask[:, :, None]  # the layer zeroes pad inputs
        got = torch.einsum("bcis,bsc->bic", H, x)
        expected = records[mixer]["out_in"].double() * mask[:, :, None]  # pad rows: the maps zero them
        assert relative_error(got, expected) <= (TOL if dtype == torch.float64 else 3e-5), (family, key)
        assert expected.abs().max() > 1e-3  # not vacuous


class KernelRecorder:
    """Patch a family's module-level kernel function: record its arguments and output."""

    def __init__(self, family):
        module_name, self.name = KERNEL_FUNCTIONS[family]
        self.module = importlib.import_module(module_name)
        self.original = getattr(self.module, self.name)
        self.calls = []

    def __enter__(self):
        def recording(*args, **kwargs):
            out = self.original(*args, **kwargs)
            self.calls.append((args, kwargs, out[0] if isinstance(out, tuple) else out))
            return out

        setattr(self.module, self.name, recording)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def delta_rule_reference(args, kwargs):
    """α (B, H_v, L, L) by the plain recurrence (float64) from the arguments HF's delta-rule kernel received, and
    the values (B, L, H_v, P)."""
    query, key, value = args[:3]
    g, beta = kwargs["g"], kwargs["beta"]
    q, k = query.double(), key.double()
    if kwargs.get("use_qk_l2norm_in_kernel"):
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    repeat = value.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2)
    return delta_rule_alpha_naive(q, k, beta.double(), g.double()), value.double()


@pytest.mark.parametrize("family", [f for f in LINEAR if f in KERNEL_FUNCTIONS])
def test_hidden_identity_against_the_kernels_own_inputs(family):
    model = make(family, torch.float64)
    ids, mask = padded_batch(family=family)
    # fla_on_cpu first: with fla installed, transformers sends these kernels to fla's Triton ones, even on a CPU
    with mc.fla_on_cpu(), KernelRecorder(family) as recorder, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    operators = linear_operators(model, ids, mask, "hidden")
    assert len(recorder.calls) == len(operators) > 0
    for (key, op), (args, kwargs, out) in zip(operators.items(), recorder.calls):
        alpha = op.maps(reduce=None)  # (B, H_v, L, L): one map per value head
        reference, values = delta_rule_reference(args, kwargs)
        keep = (mask[:, None, :, None] * mask[:, None, None, :]).double()  # pads: zero rows and columns
        assert alpha.shape == reference.shape
        # HF forms g in float32 (``a.float()``); the library in float64: the two differ by float32 rounding of g
        assert relative_error(alpha, reference * keep) <= 1e-6, (family, key)
        # HF's kernel runs in float32 even for float64 inputs: its output agrees to float32 rounding
        got = torch.einsum("bhts,bshp->bthp", alpha, values)
        real = out.double() * mask[:, :, None, None]
        assert relative_error(got, real) <= TOL, (family, key)
        assert relative_error(op.output, real) <= TOL


def gated_deltanet_float64(mixer, hidden, mask):
    """Qwen3.5's gated delta-net layer (its ``in_proj_qkv`` / ``z`` / ``b`` / ``a`` layout: Qwen3.5, LaraMini), written
    out from HF's forward in float64 all through (HF's kernel, its gated norm and its decay run in float32 even in a
    float64 model): a token loop over the state matrices S_t (B, H, K, P), no chunking, no library code.

    Returns (values before the conv (B, L, H·P), values after it (B, L, H, P), core output (B, L, H, P), out_proj input
    (B, L, H·P), layer output (B, L, D))."""
    h = hidden.double() if mask is None else hidden.double() * mask[:, :, None]
    batch, length, _ = h.shape
    heads, key_heads, key_dim, value_dim = mixer.num_v_heads, mixer.num_k_heads, mixer.head_k_dim, mixer.head_v_dim
    lin = lambda layer, x: x @ layer.weight.double().T  # noqa: E731
    qkv, z, b, a = (lin(getattr(mixer, name), h) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    taps = mixer.conv1d.weight.double()[:, 0]  # (C, K): output t reads inputs t - K + 1 .. t
    width = taps.shape[-1]
    padded = torch.cat([qkv.new_zeros(batch, width - 1, qkv.shape[-1]), qkv], dim=1)
    pre = sum(padded[:, j:j + length] * taps[:, j] for j in range(width))
    act = pre * torch.sigmoid(pre)
    q, k, v = act.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    unit = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731  FLA's l2norm
    q = unit(q.reshape(batch, length, key_heads, key_dim)).repeat_interleave(heads // key_heads, 2) * key_dim ** -0.5
    k = unit(k.reshape(batch, length, key_heads, key_dim)).repeat_interleave(heads // key_heads, 2)
    v = v.reshape(batch, length, heads, value_dim)
    beta = torch.sigmoid(b)
    decay = torch.exp(-torch.exp(mixer.A_log.double()) * F.softplus(a + mixer.dt_bias.double()))
    state = h.new_zeros(batch, heads, key_dim, value_dim)
    core = []
    for t in range(length):  # S_t = e^{g_t} S_{t-1} + β_t k_t (v_t − e^{g_t} S_{t-1}ᵀ k_t)ᵀ, o_t = S_tᵀ q_t
        state = state * decay[:, t, :, None, None]
        error = v[:, t] - torch.einsum("bhkp,bhk->bhp", state, k[:, t])
        state = state + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        core.append(torch.einsum("bhkp,bhk->bhp", state, q[:, t]))
    core = torch.stack(core, dim=1)
    normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon)
    gate = z.reshape(batch, length, heads, value_dim)
    inner = (mixer.norm.weight.double() * normed * gate * torch.sigmoid(gate)).reshape(batch, length, -1)
    return qkv[..., 2 * mixer.key_dim:], v, core, inner, lin(mixer.out_proj, inner)


# the gated delta-nets with Qwen3.5's projections and a silu-gated norm
QWEN3_5_LAYOUT = [family for family in ("qwen3_5", "lara_mini") if family in LINEAR_CONFIGS]


@pytest.mark.parametrize("family", QWEN3_5_LAYOUT)
def test_float64_maps_equal_a_float64_recurrence_to_1e12(family):
    """Exactness beyond HF's float32 internals: the float64 maps (unified and hidden, left padding, batch 2) reproduce
    a float64 token-loop transcription of the layer to 1e-12; the transcription is HF's layer (its real output
    agrees to HF's float32 kernel rounding)."""
    model = make(family, torch.float64)
    with torch.no_grad():  # make() scales only fused in_proj weights: spread these gates and decays too
        for mixer in mixers(model):
            for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
                getattr(mixer, name).weight.mul_(8.0)
    ids, mask = padded_batch(family=family)
    calls = {}

    def record(mod, args, kwargs, out):  # the decoder layer calls its delta-net with keywords
        calls[mod] = (kwargs["hidden_states"], kwargs["attention_mask"], out)

    handles = [mixer.register_forward_hook(record, with_kwargs=True) for mixer in mixers(model)]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for handle in handles:
        handle.remove()
    unified = linear_operators(model, ids, mask, "unified")
    hidden = linear_operators(model, ids, mask, "hidden")
    assert len(calls) == len(unified) == len(hidden) > 0
    keep = mask[:, :, None].double()
    for mixer, key in zip(mixers(model), unified):
        layer_input, layer_mask, real = calls[mixer]
        assert layer_mask is not None  # the model handed the padding mask to the delta-net
        value_pre, values, core, inner, out = gated_deltanet_float64(mixer, layer_input, layer_mask)
        assert relative_error(out * keep, real.double() * keep) <= 1e-5, (family, key)  # HF's float32 kernel
        H = unified[key].maps(reduce=None)  # (B, H·P, L, L)
        got = torch.einsum("bcts,bsc->btc", H, value_pre * keep)
        assert relative_error(got, inner * keep) <= 1e-12, (family, key)
        alpha = hidden[key].maps(reduce=None)  # (B, H, L, L)
        got = torch.einsum("bhts,bshp->bthp", alpha, values)
        assert relative_error(got, core * keep[..., None]) <= 1e-12, (family, key)
        assert relative_error(unified[key].output.flatten(2), inner * keep) <= 1e-12, (family, key)


@pytest.mark.skipif("lara_mini" not in LINEAR_CONFIGS, reason="lara_mini is new in transformers 5.24")
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_lara_mini_softmax_layers_a_window_and_a_global_layer(attn_implementation):
    """LaraMini's layers: the delta rule, a sliding-window attention (RoPE, window 4 of the 12 tokens) and a global
    attention without positions; each softmax map is its probabilities: rows sum to 1 on real tokens, the window's
    map is a band, the global one is not, pads get nothing."""
    model = make_model("lara_mini", attn_implementation=attn_implementation)
    ids, mask = padded_batch()
    maps = mc.implicit_attention(model, ids, mask)
    assert list(maps) == [0, 1, 2] and model.config.layer_types[1:] == ["sliding_attention", "full_attention"]
    window = model.config.sliding_window
    for layer in (1, 2):
        assert torch.allclose(maps[layer][0, 3:].sum(-1), torch.ones(9)) and maps[layer][0, :, :3].abs().max() == 0
    assert maps[1].tril(-window).abs().max() == 0  # only the last `window` tokens
    assert maps[2].tril(-window).abs().max() > 1e-3  # the global layer reaches every earlier token


@pytest.mark.parametrize("family", LINEAR)
@pytest.mark.parametrize("formulation", ["unified", "hidden"])
def test_reductions_rows_and_batches(family, formulation):
    model = make(family)
    ids, mask = padded_batch(family=family)
    full = mc.implicit_attention(model, ids, mask, formulation=formulation, reduce=None)
    rows = [0, -1, 5, 5]
    for reduce, fn in (("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1)),
                       ("abs_mean", lambda t: t.abs().mean(1))):
        reduced = mc.implicit_attention(model, ids, mask, formulation=formulation, reduce=reduce)
        some = mc.implicit_attention(model, ids, mask, formulation=formulation, reduce=reduce, rows=rows)
        for key in full:
            expected = fn(full[key])
            scale = max(1.0, expected.abs().max().item())
            assert (reduced[key] - expected).abs().max() <= 1e-6 * scale, (key, reduce)
            assert (some[key] - reduced[key][:, [0, 11, 5, 5]]).abs().max() <= 1e-6 * scale, (key, reduce)
    # the batch equals its examples one by one (the padded one without its pads)
    single = mc.implicit_attention(model, ids[1:], formulation=formulation)
    real, pads = (slice(0, 9), slice(9, None)) if family in RIGHT_PADDED else (slice(3, None), slice(0, 3))
    unpadded = mc.implicit_attention(model, ids[:1, real], formulation=formulation)
    batched = mc.implicit_attention(model, ids, mask, formulation=formulation)
    for key in batched:
        assert relative_error(batched[key][1], single[key][0]) <= 1e-5, key
        assert relative_error(batched[key][0, real, real], unpadded[key][0]) <= 1e-4, key
        assert batched[key][0, pads].abs().max() == 0 and batched[key][0, :, pads].abs().max() == 0


@pytest.mark.parametrize("family", LINEAR)
def test_hidden_gives_one_map_per_value_head(family):
    model = make(family)
    ids, mask = padded_batch(family=family)
    for op in linear_operators(model, ids, mask, "hidden").values():
        assert op.maps(reduce=None).shape == (2, op.heads, 12, 12) and op.channels == op.heads


@pytest.mark.parametrize("family", LINEAR)
def test_every_method_runs_and_leaves_the_model_untouched(family):
    model = make(family)
    before = model_state(model)
    ids, mask = padded_batch(family=family)
    forward_func = None
    if not hasattr(model, "lm_head"):  # a base model (glm5_next's text model): a head of our own
        head = torch.nn.Linear(model.config.hidden_size, 4)
        forward_func = lambda ids, attention_mask=None: head(  # noqa: E731
            model(ids, attention_mask=attention_mask).last_hidden_state[:, -1])
    for method in (mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution):
        explainer = method(model) if forward_func is None else method(model, forward_func=forward_func)
        relevance = explainer.attribute(ids, attention_mask=mask, start_layer=0,
                                        **({} if forward_func is None else {"target": 1}))
        assert relevance.shape == (2, 12) and torch.isfinite(relevance).all()
        pads = slice(9, None) if family in RIGHT_PADDED else slice(0, 3)
        assert relevance[0, pads].abs().max() == 0  # pads get nothing
    assert_untouched(model, before)


def test_unsupported_mixer_error_names_class_and_model_type():
    from mamba_captum.families import locate

    class MysteryDeltaNet(torch.nn.Module):
        pass

    model = make("qwen3_next")
    model.model.layers[0].linear_attn = MysteryDeltaNet()
    with pytest.raises(TypeError, match=r"MysteryDeltaNet.*qwen3_next"):
        locate(model)


# The published checkpoints of these text models are vision-language models (Qwen3.5, GLM-5-Next, LFM2-VL, ...):
# (model type, the text model of tiny_models inside it)
VISION_LANGUAGE = [("qwen3_5", "qwen3_5"), ("qwen3_5_moe", "qwen3_5_moe"), ("qwen4_exp", "qwen4_exp"),
                   ("glm5_next", "glm5_next"), ("lfm2_vl", "lfm2"), ("lfm3_vl", "lfm3")]


def vision_language(model_type, text):
    """A tiny random ``*ForConditionalGeneration`` of ``model_type`` with ``text``'s tiny text config (float64)."""
    import transformers as tf

    config = tf.AutoConfig.for_model(model_type, text_config=LINEAR_CONFIGS[text]().to_dict())
    for key, value in dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, depth=1,
                           num_heads=2, out_hidden_size=config.text_config.hidden_size).items():
        if hasattr(config.vision_config, key):
            setattr(config.vision_config, key, value)
    if getattr(config.vision_config, "layer_types", None):  # LFM3-VL's tower: one type per layer
        config.vision_config.layer_types = config.vision_config.layer_types[:config.vision_config.num_hidden_layers]
    for part in (config, config.text_config):
        part._attn_implementation, part._experts_implementation = "sdpa", "eager"
    torch.manual_seed(0)
    return tf.AutoModelForImageTextToText.from_config(config).to(torch.float64).eval()


@pytest.mark.parametrize("model_type, text", VISION_LANGUAGE)
def test_a_vision_language_model_explains_its_language_model(model_type, text):
    # its vision tower's block list is as shallow as the language model's layers: the maps must come from the latter
    model = vision_language(model_type, text)
    before = model_state(model)
    ids, mask = padded_batch()
    maps = mc.implicit_attention(model, ids, attention_mask=mask)
    alone = mc.implicit_attention(model.get_decoder(), ids, attention_mask=mask)
    assert list(maps) == list(alone) == list(range(model.config.text_config.num_hidden_layers))
    assert all(torch.equal(maps[layer], alone[layer]) for layer in maps)
    relevance = mc.MambaAttribution(model).attribute(ids, attention_mask=mask, target=5)
    assert relevance.shape == (2, 12) and torch.isfinite(relevance).all() and relevance[0, :3].abs().max() == 0
    assert_untouched(model, before)
