"""MambaAttribution's default (recipe="auto"): the magnitude of MambaLRP's relevance on a token model with its own head
whose modules all have rules, the product recipe's rollout wherever a product option is given, on a model without
rules, a base model explained through a forward_func's head, and an image model; recipe="relevance" refuses what it
cannot do; the explain pipeline and its report say which one ran."""
import pytest
import torch
import transformers as tf
from test_engine import assert_untouched, model_state
from tiny_models import CONFIGS, make_model, make_vim

import mamba_captum as mc

TARGET = 5


@pytest.mark.parametrize("family", ["mamba", "jamba", "qwen3_next"])
def test_the_default_is_the_magnitude_of_mambalrp(family):
    model = make_model(family)
    before = model_state(model)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    method = mc.MambaAttribution(model)
    assert method.resolve_recipe() == "relevance"
    default = method.attribute(ids, target=TARGET)
    signed = mc.MambaLRP(model).attribute(ids, target=TARGET)
    assert torch.equal(default, signed.abs()) and (signed < 0).any()  # a real magnitude, not a copy
    assert torch.equal(method.attribute(ids, target=TARGET, sign="positive"), signed.clamp(min=0))
    # the magnitude scales with the explained score (the rollout's row normalisation does not)
    scaled = mc.MambaAttribution(model, forward_func=lambda i: -10 * model(i).logits[:, -1]).attribute(ids, target=TARGET)
    assert torch.allclose(scaled, 10 * default, rtol=1e-4, atol=1e-6)
    assert_untouched(model, before)


def test_a_product_option_selects_the_product_recipe():
    model = make_model("mamba")
    ids = torch.randint(3, 60, (1, 7), generator=torch.Generator().manual_seed(1))
    method = mc.MambaAttribution(model)
    for options in ({"formulation": "hidden"}, {"gradient_rule": "residual"}, {"start_layer": 1},
                    {"normalise": "row_sum"}, {"components": ("s6",)}, {"reduce": "sum", "gradient_rule": "residual"}):
        assert method.resolve_recipe(**options) == "product", options
        assert torch.equal(method.attribute(ids, target=TARGET, **options),
                           method.attribute(ids, target=TARGET, recipe="product", **options)), options
    assert not torch.allclose(method.attribute(ids, target=TARGET),
                              method.attribute(ids, target=TARGET, recipe="product"))
    with pytest.raises(ValueError, match="formulation, start_layer apply to the product recipe"):
        method.attribute(ids, target=TARGET, recipe="relevance", formulation="hidden", start_layer=1)
    with pytest.raises(ValueError, match="recipe='best'; choose one of"):
        method.attribute(ids, target=TARGET, recipe="best")
    with pytest.raises(TypeError, match="resolve_recipe"):
        method.resolve_recipe(spread="exact")


def test_a_model_without_rules_gets_the_product_recipe_and_relevance_is_refused_by_name():
    from fla_models import common_config, fla_models

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(fla_models.HGRNConfig(**common_config())).eval()  # no LRP rules
    ids = torch.randint(3, 60, (1, 7), generator=torch.Generator().manual_seed(2))
    method = mc.MambaAttribution(model)
    assert method.resolve_recipe() == "product"
    assert torch.equal(method.attribute(ids, target=TARGET), method.attribute(ids, target=TARGET, recipe="product"))
    with pytest.raises(NotImplementedError, match="recipe='relevance' needs MambaLRP's rules: .*HGRN"):
        method.attribute(ids, target=TARGET, recipe="relevance")


def test_a_base_model_with_a_custom_head_and_an_image_model_get_the_product_recipe():
    torch.manual_seed(0)
    base = tf.MambaModel(CONFIGS["mamba"]()).eval()
    head = torch.nn.Linear(32, 4)
    method = mc.MambaAttribution(base, forward_func=lambda ids: head(base(ids).last_hidden_state[:, -1]))
    assert method.resolve_recipe() == "product"
    assert method.attribute(torch.randint(3, 60, (2, 6)), target=1).shape == (2, 6)
    vim = mc.MambaAttribution(make_vim())
    assert vim.resolve_recipe() == "product"
    assert vim.attribute(torch.randn(1, 3, 32, 32), target=1).shape == (1, 1, 32, 32)


def test_generation_rows_are_each_tokens_relevance():
    model = make_model("mamba")
    prompt = torch.randint(3, 60, (1, 5), generator=torch.Generator().manual_seed(3))
    target = [7, 9, 11]
    result = mc.MambaAttribution(model).attribute_generation(prompt, target=target)
    full = torch.cat([prompt, torch.tensor([target])], 1)
    for t in range(3):
        expected = mc.MambaLRP(model).attribute(full[:, :5 + t], target=target[t])[0, :5].abs()
        assert torch.allclose(result.token_attr[t], expected, rtol=1e-5, atol=1e-7)
        probability = model(full[:, :5 + t]).logits[0, -1].softmax(-1)[target[t]]
        assert torch.isclose(result.output_probs[t], probability, rtol=1e-4)


def test_explain_names_the_recipe_and_the_report_its_scale():
    from mamba_captum.explain import explain_ids
    from mamba_captum.html_report import reading_notes

    model = make_model("mamba")
    items = explain_ids(model, None, [torch.randint(3, 60, (1, 6))], target=TARGET, layer_maps=False)
    assert list(items[0].relevance)[0] == "attribution" and items[0].settings["attribution_recipe"] == "relevance"
    notes = " ".join(reading_notes(items))
    assert "attribution is the magnitude of MambaLRP's relevance" in notes and "attribution is a share" not in notes
