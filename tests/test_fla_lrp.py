"""MambaLRP on flash-linear-attention's models (GLA, DeltaNet, gated DeltaNet, KDA): conservation with biases
everywhere, the modified forward's values, batch = single examples, left padding, nothing left on the model, the
refused attention residuals, and a GLA model written out by hand from the rules (token loop, no library code)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mamba_captum as mc
from fla_models import fla_models, make_fla_model, padded_batch
from test_lrp import (TARGET, explain_with_share, float64_head, modified_logits, no_hooks_left, spread_biases)

COVERED = ["gla", "gla_conv", "delta_net", "delta_net_variant", "gated_deltanet", "kda", "kda_safe_gate"]


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
    model = with_biases(make_fla_model(name, torch.float64))
    spread_biases(model)
    ids = torch.randint(3, 64, (1, 10))
    relevance, delta, share, modified, real = explain_with_share(model, ids)
    assert abs(share) > 1e-4
    scale = max(1.0, abs(float(modified)), abs(share), float(relevance.abs().sum()))
    assert abs(float(delta) + share) <= 1e-13 * scale
    assert abs(float(modified) - float(real)) <= 1e-6 * max(1.0, abs(float(real)))
    assert no_hooks_left(model)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.float64, 1e-6)])
@pytest.mark.parametrize("name", ["gla_conv", "delta_net", "gated_deltanet", "kda"])
def test_the_modified_forward_gives_the_models_output(name, dtype, bound):
    model = with_biases(make_fla_model(name, dtype))
    ids = torch.randint(3, 64, (2, 8))
    with torch.no_grad():
        real = model(ids, use_cache=False).logits
    modified = modified_logits(model, ids)
    assert (modified - real).abs().max() <= bound * real.abs().max()
    assert no_hooks_left(model)


@pytest.mark.parametrize("name", ["gla_conv", "gated_deltanet", "kda"])
def test_batch_equals_single_examples(name):
    model = make_fla_model(name, torch.float64)
    ids = torch.randint(3, 64, (3, 7))
    method = mc.MambaLRP(model)
    batched = method.attribute(ids, target=[4, 9, 11])
    singles = torch.cat([method.attribute(ids[i:i + 1], target=t) for i, t in enumerate([4, 9, 11])])
    assert (batched - singles).abs().max() <= 1e-10 * singles.abs().max()
    assert no_hooks_left(model)


@pytest.mark.parametrize("name", ["gla_conv", "delta_net_variant", "gated_deltanet", "kda"])
def test_left_padding_gives_the_unpadded_relevance(name):
    model = make_fla_model(name, torch.float64)
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


def test_gla_matches_a_reference_written_from_the_rules():
    model = with_biases(make_fla_model("gla_conv", torch.float64))
    spread_biases(model)
    ids = torch.randint(3, 64, (2, 7))
    embeddings = model.model.embeddings(ids).detach().requires_grad_(True)
    hidden = embeddings
    for block in model.model.layers:
        hidden = hidden + _reference_gla(block.attn, _rms_rule(hidden, block.attn_norm.weight, block.attn_norm.eps))
        mlp = block.mlp
        x = _rms_rule(hidden, block.mlp_norm.weight, block.mlp_norm.eps)
        gate = mlp.gate_proj(x)
        hidden = hidden + mlp.down_proj(_half(gate * torch.sigmoid(gate).detach(), mlp.up_proj(x)))
    logit = model.lm_head(_rms_rule(hidden, model.model.norm.weight, model.model.norm.eps))[:, -1, TARGET]
    (grad,) = torch.autograd.grad(logit.sum(), embeddings)
    expected = (grad * embeddings).sum(-1)
    relevance = mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert (relevance - expected).abs().max() <= 1e-10 * expected.abs().max()
    assert no_hooks_left(model)
