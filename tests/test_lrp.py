"""MambaLRP: the rules on hand-computed cases, conservation per family (float64: Σ relevance + the biases' share =
the logit of the modified forward, which is the model's own logit), the modified forward's values, Captum's
conventions (targets, batch = single examples, padding), and nothing left on the model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mamba_captum as mc
from mamba_captum import rules
from mamba_captum.attention_capture import ATTENTION_PATCH
from tiny_models import LINEAR_CONFIGS, make_model

TARGET = 5


# -- the rules, by hand ---------------------------------------------------------------------------------------------
def _relevance(output, *inputs):
    """gradient × input of Σ output for each input."""
    grads = torch.autograd.grad(output.sum(), inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g * x for g, x in zip(grads, inputs)]


def test_half_rule_splits_a_product_fifty_fifty():
    x = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64, requires_grad=True)
    a, b = 3.0 * x, x - 0.5 * x.flip(0)  # two factors that both depend on x
    ra, rb = _relevance(rules.half_product(a, b), a, b)
    assert torch.allclose(rules.half_product(a, b), a * b)
    assert torch.allclose(ra, 0.5 * a * b) and torch.allclose(rb, 0.5 * a * b)
    # through the factors' linear maps back to x: the product's relevance, all of it
    (rx,) = _relevance(rules.half_product(a, b), x)
    assert torch.allclose(rx.sum(), (a * b).sum())


@pytest.mark.parametrize("act", [torch.sigmoid, F.silu, F.gelu, torch.tanh])
def test_identity_rule_gives_the_activation_all_of_its_relevance(act):
    x = torch.tensor([-2.0, -0.3, 0.4, 1.7], dtype=torch.float64, requires_grad=True)
    out = rules.identity_rule(x, act(x))
    assert torch.allclose(out, act(x))
    (rx,) = _relevance(out, x)
    assert torch.allclose(rx, act(x))  # element by element


def test_identity_rule_keeps_a_nonzero_value_at_zero_as_a_constant():
    x = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    out = rules.identity_rule(x, torch.sigmoid(x))
    assert torch.allclose(out, torch.sigmoid(x))
    (rx,) = _relevance(out, x)
    assert rx[0] == 0 and torch.isclose(rx[1], torch.sigmoid(x[1]))


def test_silu_rule_is_the_identity_rule():
    x = torch.tensor([-1.5, 0.0, 0.2, 3.0], dtype=torch.float64, requires_grad=True)
    (rx,) = _relevance(rules.silu_rule(x), x)
    assert torch.allclose(rules.silu_rule(x), F.silu(x)) and torch.allclose(rx, F.silu(x))


def test_a_detached_factor_takes_no_relevance():
    x = torch.tensor([0.5, -2.0], dtype=torch.float64, requires_grad=True)
    scale = torch.softmax(3.0 * x, 0)  # a data-dependent factor, e.g. a probability
    (rx,) = _relevance(rules.scaled(x, scale), x)
    assert torch.allclose(rules.scaled(x, scale), scale * x) and torch.allclose(rx, scale * x)


def test_sigmoid_gates_signal_takes_all_or_half():
    x = torch.tensor([0.3, -1.2, 2.5], dtype=torch.float64, requires_grad=True)
    pre, value = 2.0 * x - 0.1, 3.0 * x
    expected = torch.sigmoid(pre) * value
    r_pre, r_value = _relevance(rules.sigmoid_gate(pre, value), pre, value)
    assert torch.allclose(rules.sigmoid_gate(pre, value), expected)
    assert r_pre.abs().max() == 0 and torch.allclose(r_value, expected)  # the default: the signal takes all
    with rules.sigmoid_gates("half"):
        r_pre, r_value = _relevance(rules.sigmoid_gate(pre, value), pre, value)
    assert torch.allclose(r_pre, 0.5 * expected) and torch.allclose(r_value, 0.5 * expected)
    with pytest.raises(ValueError):
        with rules.sigmoid_gates("identity"):
            pass


def test_norm_rules_conserve_per_token():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    weight, bias = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64, requires_grad=True)
    rms = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    out = rules.rms_norm_rule(x, rms)
    assert torch.allclose(out, rms)
    (rx,) = _relevance(out, x)
    assert torch.allclose(rx, rms)  # feature by feature: the normaliser takes nothing
    layer = F.layer_norm(x, (6,), weight, bias, 1e-5)
    out = rules.layer_norm_rule(x, weight, bias, 1e-5)
    assert torch.allclose(out, layer)
    rx, rb = _relevance(out, x, bias)
    assert torch.allclose(rx.sum(-1) + bias.sum() * 0, (out - bias).sum(-1))  # per token: all but the bias
    assert torch.allclose(rb, bias * 6)  # the bias keeps its own value, at every one of the 6 tokens


# -- helpers --------------------------------------------------------------------------------------------------------
def spread_biases(model, seed=1):
    """Random biases everywhere (a random init leaves most of them 0); returns them, requiring grad."""
    generator = torch.Generator().manual_seed(seed)
    biases = []
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") and parameter.is_floating_point():
                parameter.uniform_(-0.5, 0.5, generator=generator)
                biases.append(parameter.requires_grad_(True))
    return biases


def zero_biases(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") and parameter.is_floating_point():
                parameter.zero_()


def float64_head(model):
    """forward_func: the last position's logits in the model's dtype (HF's causal LMs cast them to float32; the
    conservation is checked against these), without any soft-capping of the head."""
    def forward(ids, attention_mask=None, **kwargs):
        hidden = model.base_model(ids, attention_mask=attention_mask, use_cache=False, **kwargs).last_hidden_state
        return model.get_output_embeddings()(hidden)[:, -1]
    return forward


def explain_with_share(model, ids, mask=None, target=TARGET, **forward_kwargs):
    """(relevance, delta, bias share, explained score of the modified forward, real score), float64 head."""
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and p.requires_grad]
    head = float64_head(model)
    method = mc.MambaLRP(model, forward_func=head)
    relevance, delta, share = method._relevance_and_gap(ids, target, None, mask, None, forward_kwargs, parameters=biases)
    with torch.no_grad():
        real = head(ids, attention_mask=mask, **forward_kwargs)[:, target]
    modified = relevance.sum(-1).double() - delta  # delta = Σ relevance − the modified forward's score
    return relevance, delta, share, modified, real


def no_hooks_left(model):
    hooked = [name for name, module in model.named_modules() if module._forward_hooks or module._forward_pre_hooks]
    return not hooked and ATTENTION_PATCH.users == 0


# -- Mamba-1 --------------------------------------------------------------------------------------------------------
MAMBA1 = ["mamba", "falcon_mamba"]
# residual_in_fp32 (the default) rounds the residual stream of a float64 model to float32 in every block: the
# model's own rounding, which no relevance can follow; float64 all through for the float64 conservation checks
EXACT = dict(residual_in_fp32=False)


# Per family: the config overrides that give every bias a chance (in_proj / out_proj biases of the SSM mixers).
CONSERVING = {"mamba": dict(use_bias=True), "falcon_mamba": dict(use_bias=True), "mamba2": dict(use_bias=True),
              "jamba": {}, "bamba": dict(attention_bias=True, mamba_proj_bias=True, mlp_bias=True),
              "nemotron_h": dict(mlp_bias=True, use_bias=True),
              "falcon_h1": dict(attention_bias=True, mamba_proj_bias=True, mlp_bias=True, projectors_bias=True),
              "granitemoehybrid": dict(attention_bias=True, mamba_proj_bias=True),
              "zamba2": dict(add_bias_linear=True), "rwkv": {}, "recurrent_gemma": {},
              "zamba": {}, "qwen3_next": dict(attention_bias=True), "qwen3_5": dict(attention_bias=True),
              "qwen3_5_moe": dict(attention_bias=True), "olmo_hybrid": dict(attention_bias=True),
              "kimi_linear": dict(attention_bias=True), "bailing_hybrid": dict(attention_bias=True), "minimax": {},
              "lfm2": dict(conv_bias=True), "lfm2_moe": dict(conv_bias=True), "lfm3": dict(conv_bias=True),
              "xlstm": dict(use_bias=True)}
if "lara_mini" in LINEAR_CONFIGS:  # transformers >= 5.24
    CONSERVING["lara_mini"] = dict(attention_bias=True)
NO_BIASES = {"minimax"}  # no bias anywhere in these configs


@pytest.mark.parametrize("family", list(CONSERVING))
def test_conservation_with_biases(family):
    """Σ relevance + the biases' share (Σ bias · ∂score/∂bias under the rules) = the modified forward's logit to
    float64 precision, which is the model's own logit (to the float32 HF runs some float64 steps in)."""
    model = make_model(family, dtype=torch.float64, **EXACT, **CONSERVING[family])
    spread_biases(model)
    ids = torch.randint(3, 64, (1, 10))
    relevance, delta, share, modified, real = explain_with_share(model, ids)
    assert abs(share) > 1e-4 or family in NO_BIASES  # the biases matter here
    # the sums' rounding: relative to the largest terms (LayerNorm's centring makes large cancelling relevances)
    scale = max(1.0, abs(float(modified)), abs(share), float(relevance.abs().sum()))
    assert abs(float(delta) + share) <= 1e-13 * scale
    assert abs(float(modified) - float(real)) <= 1e-6 * max(1.0, abs(float(real)))
    assert no_hooks_left(model)


@pytest.mark.parametrize("family", list(CONSERVING))
def test_without_biases_the_relevance_sums_to_the_logit(family):
    model = make_model(family, dtype=torch.float64, **EXACT)
    zero_biases(model)
    ids = torch.randint(3, 64, (2, 9))
    relevance, delta = mc.MambaLRP(model, forward_func=float64_head(model)).attribute(
        ids, target=TARGET, return_convergence_delta=True)
    assert relevance.shape == (2, 9) and relevance.dtype == torch.float64
    assert (delta.abs() <= 1e-13 * relevance.abs().sum(-1).clamp(min=1.0)).all()


def _rms_detached(norm, x):
    return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).detach()


def _reference_mixer(mixer, h):
    """MambaMixer under the MambaLRP rules, written out from the paper (token loop, no library code)."""
    length = h.shape[1]
    x, z = mixer.in_proj(h).chunk(2, dim=-1)
    conv = mixer.conv1d(x.transpose(1, 2))[..., :length].transpose(1, 2)
    u = conv * torch.sigmoid(conv).detach()  # SiLU, identity rule
    dt, B, C = mixer.x_proj(u).split([mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    delta = F.softplus(mixer.dt_proj(dt))
    A = -torch.exp(mixer.A_log)
    decay = torch.exp(delta[..., None] * A).detach()  # Δ, B, C detached
    inject = (delta[..., None] * B[:, :, None, :]).detach()
    state = h.new_zeros(h.shape[0], x.shape[-1], A.shape[-1])
    ys = []
    for t in range(length):
        state = decay[:, t] * state + inject[:, t] * u[:, t, :, None]
        ys.append((state * C[:, t, None, :].detach()).sum(-1))
    y = torch.stack(ys, 1) + mixer.D * u
    out = y * (z * torch.sigmoid(z).detach())  # gate, SiLU by the identity rule
    out = 0.5 * out + 0.5 * out.detach()  # the half rule, as a product of two linear factors
    return mixer.out_proj(out)


def test_mamba1_matches_a_reference_written_from_the_paper():
    model = make_model("mamba", dtype=torch.float64)
    spread_biases(model)
    ids = torch.randint(3, 64, (2, 7))
    embeddings = model.backbone.embeddings(ids).detach().requires_grad_(True)
    hidden = embeddings
    for block in model.backbone.layers:
        hidden = hidden + _reference_mixer(block.mixer, _rms_detached(block.norm, hidden))
    logit = model.lm_head(_rms_detached(model.backbone.norm_f, hidden))[:, -1, TARGET]
    (grad,) = torch.autograd.grad(logit.sum(), embeddings)
    expected = (grad * embeddings).sum(-1)
    relevance = mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert (relevance - expected).abs().max() <= 1e-6 * expected.abs().max()


# -- every covered family: the modified forward, Captum's conventions, padding, nothing left behind -----------------
HYBRIDS = ["jamba", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba2", "zamba"]
LINEAR = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "minimax", "lfm2",
          "lfm2_moe", "lfm3"] + [family for family in ("lara_mini",) if family in LINEAR_CONFIGS]  # lara_mini: >= 5.24
MASKED = MAMBA1 + ["mamba2"] + HYBRIDS + LINEAR  # families whose mixers take attention_mask (left padding)
RECURRENT = ["rwkv", "recurrent_gemma", "xlstm"]  # mixers that ignore attention_mask: right padding only
SOFTMAX = set(HYBRIDS) | set(LINEAR) | {"recurrent_gemma"}  # families with softmax attention layers
COVERED = MASKED + RECURRENT


def modified_logits(model, ids, mask=None, **kwargs):
    """The logits of the model's forward under the rules (the context manager the method uses)."""
    from mamba_captum.checks import model_dtype
    from mamba_captum.families import locate
    from mamba_captum.families.lrp_plan import lrp_plan
    from mamba_captum.lrp_forward import LRPForward

    dtype = model_dtype(model)
    plan = lrp_plan(model, locate(model)[1])
    token_mask = torch.ones(ids.shape, dtype=torch.float32) if mask is None else mask.float()
    with torch.enable_grad(), LRPForward(plan, model.get_input_embeddings(), token_mask,
                                         torch.float64 if dtype == torch.float64 else torch.float32, dtype,
                                         model) as rules_on:
        logits = model(ids, attention_mask=mask, use_cache=False, **kwargs).logits
        assert rules_on.embeddings and rules_on.embeddings[0].requires_grad and logits.requires_grad
    return logits.detach()


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float64, 1e-6)])
@pytest.mark.parametrize("family", COVERED)
def test_the_modified_forward_gives_the_models_output(family, dtype, bound):
    model = make_model(family, dtype=dtype)
    spread_biases(model)
    ids = torch.randint(3, 64, (2, 8))
    with torch.no_grad():
        real = model(ids, use_cache=False).logits
    modified = modified_logits(model, ids)
    assert (modified - real).abs().max() <= bound * real.abs().max()
    assert no_hooks_left(model)


@pytest.mark.parametrize("family", COVERED)
def test_batch_equals_single_examples_and_targets_follow_captum(family):
    model = make_model(family)
    ids = torch.randint(3, 64, (3, 7))
    method = mc.MambaLRP(model)
    batched = method.attribute(ids, target=[4, 9, 11])
    singles = torch.cat([method.attribute(ids[i:i + 1], target=t) for i, t in enumerate([4, 9, 11])])
    assert batched.shape == (3, 7)
    assert (batched - singles).abs().max() <= 1e-5 * singles.abs().max()
    assert torch.equal(method.attribute(ids, target=(4,)), method.attribute(ids, target=4))
    argmax = model(ids).logits[:, -1].argmax(-1)
    assert torch.allclose(method.attribute(ids), method.attribute(ids, target=argmax))
    with pytest.raises(IndexError):
        method.attribute(ids, target=64)
    assert no_hooks_left(model) and torch.is_grad_enabled()


@pytest.mark.parametrize("family", MASKED)
def test_left_padding_gives_the_unpadded_relevance(family):
    # sdpa: HF's eager attention gives NaN on fully padded rows in float64
    model = make_model(family, dtype=torch.float64, attn_implementation="sdpa" if family in SOFTMAX else "eager")
    spread_biases(model)
    ids = torch.randint(3, 64, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    method = mc.MambaLRP(model)
    alone, delta_alone = method.attribute(ids, target=TARGET, return_convergence_delta=True)
    relevance, delta = method.attribute(padded, target=TARGET, attention_mask=mask, return_convergence_delta=True)
    assert relevance[:, :3].abs().max() == 0
    assert (relevance[:, 3:] - alone).abs().max() <= 1e-6 * alone.abs().max()
    assert abs(float(delta - delta_alone)) <= 1e-6


@pytest.mark.parametrize("family", COVERED)
def test_embeddings_give_per_feature_relevance(family):
    model = make_model(family, dtype=torch.float64)
    ids = torch.randint(3, 64, (2, 6))
    embeddings = model.get_input_embeddings()(ids).detach()
    method = mc.MambaLRP(model)
    per_feature = method.attribute(embeddings, target=TARGET)
    assert per_feature.shape == embeddings.shape
    assert torch.allclose(per_feature.sum(-1), method.attribute(ids, target=TARGET))
    (as_tuple,) = method.attribute((embeddings,), target=TARGET)
    assert torch.equal(as_tuple, per_feature)


def test_captum_flags_and_nothing_left_after_an_error():
    model = make_model("mamba")
    method = mc.MambaLRP(model)
    assert method.multiplies_by_inputs and method.has_convergence_delta()
    with pytest.raises(NotImplementedError):
        method.attribute_future(torch.ones(1, 3, dtype=torch.long))
    ids = torch.randint(3, 64, (2, 5))
    with pytest.raises(ValueError):
        method.attribute(ids, target=[1, 2, 3])  # three targets for two examples: raised inside the forward's context
    assert no_hooks_left(model) and torch.is_grad_enabled()
    with torch.no_grad():
        method.attribute(ids, target=1)
        assert not torch.is_grad_enabled()
    with mc.MambaLRP(model) as attr:
        attr.attribute(ids, target=1)
    assert no_hooks_left(model)
    assert all(p.grad is None for p in model.parameters())


# -- softmax layers of hybrids: the value path only ------------------------------------------------------------------
def _attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "v_proj")]


@pytest.mark.parametrize("family", sorted(SOFTMAX))
def test_softmax_layers_pass_relevance_through_the_values_only(family):
    model = make_model(family, dtype=torch.float64)
    attention = _attention_modules(model)
    assert attention
    ids = torch.randint(3, 64, (1, 8))
    method = mc.MambaLRP(model)
    queries_keys = [m.q_proj.weight for m in attention] + [m.k_proj.weight for m in attention]
    values = [m.v_proj.weight for m in attention]
    assert method._relevance_and_gap(ids, TARGET, None, None, None, {}, parameters=queries_keys)[2] == 0.0  # P̄: no gradient
    assert method._relevance_and_gap(ids, TARGET, None, None, None, {}, parameters=values)[2] != 0.0


def test_rwkv_wkv_weights_pass_no_relevance():
    # keys, decay and bonus set the WKV weights (this layer's selection, detached); the values carry the relevance
    model = make_model("rwkv", dtype=torch.float64)
    blocks = [m for m in model.modules() if type(m).__name__ == "RwkvSelfAttention"]
    ids = torch.randint(3, 64, (1, 8))
    method = mc.MambaLRP(model)
    selection = [p for m in blocks for p in (m.time_decay, m.time_first, m.key.weight)]
    assert method._relevance_and_gap(ids, TARGET, None, None, None, {}, parameters=selection)[2] == 0.0
    assert method._relevance_and_gap(ids, TARGET, None, None, None, {}, parameters=[m.value.weight for m in blocks])[2] != 0.0


def test_a_sequence_classifier_explains_its_pooled_logit():
    import transformers as tf

    causal = make_model("jamba", dtype=torch.float64, **EXACT)
    config = causal.config.__class__(**{**causal.config.to_dict(), "num_labels": 3})
    config._experts_implementation = "eager"  # grouped_mm takes no float64
    torch.manual_seed(0)
    model = tf.JambaForSequenceClassification(config).to(torch.float64).eval()
    ids = torch.randint(3, 64, (2, 7))
    relevance, delta = mc.MambaLRP(model).attribute(ids, target=[0, 2], return_convergence_delta=True)
    assert relevance.shape == (2, 7)
    assert delta.abs().max() <= 1e-12  # the score head has no bias; the logits are float64 here
    with pytest.raises(ValueError):
        mc.MambaLRP(model).attribute(ids, target=0, position=3)


def test_a_soft_capped_head_takes_the_identity_rule():
    """RecurrentGemma soft-caps its logits, s = c · tanh(z / c), inside its forward: the relevance sums to s."""
    model = make_model("recurrent_gemma", dtype=torch.float64)
    zero_biases(model)
    ids = torch.randint(3, 64, (2, 7))
    relevance, delta = mc.MambaLRP(model).attribute(ids, target=TARGET, return_convergence_delta=True)
    assert (delta.abs() <= 1e-13 * relevance.abs().sum(-1).clamp(min=1.0)).all()
    model.config.logits_soft_cap = 0.05  # a cap that bites: s ≠ z
    capped, delta = mc.MambaLRP(model).attribute(ids, target=TARGET, return_convergence_delta=True)
    assert (delta.abs() <= 1e-13 * capped.abs().sum(-1).clamp(min=1.0)).all()
    with torch.no_grad():
        s = model(ids).logits[:, -1, TARGET]
        z = torch.atanh(s / 0.05) * 0.05
    # the cap scales every token alike (s / z from the real logits: HF runs the RG-LRU in float32)
    assert torch.allclose(capped, relevance * (s / z)[:, None], rtol=1e-4)


def test_rwkv_sigmoid_gates_both_conserve():
    model = make_model("rwkv", dtype=torch.float64)
    zero_biases(model)
    ids = torch.randint(3, 64, (2, 7))
    method = mc.MambaLRP(model)
    signal, delta = method.attribute(ids, target=TARGET, return_convergence_delta=True)
    half, delta_half = method.attribute(ids, target=TARGET, sigmoid_gates="half", return_convergence_delta=True)
    assert (delta.abs() <= 1e-13 * signal.abs().sum(-1).clamp(min=1.0)).all()
    assert (delta_half.abs() <= 1e-13 * half.abs().sum(-1).clamp(min=1.0)).all()
    assert not torch.allclose(signal, half)
    with pytest.raises(ValueError, match="sigmoid_gates"):
        method.attribute(ids, target=TARGET, sigmoid_gates="identity")


# -- what is not covered is refused, naming the module -----------------------------------------------------------------
# GLM-5-next, Qwen4-exp, NemotronH's experts, ZAYA, Inkling and Vision Mamba have rules now
# (tests/test_lrp_new_families.py); the image models without them are refused by name
def test_image_models_without_rules_are_refused():
    from test_mambaout import tiny_model

    model = tiny_model()
    with pytest.raises(NotImplementedError, match="MambaOut"):
        mc.MambaLRP(model)
    assert no_hooks_left(model)


def test_an_inline_sigmoid_gate_refuses_the_half_rule():
    model = make_model("qwen3_5")  # its attention multiplies by σ(gate) inside its forward
    with pytest.raises(NotImplementedError, match="sigmoid_gates='signal'"):
        mc.MambaLRP(model).attribute(torch.randint(3, 64, (1, 5)), target=TARGET, sigmoid_gates="half")
    assert no_hooks_left(model) and torch.is_grad_enabled()


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_half_precision_conserves_to_its_rounding(family, dtype, bound):
    model = make_model(family, dtype=dtype)
    ids = torch.randint(3, 64, (2, 8))
    relevance, delta = mc.MambaLRP(model).attribute(ids, target=TARGET, return_convergence_delta=True)
    assert relevance.dtype == torch.float32
    assert (delta.abs() <= bound * relevance.abs().sum(-1)).all()


def test_train_mode_dropout_is_refused_and_train_mode_without_it_works():
    ids = torch.randint(3, 64, (1, 5))
    with pytest.raises(ValueError, match="eval"):
        mc.MambaLRP(make_model("jamba", attention_dropout=0.1).train()).attribute(ids, target=1)
    model = make_model("mamba").train()
    relevance, delta = mc.MambaLRP(model).attribute(ids, target=1, return_convergence_delta=True)
    assert model.training and abs(float(delta)) <= 1e-5 * max(1.0, float(relevance.abs().sum()))


def test_a_compiled_model_gives_the_plain_models_relevance():
    from mamba_captum.demo import load_demo

    model, tokenizer = load_demo()
    ids = tokenizer("the plot was not good", return_tensors="pt")["input_ids"]
    plain = mc.MambaLRP(model).attribute(ids, target=3)
    compiled = torch.compile(model)
    assert torch.equal(mc.MambaLRP(compiled).attribute(ids, target=3), plain)  # the session runs it eagerly
    assert no_hooks_left(model)


# -- the run-time conservation guard ----------------------------------------------------------------------------------
GUARD_MESSAGE = (r"relevance out − relevance in − its biases' share = (?P<gap>[0-9.e+-]+) for example \d+, "
                 r"(?P<relative>[0-9.e+-]+) relative to the relevance through it \([0-9.e+-]+\), above the "
                 r"(?P<dtype>\w+) tolerance (?P<tolerance>[0-9.e+-]+)")


def _gradient_scaled_half_product(a, b):
    """The half rule with the gradient 1.01 times too large and the value unchanged: a mistaken rule that the value
    check (ReconstructionError) cannot see."""
    return 0.505 * a * b.detach() + 0.505 * a.detach() * b - (0.01 * a * b).detach()


def _stabilised_identity_rule(x, activated):
    """The identity rule with the ratio act(x) / (x + 1e-6·sign x) (a stabiliser, as the authors' code has) and the
    value kept: relevance ≠ value by ~1e-6 / |x|, far inside the value check's tolerance."""
    ratio = activated.detach() / (x.detach() + 1e-6 * torch.sign(x.detach()))
    return x * ratio + (activated - x * ratio).detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rule_with_a_wrong_gradient_raises_instead_of_returning(monkeypatch, dtype):
    """A rule whose gradient no longer matches its value keeps the modified forward's value (no ReconstructionError)
    but leaks relevance: the guard raises, naming the module, the measured gap and the tolerance."""
    import re

    from mamba_captum.conservation import conservation_tolerance

    model = make_model("jamba", dtype=dtype)
    ids = torch.randint(3, 64, (2, 7))
    method = mc.MambaLRP(model)
    method.attribute(ids, target=TARGET)  # conserves as it is
    monkeypatch.setattr(rules, "half_product", _gradient_scaled_half_product)
    with pytest.raises(mc.ConservationError, match=r"not conserved through model\.layers\.\d+\.feed_forward "
                                                   r"\(JambaMLP\)") as raised:
        method.attribute(ids, target=TARGET)
    found = re.search(GUARD_MESSAGE, str(raised.value))
    assert found, str(raised.value)
    tolerance = conservation_tolerance(dtype)["module"]
    assert float(found["tolerance"]) == tolerance and found["dtype"] == str(dtype).removeprefix("torch.")
    # the leak is 1 % of the relevance through the product, which is at most Σ|∂f̃/∂x ⊙ x|: at most 1 % relative
    assert float(found["gap"]) > 0 and tolerance < float(found["relative"]) <= 1e-2
    assert isinstance(raised.value, mc.ReconstructionError)  # one except clause catches both checks
    assert no_hooks_left(model) and torch.is_grad_enabled()


def test_a_changed_epsilon_is_caught_in_float64(monkeypatch):
    """A stabiliser of 1e-6 in the identity rule's ratio: the relevance of every RMS norm and MLP is off by ~1e-6,
    which float64's module tolerance (1e-11) sees."""
    model = make_model("mamba", dtype=torch.float64)
    ids = torch.randint(3, 64, (1, 6))
    monkeypatch.setattr(rules, "identity_rule", _stabilised_identity_rule)
    with pytest.raises(mc.ConservationError, match=r"not conserved through backbone\.layers\.0\.norm \(MambaRMSNorm\)"
                                                   r".* above the float64 tolerance 1e-11"):
        mc.MambaLRP(model).attribute(ids, target=TARGET)


def test_scaling_a_rules_output_is_caught_by_the_value_check(monkeypatch):
    """A rule whose output is 1.01 times the module's (value and gradient alike) still conserves (the engine passes the
    rule's value on), and the module check against the real output raises."""
    model = make_model("jamba")
    monkeypatch.setattr(rules, "half_product", lambda a, b: 1.01 * (0.5 * a * b.detach() + 0.5 * a.detach() * b))
    with pytest.raises(mc.ReconstructionError, match="JambaMLP.*does not reproduce"):
        mc.MambaLRP(model).attribute(torch.randint(3, 64, (1, 6)), target=TARGET)


def test_a_non_linear_step_outside_the_rules_fails_the_whole_model_check():
    """A step the library reads as linear that is not (here a forward hook squashing a block's output, as a changed
    decoder layer would), or a non-linear step of a forward_func before the model's head: every module conserves,
    the sum does not. After the head, a forward_func is differentiated as it is (the evaluation explains
    log-probabilities): the check stops at the head."""
    model = make_model("mamba")
    ids = torch.randint(3, 64, (2, 6))
    handle = model.backbone.layers[0].register_forward_hook(lambda module, args, output: torch.tanh(output))
    try:
        with pytest.raises(mc.ConservationError, match=r"over the whole model: .* = [0-9.e+-]+ for example \d+, .*"
                                                       r"above the float32 tolerance"):
            mc.MambaLRP(model).attribute(ids, target=TARGET)
    finally:
        handle.remove()

    def squashed_head(ids, attention_mask=None):
        return model.lm_head(torch.tanh(model.backbone(ids).last_hidden_state))[:, -1]

    with pytest.raises(mc.ConservationError, match="forward_func before the model's head"):
        mc.MambaLRP(model, forward_func=squashed_head).attribute(ids, target=TARGET)
    log_probabilities = lambda ids, attention_mask=None: model(ids).logits[:, -1].log_softmax(-1)  # noqa: E731
    relevance = mc.MambaLRP(model, forward_func=log_probabilities).attribute(ids, target=TARGET)
    assert torch.isfinite(relevance).all() and no_hooks_left(model)


def test_a_float32_conv_in_a_float64_model_conserves_and_the_guard_names_a_rounded_rule(monkeypatch):
    """transformers 5.24 keeps BailingHybrid's conv1d in float32 in a float64 model (_keep_in_fp32_modules_strict):
    the KDA rule runs it in the work dtype, so the relevance still sums to the logit; run in float32 (as before the
    fix), the gap (~1e-8) is the guard's, naming the layer."""
    from mamba_captum.families import kda

    model = make_model("bailing_hybrid", dtype=torch.float64, **EXACT)
    zero_biases(model)
    model.model.layers[0].self_attn.conv1d.float()  # 5.24's layout, whichever transformers runs the test
    ids = torch.randint(3, 64, (2, 9))
    relevance, delta = mc.MambaLRP(model, forward_func=float64_head(model)).attribute(
        ids, target=TARGET, return_convergence_delta=True)
    assert (delta.abs() <= 1e-13 * relevance.abs().sum(-1).clamp(min=1.0)).all()
    rounded = kda.causal_conv
    monkeypatch.setattr(kda, "causal_conv", lambda x, conv, dtype=None: rounded(x, conv))  # the conv's own dtype
    with pytest.raises(mc.ConservationError, match=r"model\.layers\.0\.self_attn \(BailingHybridDeltaAttention\).* "
                                                   r"above the float64 tolerance"):
        mc.MambaLRP(model, forward_func=float64_head(model)).attribute(ids, target=TARGET)


def test_the_guard_checks_frozen_biases_and_leaves_them_frozen():
    """A frozen model (requires_grad False) keeps every module's check: the rules' biases require grad for the call
    only (their shares come from their gradients), and no comparison is skipped."""
    import warnings

    from mamba_captum.conservation import ConservationGap

    model = make_model("mamba2", **CONSERVING["mamba2"])
    spread_biases(model)
    model.requires_grad_(False)
    measured: list[ConservationGap] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        mc.MambaLRP(model)._relevance_and_gap(torch.randint(3, 64, (2, 6)), TARGET, None, None, None, {}, measured=measured)
    mixers = [gap for gap in measured if "Mamba2Mixer" in gap.where]
    assert len(mixers) == 2 and all(gap.example is None for gap in mixers)  # biased: compared over the batch
    assert all(gap.relative <= gap.tolerance for gap in measured)
    assert not any(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())
