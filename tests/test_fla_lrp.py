"""MambaLRP on flash-linear-attention's models (GLA, DeltaNet, gated DeltaNet, KDA, RetNet, HGRN-2, LightNet, linear
attention, Comba, gated DeltaProduct, the preconditioned delta rules, MesaNet): conservation with biases everywhere,
the modified forward's values, batch = single examples, left padding, nothing left on the model, the refused
attention residuals, and a GLA model written out by hand from the rules (token loop, no library code)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

import mamba_captum as mc

from fla_models import common_config, fla_models, make_fla_model, padded_batch, scale_up_mixer_weights
from test_fla_gla_family import MODELS as GLA_FAMILY_MODELS, make_model as make_gla_family_model
from test_fla_mesa_net import MESA_CONFIGS, make_mesa_model
from test_lrp import (TARGET, explain_with_share, float64_head, modified_logits, no_hooks_left, spread_biases)

COVERED = ["gla", "gla_conv", "delta_net", "delta_net_variant", "gated_deltanet", "kda", "kda_safe_gate",
           "retnet", "retnet_unfused", "retnet_conv", "retnet_gqa", "hgrn2", "hgrn2_conv",
           "lightnet_conv", "linear_attn", "comba", "gated_deltaproduct", "gated_deltaproduct_n2",
           "precond_gated_deltanet", "precond_gated_deltanet_variant", "precond_kda", "precond_kda_variant",
           "mesa_net", "mesa_net_gated"]


# name -> (config class, tiny kwargs) of models neither tests/fla_models.py nor the family tests define
OTHER_MODELS = {
    # two sub-steps per token, β in (0, 2)
    "gated_deltaproduct_n2": ("GatedDeltaProductConfig", common_config(num_heads=2, head_dim=8, expand_v=1.0,
                                                                        num_householder=2, use_forget_gate=True,
                                                                        allow_neg_eigval=True)),
}


def build(name, dtype):
    """The tiny fla model ``name`` (mixer weights scaled up, as tests/fla_models.py's): tests/fla_models.py's,
    tests/test_fla_gla_family.py's, tests/test_fla_mesa_net.py's or :data:`OTHER_MODELS`'."""
    if name in OTHER_MODELS:
        config_class, kwargs = OTHER_MODELS[name]
        torch.manual_seed(0)
        config = getattr(fla_models, config_class)(**kwargs)
        model = scale_up_mixer_weights(AutoModelForCausalLM.from_config(config).to(dtype).eval(), 0)
    elif name in MESA_CONFIGS:
        model = make_mesa_model(name, dtype)
    elif name in GLA_FAMILY_MODELS:
        model = make_gla_family_model(name, dtype)
    else:
        model = make_fla_model(name, dtype)
    # fla 0.6.0's LightNetPreTrainedModel names no base_model_prefix, so ``model.base_model`` (the float64 head of
    # test_lrp's helpers) would be the causal LM itself
    model.base_model_prefix = "model"
    return model


def with_biases(model, seed=2):
    """The model with a bias on every linear of its blocks (fla's layers have none by default), drawn from
    U(−0.5, 0.5): every bias path of the rules is exercised. (Not on the short convs: GatedDeltaNet's fused qkv conv
    reads its config's ``conv_bias``, not the modules' biases.)"""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, nn.Linear) and module.bias is None:
                bias = torch.empty(module.out_features, dtype=module.weight.dtype).uniform_(-0.5, 0.5,
                                                                                          generator=generator)
                module.bias = nn.Parameter(bias)
    return model


@pytest.mark.parametrize("name", COVERED)
def test_conservation_with_biases(name):
    """Σ relevance + the biases' share = the modified forward's logit (float64 rounding), which is the model's."""
    model = with_biases(build(name, torch.float64))
    spread_biases(model)
    ids = torch.randint(3, 64, (1, 10))
    relevance, delta, share, modified, real = explain_with_share(model, ids)
    assert abs(share) > 1e-4
    scale = max(1.0, abs(float(modified)), abs(share), float(relevance.abs().sum()))
    assert abs(float(delta) + share) <= 1e-13 * scale
    assert abs(float(modified) - float(real)) <= 1e-6 * max(1.0, abs(float(real)))
    assert no_hooks_left(model)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float64, 1e-6)])
@pytest.mark.parametrize("name", ["gla_conv", "delta_net", "gated_deltanet", "kda", "retnet_conv", "retnet_gqa",
                                  "hgrn2_conv", "lightnet_conv", "linear_attn",
                                  "comba", "gated_deltaproduct_n2", "precond_gated_deltanet", "precond_kda",
                                  "mesa_net_gated"])
def test_the_modified_forward_gives_the_models_output(name, dtype, bound):
    model = with_biases(build(name, dtype))
    ids = torch.randint(3, 64, (2, 8))
    with torch.no_grad():
        real = model(ids, use_cache=False).logits
    modified = modified_logits(model, ids)
    assert (modified - real).abs().max() <= bound * real.abs().max()
    assert no_hooks_left(model)


@pytest.mark.parametrize("name, bound", [
    *((name, 1e-10) for name in ("gla_conv", "gated_deltanet", "kda", "retnet_conv", "hgrn2_conv", "lightnet_conv",
                                 "linear_attn", "comba", "gated_deltaproduct_n2", "precond_gated_deltanet",
                                 "precond_kda")),
    # MesaNet's q* is solved in float32 (β, g, λ taken in float32 in a float64 model too): the model's own logits
    # differ by ~7e-8 (relative) between a batch and its rows
    ("mesa_net_gated", 1e-6)])
def test_batch_equals_single_examples(name, bound):
    model = build(name, torch.float64)
    ids = torch.randint(3, 64, (3, 7))
    method = mc.MambaLRP(model)
    batched = method.attribute(ids, target=[4, 9, 11])
    singles = torch.cat([method.attribute(ids[i:i + 1], target=t) for i, t in enumerate([4, 9, 11])])
    assert (batched - singles).abs().max() <= bound * singles.abs().max()
    assert no_hooks_left(model)


@pytest.mark.parametrize("name", ["gla_conv", "delta_net_variant", "gated_deltanet", "kda", "retnet_conv",
                                  "retnet_gqa", "hgrn2_conv", "lightnet_conv", "linear_attn",
                                  "comba", "gated_deltaproduct_n2", "precond_gated_deltanet_variant",
                                  "precond_kda", "mesa_net_gated"])
def test_left_padding_gives_the_unpadded_relevance(name):
    model = build(name, torch.float64)
    with torch.no_grad():  # biases on the output gate and the output projections (a bias before q / k / v reaches
        for block in model.model.layers:  # the pads, which fla drops)
            for module in (getattr(block.attn, "g_proj", None), block.attn.o_proj, block.mlp.down_proj):
                if isinstance(module, nn.Linear) and module.bias is None:
                    module.bias = nn.Parameter(torch.rand(module.weight.shape[0], dtype=torch.float64) - 0.5)
    padded, mask = padded_batch(length=9, pads=3)
    padded, mask = padded[:1], mask[:1]
    method = mc.MambaLRP(model)
    alone, delta_alone = method.attribute(padded[:, 3:], target=TARGET, return_convergence_delta=True)
    relevance, delta = method.attribute(padded, target=TARGET, attention_mask=mask, return_convergence_delta=True)
    assert relevance[:, :3].abs().max() == 0
    assert (relevance[:, 3:] - alone).abs().max() <= 1e-10 * alone.abs().max()
    assert abs(float(delta - delta_alone)) <= 1e-10
    assert no_hooks_left(model)


def test_attention_residuals_are_refused_by_name():
    config = fla_models.GLAConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, expand_k=0.5,
                                  expand_v=1.0, attnres_block_size=2, fuse_cross_entropy=False)
    torch.manual_seed(0)
    model = fla_models.GLAForCausalLM(config).double().eval()
    with pytest.raises(NotImplementedError, match="attention residuals"):
        mc.MambaLRP(model).attribute(torch.randint(3, 64, (1, 6)), target=TARGET)
    assert no_hooks_left(model)


def test_a_powlu_mlp_is_refused():
    model = make_fla_model("gla", torch.float64)
    model.model.layers[0].mlp.hidden_act = "powlu"
    with pytest.raises(NotImplementedError, match="powlu"):
        mc.MambaLRP(model, forward_func=float64_head(model)).attribute(torch.randint(3, 64, (1, 5)), target=TARGET)
    assert no_hooks_left(model)


# -- GLA written out from the rules -----------------------------------------------------------------------------
def _rms_rule(x, weight, eps):
    """RMS norm with the normaliser detached."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach()


def _half(a, b):
    return 0.5 * a * b.detach() + 0.5 * a.detach() * b


def _causal_conv(conv, x):
    length = x.shape[1]
    return F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=conv.weight.shape[-1] - 1,
                    groups=x.shape[-1])[..., :length].transpose(1, 2)


def _reference_gla(mixer, h):
    """GatedLinearAttention (SiLU short convs, fused swish-gated norm, one key head per head) under the rules, a token
    loop: q, k, the decays detached; the value conv's SiLU by the identity rule; ν detached; swish(g) ⊙ o by the
    identity and half rules."""
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    per_head = lambda t, d: t.reshape(batch, length, heads, d)  # noqa: E731
    q = per_head(F.silu(_causal_conv(mixer.q_conv1d, mixer.q_proj(h))), key_dim).detach()
    k = per_head(F.silu(_causal_conv(mixer.k_conv1d, mixer.k_proj(h))), key_dim).detach()
    pre = _causal_conv(mixer.v_conv1d, mixer.v_proj(h))
    v = per_head(pre * torch.sigmoid(pre).detach(), value_dim)
    decay = per_head(torch.exp(F.logsigmoid(mixer.gk_proj(h)) / mixer.gate_logit_normalizer), key_dim).detach()
    state = h.new_zeros(batch, heads, key_dim, value_dim)
    outputs = []
    for t in range(length):
        state = decay[:, t, :, :, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(key_dim ** -0.5 * (q[:, t, :, :, None] * state).sum(-2))
    o = torch.stack(outputs, 1)  # (B, L, H, P)
    norm = mixer.g_norm_swish_gate
    o = norm.weight * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm.eps).detach()
    g = per_head(mixer.g_proj(h), value_dim)
    gated = _half(o, g * torch.sigmoid(g).detach())
    return mixer.o_proj(gated.reshape(batch, length, -1))


def _reference_relevance(model, ids, reference_mixer):
    """Gradient × input at the embeddings of the model written out under the rules, its mixers by
    ``reference_mixer(mixer, x)``: the RMS norms' normalisers detached, the swish MLPs by the identity and half
    rules."""
    embeddings = model.model.embeddings(ids).detach().requires_grad_(True)
    hidden = embeddings
    for block in model.model.layers:
        hidden = hidden + reference_mixer(block.attn, _rms_rule(hidden, block.attn_norm.weight, block.attn_norm.eps))
        mlp = block.mlp
        x = _rms_rule(hidden, block.mlp_norm.weight, block.mlp_norm.eps)
        gate = mlp.gate_proj(x)
        hidden = hidden + mlp.down_proj(_half(gate * torch.sigmoid(gate).detach(), mlp.up_proj(x)))
    logit = model.lm_head(_rms_rule(hidden, model.model.norm.weight, model.model.norm.eps))[:, -1, TARGET]
    (grad,) = torch.autograd.grad(logit.sum(), embeddings)
    return (grad * embeddings).sum(-1)


def test_gla_matches_a_reference_written_from_the_rules():
    model = with_biases(make_fla_model("gla_conv", torch.float64))
    spread_biases(model)
    ids = torch.randint(3, 64, (2, 7))
    expected = _reference_relevance(model, ids, _reference_gla)
    relevance = mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert (relevance - expected).abs().max() <= 1e-10 * expected.abs().max()
    assert no_hooks_left(model)


# -- RetNet written out from the rules --------------------------------------------------------------------------
def _rotated(x):
    """GPT-NeoX rotary embedding (base 10⁴, all K channels) of x (B, L, H, K) at positions 0 … L−1, the angles in
    float32 as fla computes them."""
    length, dim = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq  # (L, K/2)
    cos, sin = (f(angles).double()[None, :, None, :] for f in (torch.cos, torch.sin))
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def _reference_retention(mixer, h):
    """MultiScaleRetention (no conv, the norm then the swish gate, unfused) under the rules, a token loop: q, k (after
    the rotary embedding) and the fixed decays γ_h = 1 − 2^(−5−h) (float32, as fla's kernels take them) detached; ν
    detached; swish(g) ⊙ o by the identity and half rules."""
    batch, length, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim
    per_head = lambda t, d: t.reshape(batch, length, heads, d)  # noqa: E731
    q = _rotated(per_head(mixer.q_proj(h), key_dim)).detach()
    k = _rotated(per_head(mixer.k_proj(h), key_dim)).detach()
    v = per_head(mixer.v_proj(h), value_dim)
    decay = torch.log(1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float32))).double().exp()
    state = h.new_zeros(batch, heads, key_dim, value_dim)
    outputs = []
    for t in range(length):
        state = decay[:, None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        outputs.append(key_dim ** -0.5 * (q[:, t, :, :, None] * state).sum(-2))
    o = torch.stack(outputs, 1)  # (B, L, H, P)
    norm = mixer.g_norm
    o = norm.weight * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm.eps).detach()
    g = per_head(mixer.g_proj(h), value_dim)
    return mixer.o_proj(_half(o, g * torch.sigmoid(g).detach()).reshape(batch, length, -1))


def test_retnet_matches_a_reference_written_from_the_rules():
    model = with_biases(make_fla_model("retnet_unfused", torch.float64))
    spread_biases(model)
    ids = torch.randint(3, 64, (2, 7))
    expected = _reference_relevance(model, ids, _reference_retention)
    relevance = mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert (relevance - expected).abs().max() <= 1e-10 * expected.abs().max()
    assert no_hooks_left(model)
