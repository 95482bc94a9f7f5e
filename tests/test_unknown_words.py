"""Words the tokenizer does not know (issue 33): named in an UnknownTokenWarning wherever the library tokenizes a
text, one plain line in the command's stderr, and refused in a generation target."""
import types
import warnings

import pytest
import torch
import transformers as tf
from captum.attr import TextTokenInput
from test_cli import run_main
from tiny_models import make_model

import mamba_captum as mc
from mamba_captum.demo import model_dir
from mamba_captum.explain import encode_text, explain, load
from mamba_captum.tokens import unknown_positions, unknown_words

DEMO = str(model_dir())
PIZZA = "The pizza was absolutely wonderful"
PIZZA_WARNING = ("mamba_captum: in the text 'The pizza was absolutely wonderful', 2 words are not in the tokenizer's "
                 "vocabulary and became its unknown token '[UNK]': 'pizza', 'absolutely'; the explanation treats them "
                 "as one unknown word each (use words of the vocabulary, or a tokenizer that covers them).")


@pytest.fixture(scope="module")
def demo():
    return load(DEMO)


@pytest.fixture(scope="module")
def byte_level():
    """A byte-level BPE tokenizer (GPT-2's kind, 300 tokens): it spells any text, so it has no unknown words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    backend.train_from_iterator(["the plot was not good\nthe cast was great"] * 20, trainer)
    # as GPT-2's: its "unknown" token is the end of text, which a byte-level model never produces for a word
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>",
                                      bos_token="<|endoftext|>", eos_token="<|endoftext|>")


class NoOffsets:
    """A tokenizer without offsets (as transformers' Python tokenizers): the demo tokenizer, offsets refused."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.unk_token, self.unk_token_id = tokenizer.unk_token, tokenizer.unk_token_id

    def __call__(self, text, **kwargs):
        if kwargs.pop("return_offsets_mapping", False):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self.inner(text, **kwargs)


def unknown_token_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, mc.UnknownTokenWarning)]


def test_the_helper_names_the_words_as_written(demo):
    _, tokenizer = demo
    assert unknown_words(tokenizer, PIZZA) == ["pizza", "absolutely"]
    assert unknown_words(tokenizer, "PIZZA, pizza and the plot") == ["PIZZA", "pizza", "and"]
    assert unknown_words(tokenizer, "the plot was good") == []
    assert unknown_words(tokenizer, "the [UNK] was good") == []  # the unknown token written out is no word
    ids = tokenizer(PIZZA)["input_ids"]
    assert unknown_positions(tokenizer, ids) == [1, 3] == unknown_positions(tokenizer, torch.tensor([ids]))
    assert unknown_words(NoOffsets(tokenizer), PIZZA) == [None, None]  # counted, not named


def test_explain_warns_with_the_words(demo):
    model, tokenizer = demo
    with pytest.warns(mc.UnknownTokenWarning) as caught:
        (item,) = explain(model, tokenizer, PIZZA, methods=("attribution",), layer_maps=False)
    assert unknown_token_warnings(caught) == [PIZZA_WARNING]
    assert item.tokens[:4] == ["the", "[UNK]", "was", "[UNK]"]  # explained all the same
    with pytest.warns(mc.UnknownTokenWarning, match="1 word is not in .* unknown token '\\[UNK\\]' \\(this "
                                                    "tokenizer gives no offsets to name them\\); the explanation "
                                                    "treats it as one unknown word"):
        encode_text(model, NoOffsets(tokenizer), "the pizza")


def test_known_words_give_no_warning(demo):
    model, tokenizer = demo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain(model, tokenizer, "the plot was not good", methods=("attribution",), layer_maps=False)
        mc.MambaAttribution(model).attribute_generation(TextTokenInput("the plot was", tokenizer), target="good")


def test_attribute_generation_names_the_unknown_prompt_tokens(demo):
    model, tokenizer = demo
    explainer = mc.MambaAttribution(model)
    inp = TextTokenInput("The capital of France is", tokenizer)
    with pytest.warns(mc.UnknownTokenWarning) as caught:
        result = explainer.attribute_generation(inp, target="good")
    # a TextTokenInput keeps no text: the positions of the unknown token are named
    assert unknown_token_warnings(caught) == [
        "mamba_captum: the prompt has 3 unknown tokens '[UNK]' (positions 1, 2, 3 of 6): words not in the "
        "tokenizer's vocabulary became them, and the explanation treats each as one unknown word (use words of the "
        "vocabulary, or a tokenizer that covers them)."]
    assert caught[0].filename == __file__  # the line of the call, not the library's
    assert result.input_tokens == ["the", "[UNK]", "[UNK]", "[UNK]", "is", "[SENTIMENT]"]
    with pytest.warns(mc.UnknownTokenWarning, match="the prompt has 1 unknown token '\\[UNK\\]' \\(position 1 of"):
        explainer.attribute_generation(tokenizer("the pizza", return_tensors="pt")["input_ids"], target="good",
                                       tokenizer=tokenizer)
    with warnings.catch_warnings():  # prompt ids without a tokenizer: nothing to tell the unknown token by
        warnings.simplefilter("error")
        explainer.attribute_generation(tokenizer("the pizza", return_tensors="pt")["input_ids"], target=[5])


def test_a_generation_target_with_an_unknown_word_is_refused(demo):
    model, tokenizer = demo
    explainer = mc.MambaAttribution(model)
    with pytest.raises(ValueError) as refused:
        explainer.attribute_generation(TextTokenInput("the plot was", tokenizer), target=" Paris")
    assert str(refused.value) == (
        "mamba_captum: the target ' Paris' is not in the tokenizer's vocabulary: it tokenizes to ['[UNK]'], with the "
        "unknown token '[UNK]', standing for 'Paris'; give a target of words in the vocabulary, or its token ids "
        "(target=[...]).")
    with pytest.raises(ValueError, match="the target 'good pizza' .* \\['good', '\\[UNK\\]'\\], .* for 'pizza'"):
        explainer.attribute_generation(TextTokenInput("the plot was", tokenizer), target="good pizza")
    # several known tokens are a target sequence (Captum's semantics), not refused
    result = explainer.attribute_generation(TextTokenInput("the plot was", tokenizer), target="good but")
    assert result.output_tokens == ["good", "but"]
    # the unknown token spelled out is a token like any other, as for the CLI's --target
    result = explainer.attribute_generation(TextTokenInput("the plot was", tokenizer), target="[UNK]")
    assert result.output_tokens == ["[UNK]"]


def test_a_word_target_in_attribute_names_the_fix(demo):
    model, tokenizer = demo
    ids = tokenizer(["the plot was not good"], return_tensors="pt")["input_ids"]
    for method in (mc.MambaAttribution(model), mc.MambaLRP(model)):
        with pytest.raises(TypeError, match=r"target='negative' is a string; .* pass "
                                            r"target=tokenizer.convert_tokens_to_ids\('negative'\)"):
            method.attribute(ids, target="negative")


def test_the_command_warns_in_one_line_per_text_and_restores_the_filters(capsys, tmp_path):
    filters, show = list(warnings.filters), warnings.showwarning
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--text", PIZZA, "--text", "the plot was good",
                              "--text", PIZZA, "--method", "attribution")
    assert code == 0
    assert err.splitlines() == ["mamba-captum explain: warning: " + PIZZA_WARNING.removeprefix("mamba_captum: ")]
    assert out.count(": positive (p ") == 3  # all three explained
    assert warnings.filters == filters and warnings.showwarning is show
    # a dataset: each text is checked before the work and explained again, and named once
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text('{"text": "the pizza"}\n{"text": "the plot"}\n{"text": "the pizza"}\n')
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--dataset", dataset, "--method", "attribution")
    assert code == 0
    assert [line for line in err.splitlines() if "warning" in line] == [
        "mamba-captum explain: warning: in the text 'the pizza', 1 word is not in the tokenizer's vocabulary and "
        "became its unknown token '[UNK]': 'pizza'; the explanation treats it as one unknown word (use words of the "
        "vocabulary, or a tokenizer that covers them)."]
    assert warnings.filters == filters and warnings.showwarning is show


@pytest.mark.parametrize("args", [
    ["explain", "--model", DEMO, "--text", "the pizza", "--labels", "good", "good"],
    ["explain", "--model", DEMO, "--text", "the pizza", "--text", "the plot", "--target", "zebra"],
    ["explain", "--model", DEMO, "--text", "the pizza", "--labels", "Negative", "negative"],  # one id, lowercased
    ["matrices", "--model", DEMO, "--text", "the pizza", "--scale", "2000", "--out-dir", "{tmp}/maps"],
    ["explain", "--model", DEMO, "--dataset", "{tmp}/texts.jsonl"],  # line 2's target is refused
])
def test_a_refused_run_is_one_error_line_without_the_warning(args, capsys, tmp_path):
    (tmp_path / "texts.jsonl").write_text('{"text": "the pizza"}\n{"text": "the plot", "target": "zebra"}\n')
    code, out, err = run_main(capsys, *[str(a).replace("{tmp}", str(tmp_path)) for a in args])
    assert code == 2
    assert len(err.splitlines()) == 1 and ": error: " in err and "warning" not in err, err


def test_a_byte_level_tokenizer_has_no_unknown_words(byte_level):
    text = "Zebras eat pizza 🍕 <|endoftext|>"  # bytes it never saw in training, and its end-of-text token
    assert unknown_words(byte_level, text) == []
    ids = byte_level(text)["input_ids"]
    assert byte_level.unk_token_id in ids and unknown_positions(byte_level, ids) == []
    # each rule alone: a BPE model without an unknown token (whatever the wrapper calls unk_token) ...
    distinct = tf.PreTrainedTokenizerFast(tokenizer_object=byte_level.backend_tokenizer, unk_token="<|endoftext|>")
    assert distinct.eos_token_id is None and unknown_positions(distinct, ids) == []
    # ... and, for a tokenizer without a backend to ask, an unknown token that is also the end of text
    python_gpt2 = types.SimpleNamespace(unk_token="<|endoftext|>", unk_token_id=7, eos_token_id=7, bos_token_id=7)
    assert unknown_positions(python_gpt2, [7, 3, 7]) == []
    model = make_model("mamba", vocab_size=len(byte_level))
    stub = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=len(byte_level)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert encode_text(stub, byte_level, text).shape == (1, len(ids))
        result = mc.MambaAttribution(model).attribute_generation(TextTokenInput(text, byte_level), target=" zebra")
    assert len(result.input_tokens) == len(ids)


def _word_level(**wrapper):
    """A fast word-level tokenizer whose model's unknown token is [UNK] (id 1); ``wrapper``: what the HF wrapper is
    told (nothing, or another unk_token that it then adds as a new token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "the": 2, "was": 3, "good": 4},
                                         unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, **wrapper)


@pytest.mark.parametrize("wrapper", [{}, {"unk_token": "<unk>"}], ids=["no unk_token", "another unk_token"])
def test_the_backend_says_which_token_is_unknown(wrapper):
    """The wrapper's unk_token_id may be None or another (added) token: the model's own [UNK] is what the text
    becomes, so the word is named and a target that reads as it is refused."""
    from mamba_captum.explain.text import UsageError, resolve_target
    from mamba_captum.tokens import unknown_id, unknown_spelling

    tokenizer = _word_level(**wrapper)
    assert tokenizer("the pizza was good")["input_ids"] == [2, 1, 3, 4]
    assert unknown_id(tokenizer) == 1 and unknown_spelling(tokenizer) == "[UNK]"
    assert unknown_words(tokenizer, "the pizza was good") == ["pizza"]
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=len(tokenizer)))
    with pytest.raises(UsageError, match=r"'pizza' is not in the tokenizer's vocabulary \(it reads as the unknown "
                                         r"token '\[UNK\]'\)"):
        resolve_target(model, tokenizer, "pizza", None)
    assert resolve_target(model, tokenizer, "good", None) == 4


def test_a_word_is_named_whole_once_however_many_pieces_are_unknown():
    """Subword vocabularies lack pieces, not words: 'zzz' as three unknown 'z' pieces is one word, and a
    SentencePiece word is named without the space its span starts at."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.BPE({"<unk>": 0, "t": 1, "h": 2, "e": 3, "th": 4, "the": 5},
                                   [("t", "h"), ("th", "e")], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert tokenizer.convert_ids_to_tokens(tokenizer("the zzz the")["input_ids"]) == \
        ["the", "<unk>", "<unk>", "<unk>", "the"]
    assert unknown_words(tokenizer, "the zzz the") == ["zzz"]
    assert unknown_words(tokenizer, "the thx xthe") == ["thx", "xthe"]
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁the", -1.0), ("▁", -2.0), ("t", -3.0)], 0, False))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    sentencepiece = tf.PreTrainedTokenizerFast(tokenizer_object=unigram)  # the wrapper knows no unk_token
    assert unknown_words(sentencepiece, "the burger the") == ["burger"]


def test_the_command_keeps_the_filters_of_modules_it_imported():
    """In a fresh interpreter (here torch is imported already): main() imports torch, whose import registers a
    filter (TracerWarning); that stays after main() returns, while the command's own filter goes."""
    import subprocess
    import sys

    script = """
import warnings
from mamba_captum.cli import main
assert "torch" not in __import__("sys").modules
assert main(["explain", "--model", "demo", "--text", "the pizza was good", "--method", "raw"]) == 0
import torch
from mamba_captum.tokens import UnknownTokenWarning
print(any(f[2] is torch.jit._trace.TracerWarning for f in warnings.filters),
      any(f[2] is UnknownTokenWarning for f in warnings.filters), warnings.showwarning.__module__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "True False warnings"
