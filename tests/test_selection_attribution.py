"""MambaSelectionAttribution: the input effects are gradient × input at each layer's inputs (checked against the
test's own hooks), the selection share is what the value path leaves of them, the query spread is exact at the last
layer, batches equal single examples, padding equals no padding, bad options are refused, and nothing is left on
the model."""
import pytest
import torch
from test_engine import assert_untouched, model_state
from tiny_models import make_model

import mamba_captum as mc
from mamba_captum.attr._runner import Runner
from mamba_captum.attr.selection_attribution import selection_share, spread_share

TARGET = 5


def explained_run(model, ids, mask=None):
    """The runner's pass with operator gradients and input effects, and the records (operators rebuilt)."""
    runner = Runner(model)
    explained = runner.run(ids, attention_mask=mask, targets=TARGET, operator_grads=True, input_effects=True)
    return explained, list(explained.layers())


def own_effects(model, ids, modules):
    """Σ_features ∂T/∂out · out of each module's output (B, L), by the test's own hooks and autograd."""
    outputs, handles = {}, []
    for name, module in modules.items():
        handles.append(module.register_forward_hook(
            lambda mod, args, out, name=name: outputs.__setitem__(name, out)))
    try:
        logits = model(ids, use_cache=False).logits[:, -1, TARGET].sum()
        grads = torch.autograd.grad(logits, [outputs[n] for n in modules])
    finally:
        for handle in handles:
            handle.remove()
    return {name: (g * outputs[name]).sum(-1).detach() for name, g in zip(modules, grads)}


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_mixer_effects_are_gradient_times_input_at_the_mixer_input(family):
    model = make_model(family, dtype=torch.float64)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    _, records = explained_run(model, ids)
    layers = mc.families.decoder_layers(model)
    # the mixer input is the output of each layer's pre-mixer norm
    norms = {f"{i}": layer.norm for i, layer in enumerate(layers)}
    expected = own_effects(model, ids, norms)
    assert len(records) == len(layers)
    for record in records:
        (effect,) = record.input_effects
        error = (effect - expected[str(record.layer)]).abs().max() / expected[str(record.layer)].abs().max()
        assert error <= 1e-7, (record.key, error)  # the library runs the fast scans: float64 rounding apart


def test_attention_effects_are_gradient_times_input_at_queries_and_keys():
    model = make_model("jamba", dtype=torch.float64)  # Mamba, attention, Mamba; no RoPE: q, k are the projections
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    _, records = explained_run(model, ids)
    attention = [r for r in records if "Attention" in type(mc.families.decoder_layers(model)[r.layer]).__name__
                 or hasattr(mc.families.decoder_layers(model)[r.layer], "self_attn")]
    assert len(attention) == 1
    layer = mc.families.decoder_layers(model)[attention[0].layer].self_attn
    own = own_effects(model, ids, {"q": layer.q_proj, "k": layer.k_proj})
    (effect,) = attention[0].input_effects
    assert torch.allclose(effect, own["q"] + own["k"], rtol=1e-9, atol=1e-12)


def test_the_query_spread_is_exact_at_the_last_layer():
    model = make_model("mamba", dtype=torch.float64)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(2))
    explained, records = explained_run(model, ids)
    last = records[-1]
    contributions = last.operator.contributions(last.operator_grads[0])
    # only the query's row reaches the target through the last layer (the head reads the last token)
    assert contributions[:, :-1].abs().max() == 0 and contributions[:, -1].abs().max() > 0
    share = selection_share(contributions, last.input_effects[0], explained.mask)
    spread = spread_share(contributions, share, explained.queries[0], "query")
    # the query's row of G + S holds each token's whole first-order effect through the layer's inputs
    assert torch.allclose(spread[:, -1], last.input_effects[0], rtol=1e-9, atol=1e-12)
    assert torch.allclose(spread.sum((1, 2)), last.input_effects[0].sum(-1), rtol=1e-9)
    column = spread_share(contributions, share, explained.queries[0], "column")
    assert torch.allclose(column.sum(1), last.input_effects[0], rtol=1e-9, atol=1e-12)  # columns sum to e


def test_spreads_on_a_hand_computed_case():
    from mamba_captum.attr._rollout import Query

    G = torch.tensor([[[1.0, 0.0, 0.0], [2.0, 1.0, 0.0], [-2.0, 0.0, 3.0]]])
    effects = torch.tensor([[0.0, 4.0, 5.0]])
    share = selection_share(G, effects, torch.ones(1, 3))
    assert share.tolist() == [[-1.0, 3.0, 2.0]]  # e − column sums (1, 1, 3)
    query = Query(torch.tensor([2]))
    assert spread_share(G, share, query, "query").tolist() == [[[1, 0, 0], [2, 1, 0], [-3, 3, 5]]]
    # column j over the rows by |G[:, j]|: (1, 2, 2) / 5, then (0, 1, 0), then (0, 0, 1)
    expected = G + torch.tensor([[[-0.2, 0, 0], [-0.4, 3, 0], [-0.4, 0, 2]]])
    assert torch.allclose(spread_share(G, share, query, "column"), expected)


@pytest.mark.parametrize("family", ["mamba", "jamba", "falcon_h1", "qwen3_next"])
def test_batch_equals_single_and_padding_equals_unpadded(family):
    model = make_model(family)
    before = model_state(model)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 60, (2, 10), generator=generator)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    method = mc.MambaSelectionAttribution(model)
    batched = method.attribute(ids, attention_mask=mask, target=TARGET)
    single = method.attribute(ids[1:], target=TARGET)
    unpadded = method.attribute(ids[:1, 3:], target=TARGET)
    assert torch.allclose(batched[1:], single, atol=1e-5)
    assert torch.allclose(batched[0, 3:], unpadded[0], atol=1e-5) and batched[0, :3].abs().max() == 0
    assert torch.isfinite(batched).all()
    assert_untouched(model, before)


def test_options_are_checked():
    model = make_model("mamba")
    ids = torch.randint(3, 60, (1, 6))
    method = mc.MambaSelectionAttribution(model)
    with pytest.raises(ValueError, match="spread='rows'; choose one of"):
        method.attribute(ids, target=TARGET, spread="rows")
    with pytest.raises(TypeError):
        method.attribute(ids, target=TARGET, recipe="official")  # the papers' recipe is MambaAttribution's
    with pytest.raises(ValueError, match="sign="):
        method.attribute(ids, target=TARGET, sign="negative")


@pytest.mark.parametrize("family", ["falcon_mamba", "zamba2", "nemotron_h", "rwkv", "recurrent_gemma", "minimax",
                                    "xlstm", "lfm2", "kimi_linear", "zamba", "inkling"])
def test_every_family_gives_finite_relevance_and_nothing_on_pads(family):
    if family == "inkling":
        from test_inkling import inkling_text
        model = inkling_text(torch.float32)
    else:
        model = make_model(family)
    before = model_state(model)
    ids = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    pads = slice(7, None) if family in ("rwkv", "recurrent_gemma", "xlstm") else slice(0, 3)  # right-padded ones
    ids[0, pads], mask[0, pads] = 0, 0
    relevance = mc.MambaSelectionAttribution(model).attribute(ids, attention_mask=mask, target=TARGET)
    assert relevance.shape == (2, 10) and torch.isfinite(relevance).all() and relevance[0, pads].abs().max() == 0
    assert_untouched(model, before)


def test_an_image_model_gets_pixel_relevance():
    from tiny_models import make_vim

    model = make_vim()
    relevance = mc.MambaSelectionAttribution(model).attribute(torch.randn(2, 3, 32, 32), target=1)
    assert relevance.shape == (2, 1, 32, 32) and torch.isfinite(relevance).all()


def test_the_selection_share_finds_what_the_value_path_misses_on_conjunction():
    # the suite's tiny Mamba trained on conjunction (class 1 iff both an x and a y token occur): the second of the
    # two matters by changing how the first is read, which a fixed operator does not credit
    from mamba_captum.evaluation import compare, metrics
    from mamba_captum.evaluation.models import load_classifier, one_thread

    model, _ = load_classifier("mamba", "conjunction")
    task = compare.evaluation_task("conjunction", examples=32)
    forward = compare._class_forward(model, task, "log_prob")
    fixed = torch.zeros_like(task.relevant)
    fixed[:, -1] = True
    scores = {}
    with one_thread():
        for method, options in ((mc.MambaAttribution, {"recipe": "product"}), (mc.MambaSelectionAttribution, {})):
            relevance = method(model, forward_func=forward).attribute(task.input_ids, target=task.labels, **options)
            roc = metrics.localisation_scores(relevance, task.relevant, exclude=fixed)["roc_auc"]
            scores[method.__name__] = torch.nanmean(roc).item()
    assert scores["MambaSelectionAttribution"] >= 0.99 and scores["MambaAttribution"] <= 0.85, scores


def explained_rows(model, ids, mask=None):
    runner = Runner(model)
    explained = runner.run(ids, attention_mask=mask, targets=TARGET, operator_grads=True, input_effects="rows")
    return explained, list(explained.layers())


def test_row_effects_are_the_jacobian_rows_times_the_inputs():
    from mamba_captum.attr._gradient import row_effects

    # a small non-linear map of two pieces, one (B, L, D) and one (B, H, L, d), against autograd's full Jacobian
    generator = torch.Generator().manual_seed(5)
    u = torch.randn(2, 4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    k = torch.randn(2, 2, 4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(3, 5, dtype=torch.float64, generator=generator)
    causal = torch.tril(torch.ones(4, 4, dtype=torch.float64))

    def mixer(u, k):
        scores = torch.tanh(u @ k.sum(1).transpose(1, 2)) * causal  # (B, L, L), data-dependent
        return (scores @ u).sin() @ weight  # (B, L, 5)

    output = mixer(u, k)
    grad = torch.randn(output.shape, dtype=torch.float64, generator=generator)
    effects = row_effects(output, (u, k), grad)
    ju, jk = torch.autograd.functional.jacobian(mixer, (u.detach(), k.detach()))  # (B, L, 5, B, ...)
    expected = torch.zeros(2, 4, 4, dtype=torch.float64)
    for b in range(2):
        for i in range(4):
            row_u = torch.einsum("e,eld->ld", grad[b, i], ju[b, i, :, b])  # (L, D)
            row_k = torch.einsum("e,ehld->hld", grad[b, i], jk[b, i, :, b])  # (H, L, d)
            expected[b, i] = (row_u * u[b].detach()).sum(-1) + (row_k * k[b].detach()).sum((0, 2))
    assert torch.allclose(effects, expected, rtol=1e-10, atol=1e-12)
    # the rows sum to gradient × input, the input effects
    total = torch.autograd.grad(output, (u, k), grad)
    assert torch.allclose(effects.sum(1), (total[0] * u).sum(-1) + (total[1] * k).sum((1, 3)), rtol=1e-10)


@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_the_exact_placement_sums_to_the_input_effects_and_is_the_query_spread_at_the_last_layer(family):
    from mamba_captum.attr.selection_attribution import exact_share

    model = make_model(family, dtype=torch.float64)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(6))
    explained, records = explained_rows(model, ids)
    kinds = set()
    for record in records:
        contributions = record.operator.contributions(record.operator_grads[0])
        exact = exact_share(contributions, record.row_effects[0], explained.mask, record.effects_include_values)
        share = selection_share(contributions, record.input_effects[0], explained.mask, record.effects_include_values)
        # every placement puts the same total on each column: the value path plus the selection share
        total = contributions.sum(1) + share
        assert (exact.sum(1) - total).abs().max() <= 1e-8 * total.abs().max(), record.key
        kinds.add(record.effects_include_values)
    assert kinds == ({True, False} if family == "jamba" else {True})  # Jamba's attention layer: queries and keys
    last = records[-1]
    contributions = last.operator.contributions(last.operator_grads[0])
    exact = exact_share(contributions, last.row_effects[0], explained.mask)
    share = selection_share(contributions, last.input_effects[0], explained.mask)
    query_spread = spread_share(contributions, share, explained.queries[0], "query")
    assert (exact - query_spread).abs().max() <= 1e-8 * query_spread.abs().max()


def test_the_exact_spread_batches_and_pads_like_the_others():
    model = make_model("jamba")
    ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    method = mc.MambaSelectionAttribution(model)
    batched = method.attribute(ids, attention_mask=mask, target=TARGET, spread="exact")
    single = method.attribute(ids[1:], target=TARGET, spread="exact")
    unpadded = method.attribute(ids[:1, 3:], target=TARGET, spread="exact")
    assert torch.allclose(batched[1:], single, atol=1e-5)
    assert torch.allclose(batched[0, 3:], unpadded[0], atol=1e-5) and batched[0, :3].abs().max() == 0
