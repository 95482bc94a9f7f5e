"""The three methods against hand-computed cases and a direct re-implementation of the official procedure."""
import math

import pytest
import torch
import transformers as tf
from test_identities import liven
from tiny_models import make_model

import mamba_captum as mc
from mamba_captum.attr._rollout import RunningProduct, layer_weights, rollout_step

LN2 = math.log(2.0)


def hand_model(layers=2, length_check=True):
    """Mamba with d_inner = N = 1, every token the same, and out_proj = 0 (so each layer sees the same input):
    Δ = softplus(0) = ln 2, A = −1, B = 2, C = 1/2, conv = identity (one tap of weight 1, no bias), gate z = x.
    Hidden: α[i, j] = C·B·Δ·exp(−Δ (i − j)) = ln 2 · 2^−(i−j). Unified (K = 1): H = silu(x)·α·σ(x)."""
    config = tf.MambaConfig(vocab_size=4, hidden_size=1, state_size=1, expand=1, conv_kernel=1, time_step_rank=1,
                            num_hidden_layers=layers, use_bias=False, use_conv_bias=False, pad_token_id=0,
                            tie_word_embeddings=False)
    model = tf.MambaForCausalLM(config).eval()
    normed = 1.0 / math.sqrt(1.0 + config.layer_norm_epsilon)  # RMS norm of the embedding value 1
    u = normed * torch.sigmoid(torch.tensor(normed)).item()  # silu(x) after the identity conv
    with torch.no_grad():
        model.backbone.embeddings.weight.fill_(1.0)
        for layer in model.backbone.layers:
            mixer = layer.mixer
            mixer.in_proj.weight.fill_(1.0)  # x = z = normed
            mixer.conv1d.weight.fill_(1.0)
            mixer.x_proj.weight.copy_(torch.tensor([[0.0], [2.0 / u], [0.5 / u]]))  # dt_low = 0, B = 2, C = 1/2
            mixer.dt_proj.weight.zero_()
            mixer.dt_proj.bias.zero_()
            mixer.A_log.zero_()
            mixer.D.zero_()
            mixer.out_proj.weight.zero_()
            layer.norm.weight.fill_(1.0)
    gain = u * torch.sigmoid(torch.tensor(normed)).item()  # silu(z) · σ(conv pre-activation) · conv tap 1
    return model, gain


def hand_map(length, gain):
    index = torch.arange(length, dtype=torch.float64)
    alpha = LN2 * torch.pow(2.0, -(index[:, None] - index[None, :]))
    return (gain * alpha).tril()


@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_hand_computed_raw_and_rollout(formulation):
    model, gain = hand_model()
    gain = 1.0 if formulation == "hidden" else gain
    ids = torch.ones(1, 3, dtype=torch.long)
    A = hand_map(3, gain)  # the same map in both layers
    raw = mc.MambaRawAttention(model).attribute(ids, formulation=formulation)
    assert torch.allclose(raw[0].double(), A[2], rtol=1e-5)  # (1/4, 1/2, 1) · ln 2 · gain

    step = (torch.eye(3, dtype=torch.float64) + A)
    step = step / step.sum(-1, keepdim=True)
    rollout = mc.MambaRollout(model).attribute(ids, formulation=formulation)
    assert torch.allclose(rollout[0].double(), (step @ step)[2], rtol=1e-5)
    a = LN2 * gain  # by hand, one layer: row 2 of rownorm(I + A) = (a/4, a/2, a + 1) / (1.75 a + 1)
    one_layer = mc.MambaRollout(model).attribute(ids, formulation=formulation, start_layer=1)
    assert torch.allclose(one_layer[0].double(), torch.tensor([a / 4, a / 2, a + 1], dtype=torch.float64)
                          / (1.75 * a + 1), rtol=1e-5)

    # official raw: per layer min-max of (1/4, 1/2, 1) -> (0, 1/3, 1); query entry dropped.
    official_raw = mc.MambaRawAttention(model).attribute(ids, formulation=formulation, recipe="official",
                                                         start_layer=0)
    assert torch.allclose(official_raw[0].double(), torch.tensor([0.0, 1 / 3, 0.0], dtype=torch.float64),
                          atol=1e-6)
    # official rollout: M = rownorm(1 · vᵀ + I) with v = A[2], both layers; row 2, query entry dropped.
    v = A[2]
    M = v[None, :].expand(3, 3) + torch.eye(3, dtype=torch.float64)
    M = M / M.sum(-1, keepdim=True)
    expected = (M @ M)[2].clone()
    expected[2] = 0
    official_rollout = mc.MambaRollout(model).attribute(ids, formulation=formulation, recipe="official",
                                                        start_layer=0)
    assert torch.allclose(official_rollout[0].double(), expected, rtol=1e-5)


def test_running_product_puts_later_layers_on_the_left():
    first = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]])
    second = torch.tensor([[[2.0, 1.0], [0.0, 1.0]]])
    product = RunningProduct()
    product.push(first)
    product.push(second)
    assert torch.equal(product.product, second @ first)
    assert torch.equal(product.rows(torch.tensor([0]), 2), (second @ first)[:, 0])
    assert torch.allclose(rollout_step(torch.tensor([[[0.0, -5.0], [1.0, 1.0]]])),
                          torch.tensor([[[1.0, 0.0], [1 / 3, 2 / 3]]]))


@pytest.mark.parametrize("sign,normalise,expected", [
    ("absolute", "row_max", [[1.0, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    ("positive", "row_max", [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    ("absolute", "row_sum", [[2 / 3, 1 / 3, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
    ("positive", "none", [[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]),
])
def test_layer_weights_by_hand(sign, normalise, expected):
    """|G| or G₊, then each row over its max or its sum; an all-zero row (padding) stays zero."""
    matrix = torch.tensor([[[-2.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    assert torch.allclose(layer_weights(matrix, sign, normalise), torch.tensor([expected]))


def _scaled(model, factor):
    return lambda ids: factor * model(ids).logits[:, -1]


def test_row_normalised_attribution_ignores_the_scale_and_sign_of_the_explained_score():
    """Row normalisation makes the product recipe's rollout independent of the gradients' scale, and |G| of their
    sign: explaining −10 × the logits gives the same relevance; the unnormalised positive part does not. (The default
    recipe, the magnitude of MambaLRP's relevance, scales with the score: tests/test_default_method.py.)"""
    model = make_model("mamba")
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    target = torch.tensor([5, 7])

    def relevance(factor, **options):
        method = mc.MambaAttribution(model, forward_func=_scaled(model, factor))
        return method.attribute(ids, target=target, recipe="product", **options)

    default = relevance(1.0)
    assert torch.allclose(relevance(-10.0), default, atol=1e-6)
    assert torch.allclose(relevance(-10.0, sign="positive", normalise="row_max"),
                          relevance(-1.0, sign="positive", normalise="row_max"), atol=1e-6)
    unnormalised = relevance(1.0, sign="positive", normalise="none")
    # unnormalised, the identity dominates: evidence shares scale with the gradients (here by 10x)
    assert not torch.allclose(relevance(10.0, sign="positive", normalise="none"), unnormalised, rtol=0.1, atol=0)
    assert not torch.allclose(default, unnormalised, rtol=0.1, atol=0)


def test_bad_sign_or_normalise_names_the_choices():
    model = make_model("mamba")
    with pytest.raises(ValueError, match="sign='both'.*absolute"):
        mc.MambaAttribution(model).attribute(torch.ones(1, 4, dtype=torch.long), target=1, sign="both")
    with pytest.raises(ValueError, match="normalise='max'.*row_max"):
        mc.MambaAttribution(model).attribute(torch.ones(1, 4, dtype=torch.long), target=1, normalise="max")


# -- the official procedure, re-implemented from reference/official-recipes.md -------------------------------------
def official_inputs(model, ids, formulation, start):
    """Per-channel query rows (last token) of every layer from `start`, and the residual-stream gradients of the
    top logit, by the test's own hooks."""
    rows = {k: v[0, :, -1].double() for k, v in mc.implicit_attention(model, ids, formulation=formulation,
                                                                       reduce=None).items() if k >= start}
    residuals, handles = {}, []
    for index, layer in enumerate(model.backbone.layers):
        def hook(module, args, index=index):
            args[0].retain_grad()
            residuals[index] = args[0]
        handles.append(layer.register_forward_pre_hook(hook))
    logits = model(ids).logits[:, -1]
    for handle in handles:
        handle.remove()
    (logits[0, logits[0].argmax()]).backward()
    model.zero_grad(set_to_none=True)
    return rows, {k: v.grad[0].double() for k, v in residuals.items()}


def chefer_rollout(layer_matrices):
    eye = torch.eye(layer_matrices[0].shape[0], dtype=torch.float64)
    augmented = [(m + eye) / (m + eye).sum(-1, keepdim=True) for m in layer_matrices]
    joint = augmented[0]
    for matrix in augmented[1:]:
        joint = matrix @ joint
    return joint


def mm(x):
    return (x - x.min()) / (x.max() - x.min())


@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_official_recipe_matches_a_direct_reimplementation(formulation):
    model = liven(make_model("mamba", num_hidden_layers=3))
    ids = torch.randint(3, 64, (1, 9))
    start = 1
    rows, grads = official_inputs(model, ids, formulation, start)
    length, q = ids.shape[1], ids.shape[1] - 1

    def finish(vector):
        vector = vector.clone()
        vector[q] = 0
        return vector.clamp(min=0)

    # Raw attention: min-max over (channels × L), channel mean, layer mean.
    raw = torch.stack([mm(rows[k]).mean(0) for k in rows]).mean(0)
    # Rollout: the signed channel mean broadcast to every row.
    rollout = chefer_rollout([rows[k].mean(0)[None, :].expand(length, length) for k in rows])[q]
    # Attribution: HMA for hidden, UIA for unified.
    matrices = []
    for k in rows:
        s = mm(grads[k].clamp(min=0).amax(-1))
        relu_rows = rows[k].clamp(min=0)
        if formulation == "hidden":
            weighted = torch.stack([mm(r) for r in relu_rows]).mean(0) * s
        else:
            weighted = mm(relu_rows.mean(0) * s)
        matrices.append(weighted[None, :].expand(length, length))
    attribution = chefer_rollout(matrices)[q]

    kwargs = dict(formulation=formulation, recipe="official", start_layer=start)
    got_raw = mc.MambaRawAttention(model).attribute(ids, **kwargs)[0].double()
    got_rollout = mc.MambaRollout(model).attribute(ids, **kwargs)[0].double()
    got_attr = mc.MambaAttribution(model).attribute(ids, **kwargs)[0].double()
    assert torch.allclose(got_raw, finish(raw), atol=1e-5)
    assert torch.allclose(got_rollout, finish(rollout), atol=1e-5)
    assert torch.allclose(got_attr, finish(attribution), atol=1e-5)
    assert finish(attribution).sum() > 0  # the case is not degenerate


def test_official_start_layer_defaults_to_15_of_24():
    from mamba_captum.attr._base import official_start_layer
    assert official_start_layer(24) == 15 and official_start_layer(48) == 30 and official_start_layer(2) == 1
    model = liven(make_model("mamba", num_hidden_layers=3))
    ids = torch.randint(3, 64, (1, 7))
    method = mc.MambaRollout(model)
    assert torch.equal(method.attribute(ids, recipe="official"),
                       method.attribute(ids, recipe="official", start_layer=2))
