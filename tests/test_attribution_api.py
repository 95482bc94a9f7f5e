"""Captum conventions of the three methods: targets, batching, padding, input forms, heads, no side effects."""
import pytest
import torch
import transformers as tf
from captum.attr import Attribution, GradientAttribution, TextTokenInput
from captum.metrics import infidelity
from test_engine import assert_untouched, model_state
from test_identities import liven
from tiny_models import CONFIGS, VOCAB, make_model

import mamba_captum as mc

METHODS = (mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution)
VARIANTS = [(mc.MambaRawAttention, {}), (mc.MambaRollout, {}), (mc.MambaAttribution, {}),
            (mc.MambaAttribution, {"gradient_rule": "residual"}), (mc.MambaRawAttention, {"recipe": "official"}),
            (mc.MambaRollout, {"recipe": "official"}), (mc.MambaAttribution, {"recipe": "official"})]
TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def mamba():
    return liven(make_model("mamba", seed=1))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_family_every_method(family):
    model = liven(make_model(family))
    ids = torch.randint(3, VOCAB, (2, 7))
    for method, options in VARIANTS:
        relevance = method(model).attribute(ids, start_layer=0, **options)
        assert relevance.shape == (2, 7) and relevance.dtype == torch.float32 and torch.isfinite(relevance).all()


def test_captum_protocol(mamba):
    for method in METHODS:
        explainer = method(mamba)
        assert isinstance(explainer, Attribution) and not explainer.multiplies_by_inputs
        assert not explainer.has_convergence_delta()
        with pytest.raises(NotImplementedError, match="attribute_future"):
            explainer.attribute_future(torch.ones(1, 3, dtype=torch.long))
    assert isinstance(mc.MambaAttribution(mamba), GradientAttribution)


@pytest.mark.parametrize("options", [{}, {"gradient_rule": "residual"}, {"recipe": "official"}])
def test_batched_per_example_targets_equal_single_examples(mamba, options):
    ids = torch.randint(3, VOCAB, (3, 8))
    targets = [5, 17, 40]
    explainer = mc.MambaAttribution(mamba)
    batched = explainer.attribute(ids, target=targets, **options)
    singles = torch.cat([explainer.attribute(ids[i:i + 1], target=t, **options) for i, t in enumerate(targets)])
    assert torch.allclose(batched, singles, **TOL)
    assert torch.allclose(explainer.attribute(ids, target=torch.tensor(targets), **options), batched, **TOL)
    assert torch.allclose(explainer.attribute(ids, target=[(t,) for t in targets], **options), batched, **TOL)
    same = explainer.attribute(ids, target=(17,), **options)
    assert torch.allclose(same, explainer.attribute(ids, target=17, **options), **TOL)
    assert not torch.allclose(batched, same)  # the target matters


def test_target_none_is_the_argmax_token(mamba):
    ids = torch.randint(3, VOCAB, (2, 6))
    top = mamba(ids).logits[:, -1].argmax(-1)
    explainer = mc.MambaAttribution(mamba)
    assert torch.allclose(explainer.attribute(ids), explainer.attribute(ids, target=top.tolist()), **TOL)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
@pytest.mark.parametrize("method,options", VARIANTS)
def test_padding_gives_the_unpadded_result(family, method, options):
    model = liven(make_model(family))
    ids = torch.randint(3, VOCAB, (1, 7))
    explainer = method(model)
    alone = explainer.attribute(ids, target=9, start_layer=0, **options)[0]
    pad = torch.zeros(1, 3, dtype=torch.long)
    left = torch.cat([pad, ids], 1), torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], 1).long()
    right = torch.cat([ids, pad], 1), torch.cat([torch.ones(1, 7), torch.zeros(1, 3)], 1).long()
    other = torch.randint(3, VOCAB, (1, 10))
    for (padded, mask), real in ((left, slice(3, None)), (right, slice(0, 7))):
        batch_ids, batch_mask = torch.cat([padded, other]), torch.cat([mask, torch.ones(1, 10).long()])
        got = explainer.attribute(batch_ids, target=9, attention_mask=batch_mask, start_layer=0, **options)
        assert torch.allclose(got[0, real], alone, rtol=1e-3, atol=1e-5), (family, options)
        assert torch.all(got[0][mask[0] == 0] == 0)


def test_position_picks_the_query_row(mamba):
    ids = torch.randint(3, VOCAB, (2, 9))
    explainer = mc.MambaRollout(mamba)
    inner = explainer.attribute(ids, position=[4, 6])
    assert torch.allclose(inner[0, :5], explainer.attribute(ids[:1, :5])[0], **TOL)
    assert torch.allclose(inner[1, :7], explainer.attribute(ids[1:, :7])[0], **TOL)
    assert torch.all(inner[0, 5:] == 0)
    attribution = mc.MambaAttribution(mamba).attribute(ids, position=4, target=3)
    assert torch.allclose(attribution[:, :5], mc.MambaAttribution(mamba).attribute(ids[:, :5], target=3), **TOL)


def test_bad_arguments_raise_clear_errors(mamba):
    ids = torch.randint(3, VOCAB, (2, 5))
    explainer = mc.MambaAttribution(mamba)
    with pytest.raises(IndexError, match="out of range.*64 classes"):
        explainer.attribute(ids, target=64)
    with pytest.raises(ValueError, match="3 targets for a batch of 2"):
        explainer.attribute(ids, target=[1, 2, 3])
    with pytest.raises(IndexError, match="one class index"):
        explainer.attribute(ids, target=(1, 2))
    with pytest.raises(TypeError, match="integer class"):
        explainer.attribute(ids, target=torch.tensor([0.5, 1.0]))
    with pytest.raises(IndexError, match="position"):
        explainer.attribute(ids, position=5)
    with pytest.raises(ValueError, match="padding token"):
        explainer.attribute(ids, position=0, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))
    with pytest.raises(ValueError, match="gradient_rule"):
        explainer.attribute(ids, gradient_rule="lrp")
    with pytest.raises(ValueError, match="recipe"):
        explainer.attribute(ids, recipe="paper")
    with pytest.raises(ValueError, match="tuple of 2"):
        explainer.attribute((ids, ids))
    with pytest.raises(ValueError, match=r"\(B, L\)"):
        explainer.attribute(ids[0])
    with pytest.raises(IndexError, match="start_layer"):
        explainer.attribute(ids, start_layer=2)
    with pytest.raises(TypeError, match="not supported|none of the supported"):
        mc.MambaRollout(tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1,
                                                             num_attention_heads=2, intermediate_size=32)))


@pytest.mark.parametrize("method", [*METHODS, mc.MambaSelectionAttribution, mc.MambaLRP])
def test_targets_follow_captums_rule(mamba, method):
    """Captum's _select_targets: an int, a 1-tuple or a one-element tensor is one class for all; a list or a 1-D
    tensor is one class per example, exactly B of them: a list of one is not broadcast to a batch of two."""
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    explainer = method(mamba)
    for target in ([1], [], [1, 2, 3]):
        with pytest.raises(ValueError, match=rf"^mamba_captum: {len(target)} targets for a batch of 2 examples: a "
                                             "target list gives one per example, so it must have 2"):
            explainer.attribute(ids, target=target)
    for target in (torch.tensor([[1], [2]]), torch.tensor([[1, 2]]), torch.tensor([1, 2, 3])):
        with pytest.raises(ValueError, match=rf"{target.numel()} targets \(a tensor of shape "
                                             rf"\({', '.join(map(str, target.shape))},?\)\) for a batch of 2"):
            explainer.attribute(ids, target=target)
    with pytest.raises(TypeError, match="a tuple target holds one class index"):
        explainer.attribute(ids, target=([1, 2],))
    same = explainer.attribute(ids, target=1)
    for target in ((1,), torch.tensor(1), torch.tensor([1]), torch.tensor([[1]]), [1, 1], [(1,), (1,)],
                   torch.tensor([1, 1])):
        assert torch.equal(explainer.attribute(ids, target=target), same)
    assert torch.allclose(explainer.attribute(ids[:1], target=[1]), same[:1], **TOL)  # one for one example


def test_no_side_effects_after_success_errors_and_a_failing_forward(mamba):
    before = model_state(mamba)
    ids = torch.randint(3, VOCAB, (2, 6))
    for method, options in VARIANTS:
        method(mamba).attribute(ids, target=1, **options)
    with pytest.raises(IndexError):
        mc.MambaAttribution(mamba).attribute(ids, target=1000)

    def failing(inputs, **kwargs):
        mamba(inputs, **kwargs)
        raise RuntimeError("head failed")

    for method in METHODS:
        with pytest.raises(RuntimeError, match="head failed"):
            method(mamba, forward_func=failing).attribute(ids)
    with torch.no_grad():  # a caller's no_grad does not stop the gradient method, nor leak
        mc.MambaAttribution(mamba).attribute(ids, target=1)
    with mc.MambaAttribution(mamba) as explainer:
        explainer.attribute(ids, target=2)
    assert_untouched(mamba, before)
    assert all(p.grad is None for p in mamba.parameters())


def test_frozen_model_still_gets_gradients(mamba):
    ids = torch.randint(3, VOCAB, (1, 6))
    expected = mc.MambaAttribution(mamba).attribute(ids, target=4, gradient_rule="residual")
    frozen = liven(make_model("mamba", seed=1)).requires_grad_(False)
    before = model_state(frozen)
    got = mc.MambaAttribution(frozen).attribute(ids, target=4, gradient_rule="residual")
    assert torch.allclose(got, expected, **TOL)
    assert_untouched(frozen, before)


def test_embeddings_and_tuple_inputs(mamba):
    ids = torch.randint(3, VOCAB, (2, 6))
    embeds = mamba.get_input_embeddings()(ids).detach()
    for method in METHODS:
        explainer = method(mamba)
        from_ids = explainer.attribute(ids, target=3)
        from_embeds = explainer.attribute(embeds, target=3)
        assert from_embeds.shape == embeds.shape
        assert torch.allclose(from_embeds[..., 0], from_ids, **TOL) and torch.all(from_embeds == from_embeds[..., :1])
        (as_tuple,) = explainer.attribute((ids,), target=3)
        assert torch.equal(as_tuple, from_ids)


def test_captum_metrics_accept_the_embedding_attributions(mamba):
    ids = torch.randint(3, VOCAB, (2, 6))
    embeds = mamba.get_input_embeddings()(ids).detach()
    attributions = mc.MambaAttribution(mamba).attribute(embeds, target=3)

    def perturb(inputs):
        noise = 0.01 * torch.randn_like(inputs)
        return noise, inputs - noise

    score = infidelity(lambda e: mamba(inputs_embeds=e).logits[:, -1], perturb, embeds, attributions, target=3,
                       n_perturb_samples=4)
    assert score.shape == (2,) and torch.isfinite(score).all()


@pytest.mark.parametrize("family", ["jamba", "zamba2"])
def test_sequence_classification_explains_the_pooled_token(family):
    config = CONFIGS[family]()
    config.num_labels = 3
    torch.manual_seed(0)
    model = tf.AutoModelForSequenceClassification.from_config(config).eval()
    ids = torch.randint(3, VOCAB, (2, 8))
    ids[0, 6:] = config.pad_token_id  # HF pools the last non-pad token: position 5 here
    mask = (ids != config.pad_token_id).long()
    explainer = mc.MambaAttribution(model)
    got = explainer.attribute(ids, target=[0, 2], attention_mask=mask)
    assert torch.all(got[0, 6:] == 0) and got[0, 5] > 0 and got[1, 7] > 0
    with pytest.raises(IndexError, match="3 classes"):
        explainer.attribute(ids, target=3, attention_mask=mask)
    with pytest.raises(ValueError, match="pooled"):
        explainer.attribute(ids, position=2, attention_mask=mask)


def test_forward_func_for_a_base_model_with_a_custom_head():
    torch.manual_seed(0)
    base = tf.MambaModel(CONFIGS["mamba"]()).eval()
    head = torch.nn.Linear(32, 4)

    def forward_func(ids, attention_mask=None):
        return head(base(ids, attention_mask=attention_mask).last_hidden_state[:, -1])

    ids = torch.randint(3, VOCAB, (2, 6))
    for method in METHODS:
        relevance = method(base, forward_func=forward_func).attribute(ids, target=1)
        assert relevance.shape == (2, 6)
    with pytest.raises(TypeError, match="forward_func"):
        mc.MambaAttribution(base).attribute(ids, target=1)
    raw = mc.MambaRawAttention(base).attribute(ids)  # class-agnostic methods need no head
    assert raw.shape == (2, 6)
    with pytest.raises(ValueError, match=r"\(B, K\)"):
        mc.MambaAttribution(base, forward_func=lambda ids: base(ids).last_hidden_state).attribute(ids, target=0)


def test_forward_arguments_reach_the_model(mamba):
    ids = torch.randint(3, VOCAB, (1, 6))
    seen = []
    handle = mamba.backbone.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("output_hidden_states")),
                                                      with_kwargs=True)
    try:
        mc.MambaRollout(mamba).attribute(ids, output_hidden_states=True)
        mc.MambaRollout(mamba).attribute(ids, additional_forward_args={"output_hidden_states": True})
    finally:
        handle.remove()
    assert seen == [True, True]


class CharTokenizer:
    """The parts of a tokenizer that TextTokenInput and attribute_generation use; one character per token."""

    def encode(self, text, return_tensors=None, add_special_tokens=True):
        ids = [3 + (ord(c) % 60) for c in text]
        return torch.tensor([ids]) if return_tensors == "pt" else ids

    def convert_ids_to_tokens(self, ids):
        return [chr(((i - 3) % 60) + 60) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        return [3 + (ord(t) - 60) % 60 for t in tokens]


@pytest.mark.parametrize("method,options", VARIANTS[:4])
def test_generation_rows_equal_single_queries(mamba, method, options):
    tokenizer = CharTokenizer()
    inp = TextTokenInput("abcdef", tokenizer, skip_tokens=[tokenizer.encode("c", add_special_tokens=False)[0]])
    explainer = method(mamba)
    result = explainer.attribute_generation(inp, target="xyz", **options)
    assert result.token_attr.shape == (3, 5) and result.seq_attr.shape == (5,)
    assert len(result.input_tokens) == 5 and len(result.output_tokens) == 3
    assert torch.allclose(result.seq_attr, result.token_attr.sum(0))
    prompt, target = inp.inp_tensor, torch.tensor(tokenizer.encode("xyz", add_special_tokens=False))
    keep = torch.tensor([True, True, False, True, True, True])
    full = torch.cat([prompt, target[None]], 1)
    for t in range(3):
        single = explainer.attribute(full[:, :6 + t], target=int(target[t]), **options)[0, :6]
        assert torch.allclose(result.token_attr[t], single[keep], **TOL)
        probs = mamba(full[:, :6 + t]).logits[0, -1].softmax(-1)
        assert torch.isclose(result.output_probs[t], probs[target[t]], rtol=1e-4)


def test_generation_generates_when_no_target_is_given(mamba):
    prompt = torch.randint(3, VOCAB, (1, 5))
    result = mc.MambaRollout(mamba).attribute_generation(prompt, gen_args={"max_new_tokens": 3})
    generated = mamba.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    assert result.output_tokens == [str(int(i)) for i in generated[0, 5:]]
    assert result.token_attr.shape == (3, 5)
