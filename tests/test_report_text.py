"""What the HTML report says in words (issue 33): probabilities as the CLI prints them ("p > 0.999", never
"p = 1.000"), paragraphs on what p, the query token and each method's numbers are, the notes a caller passes, and
the words of a text that became the tokenizer's unknown token."""
import html
import json
import re
import types
import warnings

import pytest
import torch

from mamba_captum import cli
from mamba_captum.demo import model_dir
from mamba_captum.explain import Explanation, explain
from mamba_captum.html_report import probability_text, reading_notes, render_html, render_image_html, \
    unknown_words_note
from mamba_captum.tokens import UnknownTokenWarning

DEMO = str(model_dir())
# the report's own paragraphs for the demo model (every method, label words "negative" / "positive")
DEMO_READING = [
    "p is the probability of the predicted label (and of the explained one, when another was asked for): the softmax "
    "of the next-token scores at the query over the label words only ('negative', 'positive'). \"p > 0.999\" (or "
    "\"p < 0.001\") means saturated: the probability rounds to 1 (or 0) at three decimals, as it often does for a "
    "trained model on a text it has learnt; it says which label, not how sure a person would be (the methods read "
    "the model's scores, not p).",
    "The query is the last token of each text (here [SENTIMENT]): this causal LM's next-token scores there are its "
    "answer, so every method explains that position, and the query itself gets a score too.",
    "The methods' numbers (hover a token to read its score): raw is the query's row of the implicit attention, "
    "averaged over the layers (the model's own mixing weights, signed); attribution is the magnitude of MambaLRP's "
    "relevance, in logit units (>= 0; MambaAttribution's default recipe on this model); rollout and selection are "
    "shares (each text's scores are >= 0 and sum to 1); lrp is in logit units (its scores, signed, sum to the "
    "explained logit less the biases' share, so they are often much larger than the shares).",
]
PIZZA_NOTE = ("1 word not in the tokenizer's vocabulary became [UNK]: 'pizza'; the model saw, and the methods "
              "score, [UNK] in its place.")


def reading(page: str) -> list[str]:
    """The plain text of the paragraphs of the report's reading notes."""
    (block,) = re.findall(r"<div class='reading'>(.*?)</div>", page, re.S)
    return [html.unescape(text) for text in re.findall(r"<p>(.*?)</p>", block, re.S)]


def run_cli(capsys, *args) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownTokenWarning)
        assert cli.main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def test_probability_text_in_the_report_layer():
    assert [probability_text(p) for p in (0.87349, 0.9994, 0.9995, 1.0, 0.0005, 0.0004999, 0.0)] == \
        ["p = 0.873", "p = 0.999", "p > 0.999", "p > 0.999", "p = 0.001", "p < 0.001", "p < 0.001"]


def test_the_demo_report_says_saturated_and_explains_its_numbers(capsys, tmp_path):
    out = tmp_path / "demo.html"
    run_cli(capsys, "demo", "--out", out)
    page = out.read_text(encoding="utf-8")
    assert "p = 1.000" not in page
    assert page.count("(p &gt; 0.999)") == 10  # 5 texts × predicted and explained, each saturated
    assert reading(page) == DEMO_READING


def test_a_report_names_the_words_that_became_unknown(capsys, tmp_path):
    out = tmp_path / "report.html"
    run_cli(capsys, "explain", "--model", DEMO, "--text", "the pizza was great", "--text", "the plot was great",
            "--method", "attribution", "--out", out)
    page = out.read_text(encoding="utf-8")
    first, second = page.split("<section class='example'>")[1:]
    assert first.startswith("<h2>1. the pizza was great</h2>"
                            f"<p class='note unknown'>{html.escape(PIZZA_NOTE)}</p><p>Prediction:")
    assert "class='note unknown'" not in second  # every word of it is known
    assert "&#x27;pizza&#x27;" in first and reading(page)[2] == (
        "The methods' numbers (hover a token to read its score): attribution is the magnitude of MambaLRP's "
        "relevance, in logit units (>= 0; MambaAttribution's default recipe on this model).")


@pytest.fixture(scope="module")
def pizza():
    from mamba_captum.demo import load_demo

    model, tokenizer = load_demo()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownTokenWarning)
        return explain(model, tokenizer, ["The pizza was absolutely wonderful", "the plot was great"],
                       methods="rollout", layer_maps=False)


def test_explanation_keeps_the_unknown_words_through_json(pizza):
    unknown, known = pizza
    assert (unknown.unknown_words, unknown.unknown_token) == (["pizza", "absolutely"], "[UNK]")
    assert (known.unknown_words, known.unknown_token) == ([], None)
    row = json.loads(json.dumps(unknown.to_dict()))
    assert (row["unknown_words"], row["unknown_token"]) == (["pizza", "absolutely"], "[UNK]")
    again = Explanation.from_dict(row)
    assert (again.unknown_words, again.unknown_token) == (["pizza", "absolutely"], "[UNK]")
    assert unknown_words_note(again) == ("2 words not in the tokenizer's vocabulary became [UNK]: 'pizza', "
                                         "'absolutely'; the model saw, and the methods score, [UNK] in their place.")


def test_an_older_dict_without_the_unknown_words_loads(pizza):
    row = pizza[0].to_dict()
    del row["unknown_words"], row["unknown_token"]
    old = Explanation.from_dict(row)
    assert (old.unknown_words, old.unknown_token) == ([], None)
    assert unknown_words_note(old) is None and "class='note unknown'" not in render_html([old])


def example(**fields):
    values = dict(text="a b", tokens=["a", "b"], prediction="x", probability=0.99999, target="y",
                  target_probability=0.00001, relevance={"raw": [0.5, -0.5]})
    return Explanation(**{**values, **fields})


def test_notes_are_escaped_paragraphs_before_the_reading():
    page = render_html([example()], notes="first <b> line\nwraps\n\nsecond")
    assert "<p class='preamble'>first &lt;b&gt; line wraps</p>\n<p class='preamble'>second</p>" in page
    assert page.index("class='preamble'") < page.index("<div class='reading'>") < page.index("class='legend'")
    assert render_html([example()], notes=["one", "two"]).count("class='preamble'") == 2
    assert "class='preamble'" not in render_html([example()])
    assert "Prediction: <b>x</b> (p &gt; 0.999); explained: <b>y</b> (p &lt; 0.001)." in page


def test_what_p_is_follows_the_model_and_its_labels():
    classifier = example(settings={"model_class": "MambaForSequenceClassification", "labels": ["neg", "pos"]},
                         tokens=["a", "</s>"])
    whole = example(settings={"model_class": "MambaForCausalLM", "labels": None})
    first = [reading_notes([item])[0].split(". \"p > 0.999\"")[0] for item in (classifier, whole, example())]
    assert first == [
        "p is the probability of the predicted label (and of the explained one, when another was asked for): "
        "the softmax of the classifier's scores over its classes (neg, pos)",
        "p is the probability of the predicted label (and of the explained one, when another was asked for): "
        "the softmax of the next-token scores at the query over the whole vocabulary",
        "p is the probability of the predicted label (and of the explained one, when another was asked for): "
        "the softmax of the model's scores over its possible answers"]
    assert reading_notes([classifier])[1] == ("The query is the last token of each text (here </s>): the position "
                                              "whose output every method explains.")


def test_unknown_words_without_offsets_and_repeated():
    assert unknown_words_note(types.SimpleNamespace(unknown_words=[None, None], unknown_token="<unk>")) == (
        "2 words not in the tokenizer's vocabulary became <unk> (this tokenizer gives no offsets to name them); "
        "the model saw, and the methods score, <unk> in their place.")
    assert unknown_words_note(types.SimpleNamespace(unknown_words=["pizza", "kale", "pizza"],
                                                    unknown_token="[UNK]")).startswith(
        "3 words not in the tokenizer's vocabulary became [UNK]: 'pizza' ×2, 'kale'; ")


def test_the_image_report_says_saturated():
    image = types.SimpleNamespace(path="a.png", image=torch.zeros(2, 2, 3), relevance={"raw": torch.ones(2, 2)},
                                  prediction="cat", probability=0.99999, target="cat", target_probability=0.99999,
                                  settings={})
    page = render_image_html([image])
    assert "p = 1.000" not in page and page.count("(p &gt; 0.999)") == 2
    assert reading(page) == ["p is the probability of the predicted class (and of the explained one, when another "
                             "was asked for): the softmax of the model's scores over its classes. " +
                             DEMO_READING[0].split("). ", 1)[1]]


def test_the_demo_report_tells_the_models_story(tmp_path):
    from mamba_captum.cli import main

    assert main(["demo", "--out", str(tmp_path / "demo.html")]) == 0
    page = (tmp_path / "demo.html").read_text()
    assert "<p class='preamble'>The bundled demo model: a 2-layer Mamba trained on a sentiment grammar" in page
    assert "p says which label, not how sure a person would be." in page
