"""The ``mamba-captum`` command (demo, explain, matrices), the explain layer under it and the HTML report."""
import json
import struct
import subprocess
import sys
import zlib

import pytest
import torch
import transformers as tf

import mamba_captum as mc
from mamba_captum import cli
from mamba_captum.demo import DEMO_TEXTS, grammar, model_dir
from mamba_captum.demo.train import accuracy, build_tokenizer
from mamba_captum.explain import Explanation, explain, load
from mamba_captum.html_report import captum_colour, map_png, map_rgb, png_bytes, render_html

DEMO = str(model_dir())


@pytest.fixture(scope="module")
def demo():
    return load(DEMO)


def run_cli(*args, cwd=None):
    """The console entry point in a subprocess: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "mamba_captum.cli", *args], capture_output=True, text=True, cwd=cwd)
    return done.returncode, done.stdout, done.stderr


def read_png(data: bytes) -> torch.Tensor:
    """A minimal decoder for the files png_bytes writes (8-bit RGB, filter 0): (H, W, 3) uint8."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, {}
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[r * (3 * width + 1):(r + 1) * (3 * width + 1)] for r in range(height)]
    assert all(row[0] == 0 for row in rows)
    return torch.tensor([list(row[1:]) for row in rows], dtype=torch.uint8).reshape(height, width, 3)


# -- the bundled demo model ----------------------------------------------------------------------------------------
def test_demo_model_is_the_trained_sentiment_reader(demo):
    model, tokenizer = demo
    record = json.loads((model_dir() / "training.json").read_text())
    assert record["held_out_accuracy"] == 1.0
    assert accuracy(model, tokenizer, grammar.sentences(300, seed=123)) == 1.0
    assert tokenizer.convert_ids_to_tokens(tokenizer("the plot was not good")["input_ids"]) == \
        ["the", "plot", "was", "not", "good", "[SENTIMENT]"]
    assert tokenizer.get_vocab() == build_tokenizer().get_vocab()  # the shipped tokenizer is the script's
    assert model.config.label_words == ["negative", "positive"]
    assert sum(p.numel() for p in model.parameters()) * 4 < 1_000_000


def test_grammar_labels_follow_negation_and_but():
    for sentence in grammar.sentences(400, seed=7):
        deciding = [w for w, d in zip(sentence.words, sentence.deciding) if d]
        adjective = deciding[-1]
        negated = len(deciding) == 2
        assert deciding[:-1] == [] or deciding[0] in grammar.NEGATORS
        assert sentence.label == int((adjective in grammar.POSITIVE) != negated)
        if "but" in sentence.words:  # the deciding words come after "but"
            assert sentence.deciding.index(True) > sentence.words.index("but")


# -- explain -------------------------------------------------------------------------------------------------------
def test_explain_equals_the_methods_called_directly(demo):
    model, tokenizer = demo
    (item,) = explain(model, tokenizer, "the food is never bad , i think", target="negative")
    ids = tokenizer("the food is never bad , i think", return_tensors="pt")["input_ids"]
    negative = tokenizer.convert_tokens_to_ids("negative")
    expected = mc.MambaAttribution(model).attribute(ids, target=negative)[0]
    assert torch.allclose(torch.tensor(item.relevance["attribution"]), expected, atol=1e-6)
    assert torch.allclose(torch.tensor(item.relevance["rollout"]), mc.MambaRollout(model).attribute(ids)[0],
                          atol=1e-6)
    assert torch.allclose(torch.tensor(item.relevance["raw"]), mc.MambaRawAttention(model).attribute(ids)[0],
                          atol=1e-6)
    maps = mc.implicit_attention(model, ids)
    assert set(item.layer_maps) == set(maps)
    assert all(torch.allclose(item.layer_maps[k], maps[k][0]) for k in maps)
    # prediction over the two label words; the explained target is the one asked for
    assert (item.prediction, item.target) == ("positive", "negative")
    assert item.probability + item.target_probability == pytest.approx(1.0, abs=1e-6)
    assert item.tokens[-1] == "[SENTIMENT]"
    json.dumps(item.to_dict())  # JSON-safe


def test_explain_ids_cuts_padding_and_matches_texts(demo):
    model, tokenizer = demo
    texts = ["the plot was not good", "honestly , the music was dull but the acting was great !"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)  # left padding
    from mamba_captum.explain import explain_ids
    from_ids = explain_ids(model, tokenizer, (batch["input_ids"], batch["attention_mask"]), layer_maps=False)
    from_texts = explain(model, tokenizer, texts, layer_maps=False)
    for a, b in zip(from_ids, from_texts):
        assert a.tokens == b.tokens
        for name in a.relevance:
            assert torch.allclose(torch.tensor(a.relevance[name]), torch.tensor(b.relevance[name]), atol=1e-6)


def test_dtypes_give_the_same_explanation(demo):
    model, tokenizer = demo
    (single,) = explain(model, tokenizer, "the service was truly awful .", layer_maps=False)
    double_model, _ = load(DEMO, dtype="float64")
    (double,) = explain(double_model, tokenizer, "the service was truly awful .", layer_maps=False)
    assert next(double_model.parameters()).dtype == torch.float64
    for name in single.relevance:
        assert torch.allclose(torch.tensor(double.relevance[name]), torch.tensor(single.relevance[name]), atol=1e-4)


def test_byte_level_tokens_are_shown_as_text():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mamba_captum.explain import readable_tokens

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["the plot was not good\nthe cast was great"] * 20, trainer)
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=backend)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("the plot was\ngood")["input_ids"])
    assert tokens[:3] == ["the", "Ġplot", "Ġwas"] and "Ċ" in tokens
    assert readable_tokens(tokenizer, tokens) == [t.replace("Ġ", "") for t in tokens]  # "Ċ" (a newline) stays
    assert readable_tokens(build_tokenizer(), ["the", "[SENTIMENT]"]) == ["the", "[SENTIMENT]"]


def test_explain_leaves_the_model_as_it_was(demo):
    model, tokenizer = demo
    state = {k: v.clone() for k, v in model.state_dict().items()}
    explain(model, tokenizer, "the cast was great")
    assert not model.training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


# -- the HTML report and the PNG maps ------------------------------------------------------------------------------
def test_captum_colours_are_captums():
    from captum.attr._utils.visualization import _get_color

    for score in torch.linspace(-1.5, 1.5, 61).tolist():
        assert captum_colour(score) == _get_color(score)


def test_png_round_trip_and_map_colours():
    matrix = torch.tensor([[2.0, 0.0], [-1.0, 0.5]])
    rgb = map_rgb(matrix)
    assert rgb.tolist() == [[[255, 0, 0], [255, 255, 255]], [[128, 128, 255], [255, 191, 191]]]
    assert torch.equal(read_png(png_bytes(rgb)), rgb)
    big = read_png(map_png(matrix, scale=3))
    assert big.shape == (6, 6, 3) and torch.equal(big[::3, ::3], rgb)


def test_report_is_self_contained_and_escapes_tokens():
    item = Explanation(text="a <b> & c", tokens=["a", "<b>", "&", "c"], prediction="x", probability=0.75,
                       target="x", target_probability=0.75, relevance={"attribution": [0.1, -0.4, 0.0, 0.2]},
                       layer_maps={0: torch.eye(4)}, settings={"model": "m"})
    page = render_html([item])
    assert "&lt;b&gt;" in page and "<b>" not in page.split("<body>")[1].replace("<b>x</b>", "")
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert page.count("data:image/png;base64,") == 1
    # each token's mark: its colour (scores scaled by the largest |score|, 0.4) and its raw score on hover
    for token, raw, unit in (("a", 0.1, 0.25), ("&lt;b&gt;", -0.4, -1.0), ("&amp;", 0.0, 0.0), ("c", 0.2, 0.5)):
        assert f'style="background-color: {captum_colour(unit)}" title="{raw:.4g}">{token}</mark>' in page


# -- the command ---------------------------------------------------------------------------------------------------
def test_demo_command_prints_top_tokens_and_writes_the_report(tmp_path):
    code, out, err = run_cli("demo", "--out", str(tmp_path / "demo.html"))
    assert code == 0, err
    for text in DEMO_TEXTS:
        assert repr(text) in out
    assert out.count("attribution:") == len(DEMO_TEXTS) and out.count("rollout:") == len(DEMO_TEXTS)
    page = (tmp_path / "demo.html").read_text()
    assert page.count("<section class='example'>") == len(DEMO_TEXTS)
    assert page.count("<img ") == 2 * len(DEMO_TEXTS)  # two layers each
    assert "[SENTIMENT]" in page and "Traceback" not in err


def test_explain_command_text_and_dataset(tmp_path):
    code, out, err = run_cli("explain", "--model", DEMO, "--text", "the plot was not good", "--target", "positive",
                             "--method", "attribution", "--jsonl", str(tmp_path / "one.jsonl"))
    assert code == 0, err
    assert "negative (p = " in out and "explained: positive" in out and "rollout" not in out
    (row,) = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert list(row["relevance"]) == ["attribution"] and row["target"] == "positive"

    dataset = tmp_path / "texts.jsonl"
    dataset.write_text("\n".join(json.dumps({"text": s.text}) for s in grammar.sentences(3, seed=1)) + "\n"
                       + json.dumps({"text": "the cast was great", "target": "negative"}) + "\n")
    code, out, err = run_cli("explain", "--model", DEMO, "--dataset", str(dataset), "--out", str(tmp_path / "r.html"))
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "texts.explained.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and rows[-1]["target"] == "negative" and rows[-1]["prediction"] == "positive"
    assert "explaining: 100%" in err  # tqdm's bar
    assert (tmp_path / "r.html").read_text().count("<section class='example'>") == 4


def test_dataset_rows_are_checked_before_any_work_and_null_targets_fall_back(tmp_path):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"text": "the plot was good"}\n\n{"text": "the cast", "target": "wonderful"}\n')
    code, out, err = run_cli("explain", "--model", DEMO, "--dataset", str(dataset))
    assert code == 2 and f"{dataset}:3: target 'wonderful' is not one of the model's label words" in err
    assert "explaining" not in err and not (tmp_path / "rows.explained.jsonl").read_text()
    dataset.write_text('{"text": "the plot was good", "target": null}\n')
    code, out, err = run_cli("explain", "--model", DEMO, "--dataset", str(dataset), "--target", "negative",
                             "--method", "raw")
    assert code == 0, err
    (row,) = [json.loads(line) for line in (tmp_path / "rows.explained.jsonl").read_text().splitlines()]
    assert row["target"] == "negative"


def test_target_forms(demo):
    from mamba_captum.explain import UsageError, resolve_target

    model, tokenizer = demo
    words = ["negative", "positive"]
    negative = tokenizer.convert_tokens_to_ids("negative")
    assert resolve_target(model, tokenizer, "negative", words) == negative
    assert resolve_target(model, tokenizer, negative, words) == negative
    assert resolve_target(model, tokenizer, str(negative), words) == negative
    assert resolve_target(model, tokenizer, "film", None) == tokenizer.convert_tokens_to_ids("film")
    for bad in (True, 1.5, [1]):
        with pytest.raises(UsageError, match="must be a label word / token or an integer id"):
            resolve_target(model, tokenizer, bad, words)


def test_matrices_command_writes_one_png_per_layer(tmp_path):
    code, out, err = run_cli("matrices", "--model", DEMO, "--text", "the plot was good", "--out-dir",
                             str(tmp_path / "maps"), "--scale", "2")
    assert code == 0, err
    pngs = sorted((tmp_path / "maps").glob("*.png"))
    assert [p.name for p in pngs] == ["layer_00.png", "layer_01.png"]
    assert read_png(pngs[0].read_bytes()).shape == (10, 10, 3)  # 5 tokens, 2 px each
    assert json.loads((tmp_path / "maps" / "tokens.json").read_text())[-1] == "[SENTIMENT]"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A checkpoint of a model family the library does not explain (GPT-2), with the demo tokenizer."""
    path = tmp_path_factory.mktemp("gpt2")
    config = tf.GPT2Config(vocab_size=80, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    tf.GPT2LMHeadModel(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("args, message", [
    (["explain", "--model", "/no/such/dir", "--text", "x"], "does not exist"),
    (["explain", "--model", "{gpt2}", "--text", "the plot"], "model type 'gpt2' has no token mixer"),
    (["explain", "--model", DEMO, "--text", "good " * 70], "the model allows at most 64"),
    (["explain", "--model", DEMO, "--text", "the plot", "--target", "wonderful"], "not one of the model's label"),
    (["explain", "--model", DEMO, "--text", "the plot", "--target", "4096"], "outside the vocabulary"),
    (["explain", "--model", DEMO, "--text", "the plot", "--target", "zebra crossing", "--labels", "zebra crossing"],
     "not one token of the vocabulary"),
    (["explain", "--model", DEMO, "--dataset", "/no/file.jsonl"], "does not exist"),
    (["matrices", "--model", DEMO, "--text", "x", "--dtype", "float8"], "invalid choice"),
    (["explain", "--model", DEMO, "--text", "x", "--device", "warp9"], "device 'warp9' is not available"),
    (["explain", "--model", DEMO, "--text", "the plot", "--target", "1"], "target id 1 is not one of the model's"),
    (["explain", "--model", DEMO, "--text", "x", "--labels", "Negative", "negative"], "repeated token ids"),
    (["demo", "--out", "/proc/no/report.html"], "cannot write '/proc/no/report.html'"),
    (["explain", "--model", DEMO, "--text", "x", "--out", "/tmp"], "'/tmp' is a directory"),
    (["matrices", "--model", DEMO, "--text", "x", "--out-dir", "/proc/no"], "cannot write into '/proc/no'"),
    (["explain", "--model", "{weightless}", "--text", "x"], "the weights in"),
    (["explain", "--model", "{badconfig}", "--text", "x"], "the config.json in"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, gpt2_dir, tmp_path):
    weightless, badconfig = tmp_path / "weightless", tmp_path / "badconfig"
    weightless.mkdir()
    badconfig.mkdir()
    (weightless / "config.json").write_text((model_dir() / "config.json").read_text())
    (badconfig / "config.json").write_text('{"model_type": "no_such_model"')
    places = {"{gpt2}": str(gpt2_dir), "{weightless}": str(weightless), "{badconfig}": str(badconfig)}
    args = [places.get(a, a) for a in args]
    code, out, err = run_cli(*args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage:")
             and not line.startswith(" ")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err


def test_unsupported_causal_lm_is_named(gpt2_dir):
    from mamba_captum.explain import UsageError, check_supported

    model = tf.AutoModelForCausalLM.from_pretrained(gpt2_dir)
    with pytest.raises(UsageError, match="model type 'gpt2' has no token mixer"):
        check_supported(model)


def test_sequence_classifier_targets_are_labels(tmp_path):
    from tiny_models import make_model
    from mamba_captum.explain import UsageError

    causal = make_model("jamba")
    model = tf.JambaForSequenceClassification(causal.config.__class__(**{**causal.config.to_dict(), "num_labels": 3,
                                                                        "id2label": {0: "a", 1: "b", 2: "c"}}))
    model.eval()
    ids = torch.randint(3, 60, (1, 7))
    (item,) = mc.explain.explain_ids(model, None, [ids], target="b", methods=("attribution",), layer_maps=False)
    assert item.target == "b" and item.prediction in ("a", "b", "c")
    assert torch.allclose(torch.tensor(item.relevance["attribution"]),
                          mc.MambaAttribution(model).attribute(ids, target=1)[0], atol=1e-6)
    with pytest.raises(UsageError, match="target 'd' is not a label of this model"):
        mc.explain.explain_ids(model, None, [ids], target="d")
    with pytest.raises(UsageError, match="target class 5 is outside the model's 3 labels"):
        mc.explain.explain_ids(model, None, [ids], target=5)
    # labels that look like numbers are labels first: "3" is the class named "3" (index 0), not class 3
    (item,) = mc.explain.explain_ids(model, None, [ids], target="3", labels=["3", "1", "2"], methods=(),
                                     layer_maps=False)
    assert item.target == "3"
    assert item.target_probability == pytest.approx(torch.softmax(model(ids).logits[0], -1)[0].item(), rel=1e-5)
    with pytest.raises(UsageError, match="2 labels given for a classifier with 3 classes"):
        mc.explain.explain_ids(model, None, [ids], labels=["a", "b"])


def test_help_lists_the_commands(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """A tiny JambaForSequenceClassification checkpoint (3 labels) with the demo tokenizer."""
    from tiny_models import make_model

    path = tmp_path_factory.mktemp("classifier")
    config = make_model("jamba").config.to_dict()
    config.update(vocab_size=80, num_labels=3, id2label={0: "sport", 1: "tech", 2: "arts"},
                  label2id={"sport": 0, "tech": 1, "arts": 2})
    torch.manual_seed(0)
    tf.JambaForSequenceClassification(tf.JambaConfig(**config)).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def test_explain_a_sequence_classifier_checkpoint(classifier_dir, tmp_path):
    code, out, err = run_cli("explain", "--model", str(classifier_dir), "--text", "the plot was good",
                             "--target", "tech", "--jsonl", str(tmp_path / "r.jsonl"))
    assert code == 0, err
    (row,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert row["target"] == "tech" and row["prediction"] in ("sport", "tech", "arts")
    assert row["settings"]["model_class"] == "JambaForSequenceClassification"
    assert sum(1 for _ in row["relevance"]) == 3
    code, out, err = run_cli("explain", "--model", str(classifier_dir), "--text", "the plot", "--target", "music")
    assert code == 2 and "target 'music' is not a label of this model; its labels are ['sport', 'tech', 'arts']" \
        in err and "Traceback" not in err
