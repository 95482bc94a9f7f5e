"""MambaLRP on the families it newly covers: NemotronH's mixture of experts (ungated experts), the vision-language
wrappers (text and image tokens), Vision Mamba (pixels), GLM-5-next (hyper-connections, clamped SwiGLU, indexed
attention), Qwen4-exp (gated residuals), ZAYA and Inkling (convolutions around the attention). Conservation in float64
(Σ relevance + the biases' share = the modified forward's score, which is the model's own), batched == single, the
rules by hand where they are new, and the conservation guard catching a rule whose gradient is off its value."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import mamba_captum as mc
from mamba_captum.fla_cpu import fla_on_cpu
from mamba_captum.families import lrp_plan
from test_linear_families import vision_language
from test_lrp import EXACT, TARGET, explain_with_share, no_hooks_left, spread_biases, zero_biases
from tiny_models import make_model

# NemotronH with a mixture-of-experts layer: top-2 of 4 ungated ReLU² experts and the shared expert
NEMOTRON_MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention"],
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1)


def nemotron_moe(dtype=torch.float64, **overrides):
    return make_model("nemotron_h", dtype=dtype, **EXACT, **NEMOTRON_MOE, **overrides)


def _scale(relevance, modified, share):
    return max(1.0, abs(float(modified)), abs(share), float(relevance.abs().sum()))


# -- NemotronH's mixture of experts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("latent", [None, 16])
def test_nemotron_h_moe_conserves_with_biases(latent):
    """Σ R + the biases' share = the modified forward's logit (float64 rounding), which is the model's own logit to
    the float32 its router's weights round the experts' output to; with the latent projections (nn.Linear) too."""
    model = nemotron_moe(mlp_bias=True, use_bias=True, moe_latent_size=latent)
    spread_biases(model)
    ids = torch.randint(3, 64, (1, 10))
    relevance, delta, share, modified, real = explain_with_share(model, ids)
    assert abs(share) > 1e-3
    assert abs(float(delta) + share) <= 1e-13 * _scale(relevance, modified, share)
    # HF multiplies a float64 expert's output by the float32 routing weights and sums it in float32
    assert abs(float(modified) - float(real)) <= 1e-6 * max(1.0, abs(float(real)))
    assert no_hooks_left(model)


def test_nemotron_h_moe_every_expert_runs_and_batch_equals_single():
    model = nemotron_moe()
    zero_biases(model)
    ids = torch.randint(3, 64, (3, 9))
    routed = []
    handle = model.model.layers[1].mixer.gate.register_forward_hook(lambda m, a, out: routed.append(out[2]))
    method = mc.MambaLRP(model)
    batch, delta = method.attribute(ids, target=TARGET, return_convergence_delta=True)
    handle.remove()
    assert set(routed[0].flatten().tolist()) == {0, 1, 2, 3}  # the rule's loop meets every expert
    # the model's logits are float32 (HF's cast): delta is that rounding
    assert (delta.abs() <= 1e-6 * batch.abs().sum(-1).clamp(min=1.0)).all()
    singles = torch.cat([method.attribute(ids[i:i + 1], target=TARGET) for i in range(3)])
    # the router scores in float32 (HF's cast), whose rounding differs between a batch and one example (5.23: up to
    # 5e-8 of the largest relevance); the rule follows the routing weights the model used
    assert torch.allclose(batch, singles, rtol=0, atol=1e-6 * float(batch.abs().max()))


def test_nemotron_h_moe_rule_follows_the_experts_by_hand():
    """The experts' rule on a hand-made routing: its value is the experts' output, and the relevance of each token's
    input is Σ_k w_k · down_e(relu²(up_e x)) summed over its features (all of it: ReLU² by the identity rule, the
    weights detached)."""
    experts = nemotron_moe().model.layers[1].mixer.experts
    torch.manual_seed(3)
    x = torch.randn(5, 32, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 2], [1, 0]])
    weights = torch.rand(5, 2, dtype=torch.float32, requires_grad=True)
    with torch.no_grad():
        real = experts(x, index, weights)
    rule = lrp_plan.ungated_experts(experts, (x, index, weights), {}, real, torch.float64)
    assert torch.allclose(rule, real.double(), rtol=0, atol=1e-6)  # HF sums in the weights' float32
    grad_x, grad_w = torch.autograd.grad(rule.sum(), (x, weights), allow_unused=True)
    assert grad_w is None  # the routing weights take no relevance
    by_hand = torch.zeros(5, dtype=torch.float64)
    for token in range(5):
        for slot in range(2):
            e = int(index[token, slot])
            up = experts.up_proj[e].double() @ x[token].detach()
            expert_out = experts.down_proj[e].double() @ torch.relu(up) ** 2
            by_hand[token] += float(weights[token, slot].detach()) * expert_out.sum()
    assert torch.allclose((grad_x * x).sum(-1), by_hand, rtol=1e-12, atol=1e-14)


def test_the_guard_catches_an_experts_rule_whose_gradient_is_off(monkeypatch):
    """The mutation: the experts' rule with its value kept and its gradient 1 % too large."""
    rule = lrp_plan.RULES["NemotronHExperts"]

    def off(*args):
        out = rule(*args)
        return out + 0.01 * (out - out.detach())

    model = nemotron_moe()
    ids = torch.randint(3, 64, (2, 9))
    mc.MambaLRP(model).attribute(ids, target=TARGET)  # passes as it is
    monkeypatch.setitem(lrp_plan.RULES, "NemotronHExperts", off)
    with pytest.raises(mc.ConservationError, match=r"layers\.1\.mixer\.experts \(NemotronHExperts\)"):
        mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert no_hooks_left(model)


def test_nemotron_h_experts_with_an_unknown_layout_are_refused():
    model = nemotron_moe()
    experts = model.model.layers[1].mixer.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.data.transpose(1, 2).contiguous()[:, :8])
    with pytest.raises(NotImplementedError, match="ungated-experts rule does not fit NemotronHExperts"):
        mc.MambaLRP(model)


# -- vision-language wrappers -----------------------------------------------------------------------------------------
TEXT_OF = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe", "lfm2_vl": "lfm2", "lfm3_vl": "lfm3",
           "glm5_next": "glm5_next", "qwen4_exp": "qwen4_exp"}
IMAGE_TOKEN, VISION_START = 60, 59


def text_model_head(model):
    """forward_func over the language model alone: the head on its last position (the VL wrapper's own path)."""
    language = model.model.language_model

    def forward(ids, attention_mask=None, **kwargs):
        hidden = language(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return model.lm_head(hidden)[:, -1]
    return forward


@pytest.mark.parametrize("model_type", list(TEXT_OF))
def test_a_vision_language_model_on_text_gives_its_language_models_relevance(model_type):
    model = vision_language(model_type, TEXT_OF[model_type])
    spread_biases(model)
    ids = torch.randint(3, 59, (2, 10))
    relevance, delta = mc.MambaLRP(model).attribute(ids, target=TARGET, return_convergence_delta=True)
    alone, delta_alone = mc.MambaLRP(model.model.language_model, forward_func=text_model_head(model)).attribute(
        ids, target=TARGET, return_convergence_delta=True)
    assert relevance.shape == (2, 10)
    assert torch.allclose(relevance, alone, rtol=0, atol=1e-13) and torch.allclose(delta, delta_alone, atol=1e-13)
    assert no_hooks_left(model)


def _with_images(model_type, batch=2, length=12):
    """(model, ids, image keywords): a tiny VL model whose ids hold one image of 4 placeholder tokens per example
    (a 4×4 patch grid merged 2×2), at a different position in each."""
    model = vision_language(model_type, TEXT_OF[model_type])
    for config in (model.config, model.model.config):
        config.image_token_id, config.vision_start_token_id = IMAGE_TOKEN, VISION_START
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 50, (batch, length), generator=generator)
    for b in range(batch):
        ids[b, 1 + b] = VISION_START
        ids[b, 2 + b:6 + b] = IMAGE_TOKEN
    if model_type == "lfm2_vl":  # SigLIP-2: (B, patches, C·P·P), each image's grid and its patch mask
        pixels = torch.randn(batch, 16, 3 * 16 * 16, dtype=torch.float64, generator=generator)
        images = dict(pixel_values=pixels, spatial_shapes=torch.tensor([[4, 4]] * batch),
                      pixel_attention_mask=torch.ones(batch, 16, dtype=torch.bool))
    else:  # Qwen's tower: (Σ patches, C·T·P·P) and each image's (T, H, W) grid; M-RoPE reads the token types
        pixels = torch.randn(16 * batch, 3 * 2 * 16 * 16, dtype=torch.float64, generator=generator)
        images = dict(pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]] * batch))
        if model_type != "lfm3_vl":
            images["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    return model, ids, images


def _select(images, index, batch):
    """One example's image keywords."""
    out = {}
    for key, value in images.items():
        if key == "pixel_values" and value.shape[0] != batch:  # Qwen's patches: 16 per image
            out[key] = value[16 * index:16 * (index + 1)]
        else:
            out[key] = value[index:index + 1]
    return out


@pytest.mark.parametrize("model_type", ["qwen3_5", "lfm2_vl"])
def test_image_placeholders_take_their_features_relevance_and_it_conserves(model_type):
    model, ids, images = _with_images(model_type)
    spread_biases(model)
    relevance, delta, share, modified, real = explain_with_share(model, ids, **images)
    assert abs(float(delta.sum()) + share) <= 1e-13 * _scale(relevance, modified.sum(), share)
    assert torch.allclose(modified, real, rtol=0, atol=1e-6)  # HF runs some float64 steps in float32
    with torch.no_grad():  # the image matters to the score: it is not a constant the relevance could leave out
        text_only = model(ids).logits[:, -1, TARGET]
    assert (real - text_only).abs().min() > 1e-4
    placeholders = ids == IMAGE_TOKEN
    assert (relevance[placeholders].abs() > 0).all()
    # batched == single, placeholders and all
    method = mc.MambaLRP(model)
    batch = method.attribute(ids, target=TARGET, **images)
    singles = torch.cat([method.attribute(ids[i:i + 1], target=TARGET, **_select(images, i, 2)) for i in range(2)])
    assert torch.allclose(batch, singles, rtol=0, atol=1e-12 * float(batch.abs().max()))
    assert no_hooks_left(model)


def test_images_with_inputs_embeds_are_refused():
    model, ids, images = _with_images("qwen3_5")
    embeds = model.get_input_embeddings()(ids).detach()
    with pytest.raises(NotImplementedError, match="pass input_ids, not inputs_embeds"):
        mc.MambaLRP(model).attribute(embeds, target=TARGET, **images)
    assert no_hooks_left(model) and torch.is_grad_enabled()


# -- Vision Mamba ---------------------------------------------------------------------------------------------------
def _vim_constants(model):
    """The additive constants of a Vim: every bias, the CLS token and the position embeddings, requiring grad."""
    generator = torch.Generator().manual_seed(5)
    constants = []
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or name in ("cls_token", "pos_embed"):
                if name.endswith("bias") and "dt_proj" not in name:  # Δ's bias only enters detached factors
                    parameter.uniform_(-0.5, 0.5, generator=generator)
                constants.append(parameter.requires_grad_(True))
    return constants


@pytest.mark.parametrize("cls_position", ["middle", None])
def test_vim_pixel_relevance_conserves_with_its_constants(cls_position):
    """Σ over pixels + the share of the biases, CLS token and position embeddings = the logit (float64 rounding);
    (B, 1, H, W), each pixel's channels summed."""
    from tiny_models import make_vim

    model = make_vim(dtype=torch.float64, cls_position=cls_position)
    constants = _vim_constants(model)
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    method = mc.MambaLRP(model)
    relevance, delta, share = method._relevance_and_gap(pixels, 1, None, None, None, {}, parameters=constants)
    with torch.no_grad():
        logit = model(pixels)[:, 1]
    assert relevance.shape == (2, 1, 32, 32) and relevance.dtype == torch.float64
    scale = max(1.0, float(logit.abs().sum()), abs(share), float(relevance.abs().sum()))
    assert abs(float(delta.sum()) + share) <= 1e-13 * scale
    assert torch.allclose(relevance.sum((1, 2, 3)) - delta, logit.double(), rtol=0, atol=1e-12)
    assert abs(share) > 1e-3  # the constants matter here
    # with every constant 0 (Δ's bias aside) the pixels take the whole logit
    with torch.no_grad():
        for parameter in constants:
            if parameter.dim() > 1 or parameter is not model.layers[0].mixer.dt_proj.bias:
                parameter.zero_()
        for block in model.layers:
            block.mixer.dt_proj.bias.uniform_(-2.0, 1.0), block.mixer.dt_proj_b.bias.uniform_(-2.0, 1.0)
    relevance, delta = method.attribute(pixels, target=1, return_convergence_delta=True)
    assert (delta.abs() <= 1e-13 * relevance.abs().sum((1, 2, 3)).clamp(min=1.0)).all()


def test_vim_batch_equals_single_and_float32_conserves():
    from tiny_models import make_vim

    model = make_vim(dtype=torch.float32)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    method = mc.MambaLRP(model)
    batch = method.attribute(pixels, target=[0, 2, 4])
    singles = torch.cat([method.attribute(pixels[i:i + 1], target=t) for i, t in enumerate([0, 2, 4])])
    assert torch.allclose(batch, singles, rtol=0, atol=1e-5 * float(batch.abs().max()))
    with pytest.raises(ValueError, match="position= does not apply"):
        method.attribute(pixels, target=0, position=3)
    assert no_hooks_left(model)


def test_the_guard_catches_a_vim_rule_whose_gradient_is_off(monkeypatch):
    """The mutation: one direction's rule (Mamba-1's, inside the Vim mixer's) with its value kept and its gradient
    1 % too large."""
    from mamba_captum.families import vim
    from tiny_models import make_vim

    model = make_vim(dtype=torch.float64)
    pixels = torch.randn(1, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    inner = vim.lrp_inner

    def off(*args, **kwargs):
        out = inner(*args, **kwargs)
        return out + 0.01 * (out - out.detach())

    mc.MambaLRP(model).attribute(pixels, target=1)  # passes as it is
    monkeypatch.setattr(vim, "lrp_inner", off)
    with pytest.raises(mc.ConservationError, match=r"layers\.0\.mixer \(VimMixer\)"):
        mc.MambaLRP(model).attribute(pixels, target=1)
    assert no_hooks_left(model)


# -- GLM-5-next (hyper-connections, indexed attention, clamped SwiGLU) and Qwen4-exp (gated residuals) --------------
def glm5_next(dtype=torch.float64, **overrides):
    """The tiny GLM-5-next text model with a SwiGLU limit its activations reach (the clamps cut)."""
    return make_model("glm5_next", dtype=dtype, swiglu_limit=0.05, **overrides)


def linear_head(model, seed=9):
    """forward_func: a fixed random head (8 classes) on the last position of a base model's output."""
    weight = torch.randn(8, model.config.hidden_size, dtype=model.dtype, generator=torch.Generator().manual_seed(seed))

    def forward(ids, attention_mask=None, **kwargs):
        return model(ids, attention_mask=attention_mask, **kwargs).last_hidden_state[:, -1] @ weight.T
    return forward


def test_glm5_next_conserves_and_batch_equals_single():
    """No biases: Σ R = the score of the modified forward, which is the model's own (float64)."""
    model = glm5_next()
    head = linear_head(model)
    ids = torch.randint(3, 64, (3, 10))
    clamped = []
    mlp = model.layers[0].mlp
    handle = mlp.gate_proj.register_forward_hook(lambda m, a, out: clamped.append(bool((out > 0.05).any())))
    method = mc.MambaLRP(model, forward_func=head)
    relevance, delta = method.attribute(ids, target=3, return_convergence_delta=True)
    handle.remove()
    assert clamped[0]  # the clamp cuts: its identity rule is exercised
    with fla_on_cpu(), torch.no_grad():
        real = head(ids)[:, 3]
    assert torch.allclose(relevance.sum(-1) - delta, real, rtol=1e-6)  # HF computes its norms in float32
    assert (delta.abs() <= 1e-13 * relevance.abs().sum(-1).clamp(min=1.0)).all()
    singles = torch.cat([method.attribute(ids[i:i + 1], target=3) for i in range(3)])
    # the detached factors are HF's float32 (the hyper-connections' weights, the norms): batching rounds them anew
    assert torch.allclose(relevance, singles, rtol=0, atol=1e-6 * float(relevance.abs().max()))
    assert no_hooks_left(model)


def test_glm5_next_rules_by_hand():
    """The clamped SwiGLU: the rule's value is the MLP's, and every relevance of its output reaches x. The
    hyper-connection: the collapse Σ_n pre_n h_n with pre detached hands stream n exactly pre_n h_n."""
    model = glm5_next()
    torch.manual_seed(3)
    mlp = model.layers[0].mlp
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        real = mlp(x)
    rule = lrp_plan.clamped_glu_mlp(mlp, (x,), {}, real, torch.float64)
    assert torch.allclose(rule, real, rtol=0, atol=1e-14)
    (grad,) = torch.autograd.grad(rule.sum(), x)
    assert torch.isclose((grad * x).sum(), real.sum(), rtol=1e-12)
    hc = model.layers[0].attn_hc
    streams = torch.randn(2, 5, 2, 32, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
    post_rule, comb_rule, collapsed_rule = lrp_plan.hyper_connection(hc, (streams,), {}, post, torch.float64)
    assert torch.equal(post_rule, post) and torch.equal(comb_rule, comb) and not post_rule.requires_grad
    assert torch.allclose(collapsed_rule, collapsed, rtol=0, atol=1e-14)
    (grad,) = torch.autograd.grad(collapsed_rule.sum(), streams)
    pre = (grad * streams).sum(-1) / streams.detach().sum(-1)  # each stream's share over its sum: pre_n
    assert torch.allclose((pre[..., None] * streams).sum(2), collapsed, atol=1e-12)


def test_the_guard_catches_a_hyper_connection_rule_whose_gradient_is_off(monkeypatch):
    """The mutation: the collapse's gradient 1 % too large, its value kept."""
    rule = lrp_plan.RULES["Glm5NextTextHyperConnection"]

    def off(*args):
        post, comb, collapsed = rule(*args)
        return post, comb, collapsed + 0.01 * (collapsed - collapsed.detach())

    model = glm5_next()
    ids = torch.randint(3, 64, (1, 8))
    mc.MambaLRP(model, forward_func=linear_head(model)).attribute(ids, target=3)  # passes as it is
    monkeypatch.setitem(lrp_plan.RULES, "Glm5NextTextHyperConnection", off)
    with pytest.raises(mc.ConservationError, match=r"layers\.0\.attn_hc \(Glm5NextTextHyperConnection\)"):
        mc.MambaLRP(model, forward_func=linear_head(model)).attribute(ids, target=3)
    assert no_hooks_left(model)


def test_qwen4_exp_conserves_with_biases_and_batch_equals_single():
    model = make_model("qwen4_exp", dtype=torch.float64, attention_bias=True)
    spread_biases(model)
    ids = torch.randint(3, 64, (1, 10))
    with fla_on_cpu():
        relevance, delta, share, modified, real = explain_with_share(model, ids)
    assert abs(share) > 1e-3
    assert abs(float(delta) + share) <= 1e-13 * _scale(relevance, modified, share)
    assert abs(float(modified) - float(real)) <= 1e-6 * max(1.0, abs(float(real)))
    zero_biases(model)
    ids = torch.randint(3, 64, (3, 9))
    method = mc.MambaLRP(model)
    batch, delta = method.attribute(ids, target=TARGET, return_convergence_delta=True)
    assert (delta.abs() <= 1e-6 * batch.abs().sum(-1).clamp(min=1.0)).all()  # the logits' float32 cast
    singles = torch.cat([method.attribute(ids[i:i + 1], target=TARGET) for i in range(3)])
    assert torch.allclose(batch, singles, rtol=0, atol=1e-12 * float(batch.abs().max()))
    assert no_hooks_left(model)


def test_the_guard_catches_a_gated_residual_rule_whose_gradient_is_off(monkeypatch):
    """The mutation: the gated residual's mixed input with its gradient 1 % too large, its value kept."""
    rule = lrp_plan.RULES["Qwen4ExpTextGatedResidual"]

    def off(*args):
        out = rule(*args)
        mixed, *rest = out if isinstance(out, tuple) else (out,)
        mixed = mixed + 0.01 * (mixed - mixed.detach())
        return (mixed, *rest) if rest else mixed

    model = make_model("qwen4_exp", dtype=torch.float64)
    ids = torch.randint(3, 64, (1, 8))
    mc.MambaLRP(model).attribute(ids, target=TARGET)  # passes as it is
    monkeypatch.setitem(lrp_plan.RULES, "Qwen4ExpTextGatedResidual", off)
    with pytest.raises(mc.ConservationError, match=r"Qwen4ExpTextGatedResidual"):
        mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert no_hooks_left(model)


# -- ZAYA: the values shifted around the attention call ---------------------------------------------------------------
def test_zaya_conserves_with_biases_and_padding_changes_nothing():
    """Σ R + the biases' share = the modified forward's logit, the model's own; ZAYA keeps its residual stream in
    float32 (even in a float64 model, as the reference implementation), so the sums hold to float32's rounding. The
    pads take nothing and the real tokens get their unpadded relevance."""
    from test_conv_attention import zaya

    model = zaya(attention_bias=True)
    spread_biases(model)
    ids = torch.randint(3, 30, (2, 10), generator=torch.Generator().manual_seed(10))
    mask = torch.ones(2, 10)
    mask[1, :3] = 0
    relevance, delta, share, modified, real = explain_with_share(model, ids, mask=mask)
    assert abs(share) > 1e-3
    assert abs(float(delta.sum()) + share) <= 1e-7 * _scale(relevance, modified.sum(), share)
    assert torch.allclose(modified, real, rtol=0, atol=1e-7)
    assert relevance[1, :3].abs().max() == 0
    head = lambda ids, attention_mask=None, **kw: model(  # noqa: E731
        ids, attention_mask=attention_mask, use_cache=False).logits[:, -1]
    method = mc.MambaLRP(model, forward_func=head)
    padded = method.attribute(ids[1:], target=TARGET, attention_mask=mask[1:])
    alone = method.attribute(ids[1:, 3:], target=TARGET)
    assert torch.allclose(padded[:, 3:], alone, rtol=0, atol=1e-6 * float(alone.abs().max()))
    assert no_hooks_left(model)


def test_the_guard_catches_a_zaya_rule_whose_gradient_is_off(monkeypatch):
    """The mutation: ZAYA's attention (re-run as its rule) with its gradient 1 % too large, its value kept."""
    from test_conv_attention import zaya
    from transformers.models.zaya import modeling_zaya

    model = zaya()
    ids = torch.randint(3, 30, (1, 8))
    mc.MambaLRP(model).attribute(ids, target=TARGET)  # passes as it is
    forward = modeling_zaya.ZayaAttention.forward

    def off(self, *args, **kwargs):
        out, weights = forward(self, *args, **kwargs)
        return out + 0.01 * (out - out.detach()), weights

    monkeypatch.setattr(modeling_zaya.ZayaAttention, "forward", off)
    with pytest.raises(mc.ConservationError, match=r"layers\.0\.self_attn \(ZayaAttention\)"):
        mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert no_hooks_left(model)


# -- Inkling: convolutions around and after the attention -------------------------------------------------------------
def test_inkling_conserves_and_padding_changes_nothing():
    """No biases: Σ R = the logit (float64), the pads take nothing, batched = single (padded alike). (Unpadded
    differs: Inkling's log-scaling of the queries reads absolute positions, which the pads shift.)"""
    from test_inkling import inkling_text

    model = inkling_text(torch.float64)
    ids = torch.randint(3, 30, (2, 10), generator=torch.Generator().manual_seed(11))
    mask = torch.ones(2, 10)
    mask[1, :3] = 0
    relevance, delta, share, modified, real = explain_with_share(model, ids, mask=mask)
    assert share == 0
    assert (delta.abs() <= 1e-13 * relevance.abs().sum(-1).clamp(min=1.0)).all()
    assert torch.allclose(modified, real, rtol=0, atol=1e-7)  # HF's convolutions run in float32
    assert relevance[1, :3].abs().max() == 0
    method = mc.MambaLRP(model)
    batch = method.attribute(ids, target=TARGET, attention_mask=mask)
    singles = torch.cat([method.attribute(ids[i:i + 1], target=TARGET, attention_mask=mask[i:i + 1])
                         for i in range(2)])
    assert torch.allclose(batch, singles, rtol=0, atol=1e-12 * float(batch.abs().max()))
    assert no_hooks_left(model)


def test_the_guard_catches_an_inkling_convolution_rule_whose_gradient_is_off(monkeypatch):
    """The mutation: the short convolutions' rule with its gradient 1 % too large, its value kept."""
    from mamba_captum.families import inkling
    from test_inkling import inkling_text

    model = inkling_text(torch.float64)
    ids = torch.randint(3, 30, (1, 8))
    mc.MambaLRP(model).attribute(ids, target=TARGET)  # passes as it is
    rule = inkling.short_conv_rule

    def off(*args):
        out = rule(*args)
        return out + 0.01 * (out - out.detach())

    monkeypatch.setattr(inkling, "short_conv_rule", off)
    with pytest.raises(mc.ConservationError, match=r"layers\.0\.(self_attn \(InklingAttention\)|attn_sconv)"):
        mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert no_hooks_left(model)


def test_qwen4_exp_per_layer_embeddings_stay_refused_by_name():
    """Qwen4-exp's per-layer embeddings keep their refusal (docs/methods/lrp.md)."""
    model = make_model("qwen4_exp", ple_layer_ids=[1])
    with pytest.raises(TypeError, match="Qwen4ExpTextPLELayer"):  # refused by the mixers' catalogue already
        mc.MambaLRP(model)


# -- Inkling2 and Inkling2-Loop: depth attention, gated attention with dynamic convolutions, looped layers --------------
# Inkling2's rules are written for transformers 5.24's layout; 5.23's (no inkling2_loop yet) is refused by name
INKLING2_5_24 = pytest.mark.skipif("inkling2_loop" not in tf.CONFIG_MAPPING,
                                   reason="Inkling2's MambaLRP rules cover transformers 5.24's layout")


@INKLING2_5_24
@pytest.mark.parametrize("builder", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_conserves_and_batch_equals_single(builder):
    """Σ R + the biases' share = the modified forward's logit, the model's own; Inkling2 keeps its residual stream
    in float32 (even in a float64 model), so the sums hold to float32's rounding. Pads take nothing."""
    import test_inkling

    model = getattr(test_inkling, builder)(torch.float64)
    ids = torch.randint(3, 30, (2, 10), generator=torch.Generator().manual_seed(12))
    mask = torch.ones(2, 10)
    mask[1, :3] = 0
    relevance, delta, share, modified, real = explain_with_share(model, ids, mask=mask)
    assert abs(float(delta.sum()) + share) <= 1e-6 * _scale(relevance, modified.sum(), share)
    assert torch.allclose(modified, real, rtol=0, atol=1e-6)
    assert relevance[1, :3].abs().max() == 0
    method = mc.MambaLRP(model)  # the model's own soft-capped logits: the cap by the identity rule
    batch, delta = method.attribute(ids, target=TARGET, attention_mask=mask, return_convergence_delta=True)
    assert (delta.abs() <= 1e-6 * batch.abs().sum(-1).clamp(min=1.0)).all()
    singles = torch.cat([method.attribute(ids[i:i + 1], target=TARGET, attention_mask=mask[i:i + 1])
                         for i in range(2)])
    assert torch.allclose(batch, singles, rtol=0, atol=1e-6 * float(batch.abs().max()))
    assert no_hooks_left(model)


@INKLING2_5_24
def test_inkling2_rules_by_hand():
    """The dynamic convolution with its taps detached hands each output its inputs' taps-weighted values; the depth
    attention's rule gives the module's value and all of its relevance to the stacked states."""
    from mamba_captum.families import inkling2
    from test_inkling import inkling2_text

    model = inkling2_text(torch.float64)
    full = model.model.layers[1]
    conv = full.self_attn.v_proj.sconv
    torch.manual_seed(4)
    x = torch.randn(2, 6, conv.static_weight.shape[1], dtype=torch.float64, requires_grad=True)
    dynamic = torch.randn(2, 6, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        real = conv(x, dynamic)
    rule = inkling2.dynamic_conv_rule(conv, x, dynamic, None, torch.float64)
    assert torch.allclose(rule, real, rtol=0, atol=1e-6)  # HF's float32
    (grad,) = torch.autograd.grad(rule.sum(), x)
    assert torch.isclose((grad * x).sum(), rule.sum(), rtol=1e-12)  # linear in x: Euler
    residual = full.mlp_input
    blocks = torch.randn(2, 6, 2, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    partial = torch.randn(2, 6, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        real = residual(blocks, partial)[0]
    rule = lrp_plan.block_attention_residual(residual, (blocks, partial), {}, real, torch.float64)
    assert torch.allclose(rule, real.double(), rtol=0, atol=1e-6)
    grads = torch.autograd.grad(rule.sum(), (blocks, partial))
    assert torch.isclose((grads[0] * blocks).sum() + (grads[1] * partial).sum(), rule.sum(), rtol=1e-12)


@INKLING2_5_24
def test_the_guard_catches_a_depth_attention_rule_whose_gradient_is_off(monkeypatch):
    """The mutation: the attention residual over depth with its gradient 1 % too large, its value kept (its inputs
    are Inkling2's float32 stream: compared to float32's bound, which 1 % exceeds)."""
    from test_inkling import inkling2_text

    rule = lrp_plan.RULES["Inkling2BlockAttentionResidual"]

    def off(*args):
        out = rule(*args)
        first, *rest = out if isinstance(out, tuple) else (out,)
        first = first + 0.01 * (first - first.detach())
        return (first, *rest) if rest else first

    model = inkling2_text(torch.float64)
    ids = torch.randint(3, 30, (1, 8))
    mc.MambaLRP(model).attribute(ids, target=TARGET)  # passes as it is
    monkeypatch.setitem(lrp_plan.RULES, "Inkling2BlockAttentionResidual", off)
    with pytest.raises(mc.ConservationError, match=r"Inkling2BlockAttentionResidual"):
        mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert no_hooks_left(model)


@pytest.mark.skipif("inkling2_loop" in tf.CONFIG_MAPPING, reason="transformers 5.23's Inkling2 layout")
def test_inkling2_of_an_older_layout_is_refused_when_planned():
    from test_inkling import inkling2_text

    model = inkling2_text(torch.float32)
    with pytest.raises(NotImplementedError, match="written for transformers 5.24's layout"):
        mc.MambaLRP(model)
    assert mc.MambaAttribution(model).resolve_recipe() == "product"  # the default falls back to the rollout
