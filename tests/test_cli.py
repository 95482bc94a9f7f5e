"""The ``mamba-captum`` command (demo, explain, matrices), the explain layer under it and the HTML report."""
import json
import struct
import subprocess
import sys
import zlib

import pytest
import torch
import transformers as tf
from tiny_models import LINEAR_CONFIGS

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


def run_main(capsys, *args):
    """The command in this process (no interpreter start-up per case): (exit code, stdout, stderr). An exception
    escaping ``main`` (a traceback for a user) fails the calling test."""
    progress_bars = tf.utils.logging.is_progress_bar_enabled()
    try:
        code = cli.main([str(a) for a in args])
    finally:
        if progress_bars:  # main turns HF's progress bars off for the rest of the process
            tf.utils.logging.enable_progress_bar()
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The single error line of stderr (argparse's usage lines aside)."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("usage:")
             and not line.startswith(" ")]
    assert len(lines) == 1, err
    return lines[0]


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


def test_deciding_words_of_a_text_are_the_generated_ones():
    for sentence in grammar.sentences(400, seed=8):  # the parser agrees with the generator on every sentence
        assert grammar.deciding_words(sentence.text) == sentence.deciding
    assert grammar.deciding_words("the movie looked wonderful but the ending was not very good") == [
        False, False, False, False, False, False, False, False, True, False, True]
    with pytest.raises(ValueError, match="no adjective of the demo grammar"):
        grammar.deciding_words("the plot was not")


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
    assert rgb.tolist() == [[[32, 223, 32], [255, 255, 255]], [[242, 166, 166], [201, 247, 201]]]  # Captum's
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
    for method in ("raw", "rollout", "attribution", "selection", "lrp"):
        assert out.count(f" {method}: ") == len(DEMO_TEXTS), method
    assert out.count("deciding: ") == len(DEMO_TEXTS) and "deciding: not, good (by the grammar)" in out
    # the saturated probability is shown as such, and said why, with the query token and LRP's scale
    assert "'the plot was not good': negative (p > 0.999); explained: negative\n" in out and "p = 1.000" not in out
    assert out.startswith("The bundled demo model") and "query token [SENTIMENT]" in out and "logit units" in out
    # the closing count: the deciding words among each method's printed top 3, in method order
    (count,) = [line for line in out.splitlines() if line.startswith("deciding words among each method's top 3")]
    total = sum(sum(grammar.deciding_words(text)) for text in DEMO_TEXTS)
    assert count.startswith(f"deciding words among each method's top 3 ({total} in all): attribution ")
    found = [int(part.split()[-1]) for part in count.split(": ", 1)[1].split(", ")]
    assert len(found) == 5 and all(0 <= n <= total for n in found)
    page = (tmp_path / "demo.html").read_text()
    assert page.count("<section class='example'>") == len(DEMO_TEXTS)
    assert page.count("<img ") == 2 * len(DEMO_TEXTS)  # two layers each
    assert "[SENTIMENT]" in page and "Traceback" not in err


def test_explain_command_text_and_dataset(tmp_path, capsys):
    code, out, err = run_cli("explain", "--model", DEMO, "--text", "the plot was not good", "--target", "positive",
                             "--method", "attribution", "--jsonl", str(tmp_path / "one.jsonl"))
    assert code == 0, err
    assert "negative (p > 0.999); explained: positive (p < 0.001)" in out and "rollout" not in out
    (row,) = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert list(row["relevance"]) == ["attribution"] and row["target"] == "positive"

    dataset = tmp_path / "texts.jsonl"
    dataset.write_text("\n".join(json.dumps({"text": s.text}) for s in grammar.sentences(3, seed=1)) + "\n"
                       + json.dumps({"text": "the cast was great", "target": "negative"}) + "\n")
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--dataset", dataset, "--out", tmp_path / "r.html")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "texts.explained.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and rows[-1]["target"] == "negative" and rows[-1]["prediction"] == "positive"
    assert "explaining: 100%" in err  # tqdm's bar
    assert (tmp_path / "r.html").read_text().count("<section class='example'>") == 4


def test_dataset_rows_are_checked_before_any_work_and_null_targets_fall_back(tmp_path, capsys):
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text('{"text": "the plot was good"}\n\n{"text": "the cast", "target": "wonderful"}\n')
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--dataset", dataset)
    assert code == 2 and f"{dataset}:3: target 'wonderful' is not one of the model's label words" in err
    assert "explaining" not in err and not (tmp_path / "rows.explained.jsonl").exists()  # a refused run writes nothing
    dataset.write_text('{"text": "the plot was good", "target": null}\n')
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--dataset", dataset, "--target", "negative",
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
    # strings str.isdigit() passes but int() refuses are words, not ids (they used to raise ValueError: a traceback)
    for word in ("²", "--5"):
        with pytest.raises(UsageError, match=f"target {word!r} is not one of the model's label words"):
            resolve_target(model, tokenizer, word, words)


def test_matrices_command_writes_one_png_per_layer(tmp_path, capsys):
    code, out, err = run_main(capsys, "matrices", "--model", DEMO, "--text", "the plot was good", "--out-dir",
                              tmp_path / "maps", "--scale", "2")
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


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Copies of the demo checkpoint, each broken in one way a user's download or save can be: name -> folder."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("broken")
    weights = (model_dir() / "model.safetensors").read_bytes()
    config = json.loads((model_dir() / "config.json").read_text())
    tensors = load_file(model_dir() / "model.safetensors")

    def copy(name, config_changes=None, drop=()):
        folder = root / name
        folder.mkdir()
        for file in model_dir().iterdir():
            if file.name not in drop:
                (folder / file.name).write_bytes(file.read_bytes())
        if config_changes is not None:
            (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
        return folder

    copy("truncated").joinpath("model.safetensors").write_bytes(weights[:len(weights) // 2])
    copy("garbage").joinpath("model.safetensors").write_bytes(bytes(range(256)) * 8)
    torch.save(tensors, copy("cut_bin", drop={"model.safetensors"}) / "pytorch_model.bin")
    bin_file = root / "cut_bin" / "pytorch_model.bin"
    bin_file.write_bytes(bin_file.read_bytes()[:len(bin_file.read_bytes()) // 2])
    save_file({k: v for k, v in tensors.items() if k != "backbone.layers.0.mixer.A_log"},
              copy("missing_tensor") / "model.safetensors", metadata={"format": "pt"})
    copy("other_shapes", {"state_size": 16})
    copy("no_tokenizer", drop={"tokenizer.json", "tokenizer_config.json"})
    copy("wrong_field_type", {"hidden_size": "big"})
    copy("no_label_words", {"label_words": None})
    nan = dict(tensors)
    nan["backbone.layers.1.mixer.out_proj.weight"] = nan["backbone.layers.1.mixer.out_proj.weight"].clone()
    nan["backbone.layers.1.mixer.out_proj.weight"][0, :2] = float("nan")
    save_file(nan, copy("nan_weights") / "model.safetensors", metadata={"format": "pt"})
    weightless = root / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text(json.dumps(config))
    badconfig = root / "badconfig"
    badconfig.mkdir()
    (badconfig / "config.json").write_text('{"model_type": "no_such_model"')
    return {folder.name: folder for folder in root.iterdir()}


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
    # a damaged weights file is named, with the fix
    (["explain", "--model", "{truncated}", "--text", "x"],
     "the weights file '{truncated}/model.safetensors' is corrupt or truncated (Error while deserializing header"),
    (["explain", "--model", "{garbage}", "--text", "x"], "'{garbage}/model.safetensors' is corrupt or truncated"),
    (["matrices", "--model", "{truncated}", "--text", "x", "--out-dir", "{tmp}/maps"],
     "re-save it with save_pretrained or download it again"),
    (["explain", "--model", "{cut_bin}", "--text", "x"],
     "'{cut_bin}/pytorch_model.bin' is corrupt or truncated (PytorchStreamReader failed"),
    # weights transformers would silently fill with random values or refuse only in its log
    (["explain", "--model", "{missing_tensor}", "--text", "x"],
     "lack 1 tensor(s) the model needs (backbone.layers.0.mixer.A_log)"),
    (["explain", "--model", "{other_shapes}", "--text", "x"],
     "do not fit its config.json: backbone.layers.0.mixer.A_log is stored as [128, 8] but the config makes it "
     "[128, 16]"),
    (["explain", "--model", "{no_tokenizer}", "--text", "x"], "the tokenizer in '{no_tokenizer}' has no vocabulary"),
    (["explain", "--model", "{wrong_field_type}", "--text", "x"],
     "the config.json in '{wrong_field_type}' cannot be read: Validation error for field 'hidden_size': TypeError"),
    # a checkpoint whose numbers are not finite: named, not explained as NaN
    (["explain", "--model", "{nan_weights}", "--text", "the plot"],
     "out_proj.weight (2 non-finite values); reload or repair them"),
    # devices that hold no data, do not exist here, or are no device at all
    (["explain", "--model", DEMO, "--text", "x", "--device", "meta"], "device 'meta' holds no data"),
    (["demo", "--out", "{tmp}/d.html", "--device", "meta"], "device 'meta' holds no data"),
    (["explain", "--model", DEMO, "--text", "x", "--device", "cuda:99"], "device 'cuda:99' is not available"),
    (["explain", "--model", DEMO, "--text", "x", "--device", ""], "device '' is not available"),
    # matrices of absurd size
    (["matrices", "--model", DEMO, "--text", "x", "--scale", "100000", "--out-dir", "{tmp}/maps"],
     "--scale 100000 is too large: a map is at most 4096 pixels a side"),
    (["matrices", "--model", DEMO, "--text", "the plot was good", "--scale", "1000", "--out-dir", "{tmp}/maps"],
     "5 tokens at --scale 1000 make maps 5000 pixels a side; the most is 4096: use --scale 819 or less"),
    (["matrices", "--model", DEMO, "--text", "x", "--scale", "0", "--out-dir", "{tmp}/maps"],
     "argument --scale: must be at least 1, not 0"),
    # words the vocabulary does not hold read as its unknown token: refused, not explained as [UNK]
    (["explain", "--model", "{no_label_words}", "--text", "the plot", "--target", "zebra"],
     "target 'zebra' is not in the tokenizer's vocabulary (it reads as the unknown token '[UNK]')"),
    (["explain", "--model", DEMO, "--text", "the plot", "--labels", "zebra", "good"],
     "label word 'zebra' is not in the tokenizer's vocabulary"),
    (["explain", "--model", DEMO, "--text", "the plot", "--target", "zebra", "--labels", "good", "zebra"],
     "label word 'zebra' is not in the tokenizer's vocabulary"),
    (["explain", "--model", DEMO, "--text", "the plot", "--labels", "good", "bad", "good"],
     "the labels ['good', 'bad', 'good'] repeat 'good'; give each label once"),
    # texts with nothing to explain
    (["explain", "--model", DEMO, "--text", ""], "the text '' is empty or only whitespace"),
    (["explain", "--model", DEMO, "--text", "the plot", "--text", " \t\n"], "the text ' \\t\\n' is empty or only"),
    (["matrices", "--model", DEMO, "--text", "  ", "--out-dir", "{tmp}/maps"], "is empty or only whitespace"),
    # a dataset that is a folder; outputs that would overwrite the input or each other
    (["explain", "--model", DEMO, "--dataset", "{tmp}"], "is a directory; give a JSONL file"),
    (["explain", "--model", DEMO, "--dataset", "/"], "dataset '/' is a directory"),
    (["explain", "--model", DEMO, "--dataset", "/dev/null"], "dataset '/dev/null' holds no lines"),
    (["explain", "--model", DEMO, "--text", "x", "--jsonl", "{tmp}/r.html", "--out", "{tmp}/r.html"],
     "--jsonl and --out both name '{tmp}/r.html'; give them different files"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, gpt2_dir, broken, tmp_path, capsys):
    places = {"{gpt2}": str(gpt2_dir), "{tmp}": str(tmp_path), **{f"{{{name}}}": str(path)
                                                                   for name, path in broken.items()}}

    def place(text):
        for key, value in places.items():
            text = text.replace(key, value)
        return text

    code, out, err = run_main(capsys, *map(place, args))
    assert code == 2
    assert place(message) in one_error_line(err), err
    assert "Traceback" not in err


def test_the_console_command_reports_a_damaged_checkpoint_in_one_line(broken):
    code, out, err = run_cli("explain", "--model", str(broken["truncated"]), "--text", "the plot")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"mamba-captum explain: error: the weights file '{broken['truncated']}/model.safetensors' is corrupt or "
        "truncated (Error while deserializing header: incomplete metadata, file not fully covered); re-save it with "
        "save_pretrained or download it again."]


def test_unknown_words_are_refused_by_the_python_api(demo, monkeypatch):
    from mamba_captum.explain import UsageError, resolve_target

    model, tokenizer = demo
    with pytest.raises(UsageError, match="label word 'zebra' is not in the tokenizer's vocabulary"):
        explain(model, tokenizer, "the plot", labels=["zebra", "good"])
    monkeypatch.setattr(model.config, "label_words", None)  # the whole vocabulary: any token may be the target
    with pytest.raises(UsageError, match="target 'zebra' is not in the tokenizer's vocabulary"):
        explain(model, tokenizer, "the plot", target="zebra")
    # the unknown token itself is a token like any other, and a known word still resolves
    assert resolve_target(model, tokenizer, "[UNK]", None) == tokenizer.unk_token_id
    (item,) = explain(model, tokenizer, "the plot", target="[UNK]", methods=("attribution",), layer_maps=False)
    assert item.target == "[UNK]"
    assert resolve_target(model, tokenizer, "film", None) == tokenizer.convert_tokens_to_ids("film")
    with pytest.raises(UsageError, match="the labels \\['a', 'a'\\] repeat 'a'"):
        explain(model, tokenizer, "the plot", labels=["a", "a"])


def test_a_tokenizer_of_another_model_is_refused(demo):
    from mamba_captum.explain import UsageError

    model, _ = demo
    bigger = tf.AutoTokenizer.from_pretrained(DEMO)
    bigger.add_tokens(["zebra"])  # id 74: one past the model's embedding table
    with pytest.raises(UsageError, match="token id 74 \\('zebra'\\), outside the model's 74-token vocabulary: the "
                                         "tokenizer does not belong to this model"):
        explain(model, bigger, "the zebra")


def test_a_model_on_the_meta_device_is_refused(demo):
    import copy

    from mamba_captum.explain import UsageError, check_device

    model, tokenizer = demo
    with pytest.raises(UsageError, match="the model is on the meta device"):
        explain(copy.deepcopy(model).to("meta"), tokenizer, "the plot")
    with pytest.raises(UsageError, match="device 'meta' holds no data"):
        check_device("meta")
    assert check_device("cpu") == torch.device("cpu")


def test_a_repeated_method_is_computed_once(demo, monkeypatch):
    from mamba_captum import explain as explain_module

    calls = []

    class CountedRaw(explain_module.METHODS["raw"]):
        def attribute(self, *args, **kwargs):
            calls.append(1)
            return super().attribute(*args, **kwargs)

    monkeypatch.setitem(explain_module.METHODS, "raw", CountedRaw)
    model, tokenizer = demo
    (item,) = explain(model, tokenizer, "the plot", methods=("raw", "raw"), layer_maps=False)
    assert list(item.relevance) == ["raw"] and len(calls) == 1


def test_outputs_never_overwrite_the_dataset_and_a_refused_run_writes_nothing(tmp_path, capsys):
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text('{"text": "the plot was good"}\n')
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--dataset", dataset, "--jsonl", dataset)
    assert code == 2 and f"--dataset and --jsonl both name '{dataset}'" in one_error_line(err)
    assert dataset.read_text() == '{"text": "the plot was good"}\n'  # it used to be emptied, then read
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--dataset", dataset, "--out", dataset)
    assert code == 2 and "--dataset and --out both name" in err and dataset.read_text().startswith('{"text"')
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--text", "x", "--target", "zebra",
                              "--jsonl", tmp_path / "new" / "r.jsonl", "--out", tmp_path / "r.html")
    assert code == 2 and not (tmp_path / "new" / "r.jsonl").exists() and not (tmp_path / "r.html").exists()


def test_a_dataset_with_a_byte_order_mark_is_read(tmp_path, capsys):
    dataset = tmp_path / "bom.jsonl"
    dataset.write_bytes(b'\xef\xbb\xbf{"text": "the plot was good", "target": "negative"}\n')  # as Notepad saves
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--dataset", dataset, "--method", "raw")
    assert code == 0, err
    (row,) = [json.loads(line) for line in (tmp_path / "bom.explained.jsonl").read_text().splitlines()]
    assert row["text"] == "the plot was good" and row["target"] == "negative"


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_explain", interrupted)
    code, out, err = run_main(capsys, "explain", "--model", DEMO, "--text", "x")
    assert code == 130 and err == "mamba-captum explain: interrupted.\n"


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


def test_version_prints_the_package_version_and_exits_0():
    from mamba_captum._version import __version__

    assert run_cli("--version") == (0, f"mamba-captum {__version__}\n", "")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["explain", "--help"], ["explain", "--dtype", "int3"]])
def test_help_version_and_usage_errors_import_no_library(args):
    # they answer at once: parsing imports argparse and the CLI's light modules, not torch, transformers or the engine
    show = ("import sys\nfrom mamba_captum.cli import main\ncode = main(sys.argv[1:])\n"
            "print(code, *sorted(m for m in sys.modules if m.startswith(('torch', 'transformers', 'mamba_captum.'))))")
    done = subprocess.run([sys.executable, "-c", show, *args], capture_output=True, text=True)
    code, *loaded = done.stdout.split("\n")[-2].split()
    assert int(code) == (2 if "int3" in args else 0), done.stderr
    assert sorted(loaded) == ["mamba_captum._version", "mamba_captum.cli", "mamba_captum.cli.arguments",
                              "mamba_captum.cli.notices", "mamba_captum.usage"]


def test_the_parsers_choices_are_the_explain_layers():
    from mamba_captum.cli.arguments import DTYPE_NAMES, METHOD_NAMES
    from mamba_captum.explain import DTYPES, METHODS

    assert (DTYPE_NAMES, METHOD_NAMES) == (tuple(DTYPES), tuple(METHODS))


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


def test_explain_a_sequence_classifier_checkpoint(classifier_dir, tmp_path, capsys):
    code, out, err = run_main(capsys, "explain", "--model", classifier_dir, "--text", "the plot was good",
                              "--target", "tech", "--jsonl", tmp_path / "r.jsonl")
    assert code == 0, err
    (row,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert row["target"] == "tech" and row["prediction"] in ("sport", "tech", "arts")
    assert row["settings"]["model_class"] == "JambaForSequenceClassification"
    assert list(row["relevance"]) == ["attribution", "raw", "rollout", "selection", "lrp"]  # the default: all
    code, out, err = run_main(capsys, "explain", "--model", classifier_dir, "--text", "the plot", "--target", "music")
    assert code == 2 and "target 'music' is not a label of this model; its labels are ['sport', 'tech', 'arts']" \
        in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["matrices", "--model", DEMO, "--text", "x", "--scale", "0"],
                                  ["matrices", "--model", DEMO, "--text", "x", "--scale", "-3"],
                                  ["explain", "--model", "vim.pth", "--image", "a.png", "--img-size", "0"],
                                  ["explain", "--model", "vim.pth", "--image", "a.png", "--img-size", "-224"]])
def test_counts_and_sizes_below_one_are_refused_before_anything_is_written(args, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where --out-dir (default matrices/) would go
    code, out, err = run_main(capsys, *args, *(["--out-dir", tmp_path / "maps"] if args[0] == "matrices" else []))
    assert code == 2 and one_error_line(err) == f"mamba-captum {args[0]}: error: argument {args[-2]}: must be at " \
                                                f"least 1, not {int(args[-1])}."
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--family", "nosuch"], "invalid choice: 'nosuch'"),
    (["--task", "needle", "nosuch"], "invalid choice: 'nosuch'"),
    (["--family", "rwkv", "--task", "bbc_news"], "no shipped classifier for --family rwkv --task bbc_news"),
    (["--family", "mamba", "--task", "counting", "--examples", "0"], "argument --examples: must be at least 1, not 0"),
    (["--family", "mamba", "--task", "counting", "--examples", "-3"],
     "argument --examples: must be at least 1, not -3"),
])
def test_evaluate_refuses_unknown_models_and_writes_nothing(args, message, tmp_path, capsys):
    doc, assets = tmp_path / "faithfulness.md", tmp_path / "assets"
    code, out, err = run_main(capsys, "evaluate", *args, "--doc", str(doc), "--assets", str(assets))
    assert code == 2 and message in one_error_line(err)
    assert not doc.exists() and not assets.exists()  # the committed report is never replaced by an empty one


# -- checkpoints of the linear token mixers: every model type, and the vision-language checkpoints ----------------
def _linear_checkpoint(path, model_type, vocab_size):
    from test_conv_attention import zaya
    from test_linear_families import vision_language
    from tiny_models import make_model

    if model_type == "zaya":
        model = zaya(torch.float32, vocab_size=vocab_size)
    elif model_type in ("inkling", "inkling2", "inkling2_loop"):
        import test_inkling

        sizes = dict(vocab_size=vocab_size) if model_type == "inkling" else \
            dict(vocab_size=vocab_size, unpadded_vocab_size=vocab_size)
        model = getattr(test_inkling, f"{model_type}_text")(torch.float32, **sizes)
    elif model_type in VISION_LANGUAGE_TEXT:  # *ForConditionalGeneration: AutoModelForImageTextToText
        model = vision_language(model_type, VISION_LANGUAGE_TEXT[model_type]).float()
        model.resize_token_embeddings(vocab_size)
    else:
        model = make_model(model_type, vocab_size=vocab_size)
    model.save_pretrained(path)


# vision-language model type -> its text model in tiny_models (qwen3_5 and qwen4_exp checkpoints are left out:
# transformers loads their own tokenizer class whatever tokenizer_config.json says, so the demo tokenizer cannot be used)
# model types MambaLRP has no rules for (docs/methods/lrp.md): the default explanation leaves "lrp" out for them
# every model type here has them now; Inkling2's cover transformers 5.24's layout (5.23: refused)
NO_LRP_RULES = set() if "inkling2_loop" in tf.CONFIG_MAPPING else {"inkling2"}
VISION_LANGUAGE_TEXT = {"glm5_next": "glm5_next", "lfm2_vl": "lfm2", "lfm3_vl": "lfm3"}
# every model type of the linear token mixers; glm5_next's text model has no causal-LM class (its VL checkpoint is
# here), and transformers loads qwen3_5_moe's own tokenizer class whatever tokenizer_config.json says, which reads
# the demo tokenizer's words as nothing (qwen3_5_moe's explanations are tested in test_linear_families.py)
LINEAR_CHECKPOINTS = [t for t in LINEAR_CONFIGS if t not in ("glm5_next", "qwen3_5_moe")] + [
    "zamba", "zaya", "inkling", "inkling2", *VISION_LANGUAGE_TEXT,
    pytest.param("inkling2_loop", marks=pytest.mark.skipif(  # its text model, looped layers and all
        "inkling2_loop" not in tf.CONFIG_MAPPING, reason="inkling2_loop is new in transformers 5.24"))]


@pytest.mark.parametrize("model_type", LINEAR_CHECKPOINTS)
def test_explain_and_matrices_on_a_saved_linear_mixer_checkpoint(model_type, tmp_path, capsys):
    tokenizer = build_tokenizer()
    _linear_checkpoint(tmp_path / "model", model_type, len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "model")
    code, out, err = run_main(capsys, "explain", "--model", tmp_path / "model", "--text", "the plot was not good",
                              "--target", "positive", "--jsonl", tmp_path / "r.jsonl")
    assert code == 0, err
    (row,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    # the default: every method, MambaLRP only where it has rules
    default = ["attribution", "raw", "rollout", "selection"] + (["lrp"] if model_type not in NO_LRP_RULES else [])
    assert list(row["relevance"]) == default and row["target"] == "positive"
    assert all(len(values) == 6 for values in row["relevance"].values()), row  # 5 words and [SENTIMENT]
    if model_type in NO_LRP_RULES:  # asked for by name, MambaLRP is refused in one line
        code, out, err = run_main(capsys, "explain", "--model", tmp_path / "model", "--text", "the plot",
                                  "--method", "lrp")
        assert code == 2 and "MambaLRP" in err and "Leave out the method lrp" in err, err
    assert row["settings"]["model_class"].endswith("ForConditionalGeneration" if model_type in VISION_LANGUAGE_TEXT
                                                   else "ForCausalLM")
    code, out, err = run_main(capsys, "matrices", "--model", tmp_path / "model", "--text", "the plot was good",
                              "--out-dir", tmp_path / "maps")
    assert code == 0, err
    explained = len(mc.implicit_attention(load(tmp_path / "model")[0], torch.tensor([[4, 5, 6]])))
    assert len(list((tmp_path / "maps").glob("layer_*.png"))) == explained > 0


def test_probability_text_says_saturation_instead_of_rounding_to_certainty():
    from mamba_captum.html_report import probability_text

    assert [probability_text(p) for p in (0.87349, 0.9994, 0.9995, 1.0, 0.0005, 0.0004999, 0.0)] == \
        ["p = 0.873", "p = 0.999", "p > 0.999", "p > 0.999", "p = 0.001", "p < 0.001", "p < 0.001"]


def test_the_printed_pixel_is_the_largest_in_magnitude_with_its_sign(tmp_path, capsys):
    # a pixel can be the most relevant by lowering the score: its value is printed signed (issue 33)
    from PIL import Image
    from tiny_models import make_vim

    from mamba_captum.cli.images import IMAGE_METHOD_NAMES

    torch.save({"model": make_vim().state_dict(), "epoch": 1}, tmp_path / "vim.pth")
    pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy()
    Image.fromarray(pixels).save(tmp_path / "a.png")
    code, out, err = run_main(capsys, "explain", "--model", tmp_path / "vim.pth", "--img-size", 32, "--image",
                              tmp_path / "a.png", "--jsonl", tmp_path / "r.jsonl")
    assert code == 0, err
    (row,) = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    expected = []
    for name in IMAGE_METHOD_NAMES:
        scores = torch.tensor(row["relevance"][name])
        at = divmod(int(scores.abs().argmax()), scores.shape[-1])
        expected.append(f"{name} ({at[0]}, {at[1]}) {float(scores[at]):+.2g}")
    assert float(expected[0].split()[-1]) < 0  # raw: here the pixel of largest |relevance| lowers the score
    assert out.splitlines()[0].endswith("; most relevant pixel (largest |relevance|: row, column, score): "
                                        + ", ".join(expected)), out
