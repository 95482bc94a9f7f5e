"""The shipped Vim checkpoint as a new user meets it (issue 33): training.json beside the file gives the image size
and the class names (Python and CLI); errors and notices speak the CLI's options; grayscale and small images are
said, not silent; preprocess takes img_size= as load_vim does; a .pth with --text is named; --model demo."""
import json
import shutil
import warnings

import pytest
import torch
from PIL import Image
from test_cli import one_error_line, run_main
from tiny_models import make_vim

from mamba_captum.vision import ImageNotice, load_vim, preprocess, read_training_record

SHIPPED = __import__("pathlib").Path(__file__).parents[1] / "mamba_captum/evaluation/weights/vim-shapes"
NAMES = ["square", "plus", "ring", "cross"]
FITS = "(the training image size; 32 fits 8 × 8 patches without overlap)"


@pytest.fixture
def bare(tmp_path):
    """The shipped checkpoint alone in a folder (no training.json)."""
    shutil.copy(SHIPPED / "vim.pth", tmp_path / "vim.pth")
    return tmp_path / "vim.pth"


@pytest.fixture
def photo(tmp_path):
    path = tmp_path / "photo.png"
    generator = torch.Generator().manual_seed(0)
    Image.fromarray((torch.rand(40, 40, 3, generator=generator) * 255).byte().numpy()).save(path)
    return path


def quiet(function, *args, **options):
    """``function(...)`` with every warning an error: nothing was said."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return function(*args, **options)


# -- training.json, from Python -------------------------------------------------------------------------------------
def test_load_vim_reads_the_image_size_and_class_names_beside_the_checkpoint(bare):
    model = quiet(load_vim, SHIPPED / "vim.pth")
    assert model.img_size == (32, 32) and model.class_names == NAMES
    with pytest.raises(ValueError, match=r"224×224 images .*; pass img_size= \(the training image size; 32 fits"):
        load_vim(bare)  # the same weights without the record: the size must be given
    assert load_vim(bare, img_size=32).class_names is None
    assert read_training_record(bare) is None and read_training_record(SHIPPED / "vim.pth")["class_names"] == NAMES


def test_load_trained_vim_reads_the_record_through_the_zoo():
    from mamba_captum.evaluation.vision_models import load_trained_vim

    model, record = load_trained_vim("shapes")
    assert model.img_size == (32, 32) and model.class_names == NAMES and record["config"]["img_size"] == 32


def test_an_explicit_img_size_wins_over_the_record_with_a_notice(tmp_path):
    torch.save({"model": make_vim().state_dict()}, tmp_path / "vim.pth")  # 8-pixel patches, 4 × 4: fits 32 and 36
    (tmp_path / "training.json").write_text(json.dumps({"config": {"img_size": 32}}))
    assert quiet(load_vim, tmp_path / "vim.pth").img_size == (32, 32)
    with pytest.warns(ImageNotice) as said:
        model = load_vim(tmp_path / "vim.pth", img_size=36)
    assert model.img_size == (36, 36)
    assert [str(w.message) for w in said] == [
        f"mamba_captum: img_size=36 differs from the img_size 32 in {str(tmp_path / 'training.json')!r}; using "
        "img_size=36."]


@pytest.mark.parametrize("content, problem", [
    ("{", "is not valid JSON (Expecting property name enclosed in double quotes, line 1)"),
    ("[1]", "holds a JSON array, not an object"),
    ('{"config": [32]}', "has a 'config' that is a JSON array, not an object"),
    ('{"config": {"img_size": "32"}}', "has an 'img_size' of \"32\", not a positive integer or [height, width]"),
    ('{"img_size": [32, 0]}', "has an 'img_size' of [32, 0], not a positive integer or [height, width]"),
    ('{"class_names": "square"}', "has 'class_names' that are not a list of strings"),
])
def test_a_damaged_record_is_one_line_naming_it(bare, capsys, photo, content, problem):
    record = bare.with_name("training.json")
    record.write_text(content)
    expected = f"{str(record)!r} {problem}; fix it or remove it (it is read for the image size and the class names)."
    with pytest.raises(ValueError) as raised:
        load_vim(bare)
    assert str(raised.value) == f"mamba_captum: {expected}"
    code, _, err = run_main(capsys, "explain", "--model", bare, "--image", photo)
    assert code == 2 and one_error_line(err) == f"mamba-captum explain: error: {expected}"


def test_class_names_must_be_one_a_class(bare):
    bare.with_name("training.json").write_text(json.dumps({"config": {"img_size": 32}, "class_names": ["a", "b"]}))
    with pytest.raises(ValueError) as raised:
        load_vim(bare)
    assert str(raised.value) == (f"mamba_captum: {str(bare.with_name('training.json'))!r} has 2 class_names for a "
                                 "model of 4 classes; fix it or remove the names.")


# -- training.json and --img-size in the CLI ------------------------------------------------------------------------
def test_the_cli_names_the_class_from_training_json(capsys, photo):
    model = load_vim(SHIPPED / "vim.pth")
    with torch.no_grad():
        probabilities = model(preprocess(photo, img_size=model.img_size))[0].softmax(-1)
    expected = f"{photo}: class {NAMES[int(probabilities.argmax())]} (p = {float(probabilities.max()):.3f});"
    code, out, err = run_main(capsys, "explain", "--model", SHIPPED / "vim.pth", "--image", photo,
                              "--method", "raw")
    assert (code, err) == (0, "") and out.startswith(expected)


def test_without_a_record_the_error_names_the_option(bare, capsys, photo):
    code, _, err = run_main(capsys, "explain", "--model", bare, "--image", photo)
    assert code == 2 and one_error_line(err) == (
        "mamba-captum explain: error: no stride without gaps gives 64 patches of 4×4 pixels on 224×224 images (the "
        f"position embeddings' count); pass --img-size {FITS}.")


def test_an_img_size_against_the_record_is_said_and_used(bare, capsys, photo):
    shutil.copy(SHIPPED / "training.json", bare.with_name("training.json"))
    code, _, err = run_main(capsys, "explain", "--model", bare, "--image", photo, "--img-size", 48)
    assert code == 2 and err.splitlines() == [
        f"mamba-captum explain: note: --img-size 48 differs from the img_size 32 in "
        f"{str(bare.with_name('training.json'))!r}; using --img-size 48.",
        "mamba-captum explain: error: no stride without gaps gives 64 patches of 4×4 pixels on 48×48 images (the "
        f"position embeddings' count); check --img-size {FITS}."]  # Python's stride= hint dropped: no such option


# -- preprocess: img_size=, and what it says ------------------------------------------------------------------------
def test_preprocess_takes_img_size_as_load_vim_does(photo):
    model = load_vim(SHIPPED / "vim.pth")
    pixels = quiet(preprocess, photo, img_size=model.img_size)
    assert pixels.shape == (1, 3, 32, 32) and torch.equal(pixels, preprocess(photo, img_size=32))
    with pytest.warns(FutureWarning, match=r"preprocess\(size=\) is now preprocess\(img_size=\)"):
        old = preprocess(photo, size=32)
    assert torch.equal(old, pixels)
    with pytest.raises(TypeError, match="give img_size= only"):
        preprocess(photo, img_size=32, size=32)


@pytest.mark.parametrize("mode", ["L", "LA", "1", "I;16", "I", "F"])
def test_a_grayscale_image_is_said_to_be_copied_to_rgb(tmp_path, mode):
    image = Image.new("L", (40, 40), 255).convert(mode) if mode not in ("I;16", "I", "F") else \
        Image.new(mode, (40, 40), {"I;16": 65535, "I": 65535, "F": 1.0}[mode])
    with pytest.warns(ImageNotice) as said:
        pixels = preprocess(image, img_size=32)
    assert [str(w.message) for w in said] == [
        f"mamba_captum: the image is grayscale (Pillow mode {mode!r}): its channel was copied to R, G and B, as the "
        "model reads colour images."]
    assert torch.equal(pixels[0, 0] * 0.229 + 0.485, pixels[0, 1] * 0.224 + 0.456)  # the same grey in R and G


@pytest.mark.parametrize("width, height", [(20, 20), (3, 3), (40, 30)])
def test_an_image_smaller_than_the_input_is_said_to_be_upscaled(tmp_path, width, height):
    path = tmp_path / "small.png"
    Image.new("RGB", (width, height), (10, 200, 30)).save(path)
    with pytest.warns(ImageNotice) as said:
        assert preprocess(path, img_size=32).shape == (1, 3, 32, 32)
    assert [str(w.message) for w in said] == [
        f"mamba_captum: {str(path)!r} is {width} × {height} pixels, smaller than the model's input of 32 × 32: it was "
        "upscaled (bicubic), so the model sees interpolated pixels."]


def test_a_colour_image_of_the_input_size_is_quiet(photo):
    assert quiet(preprocess, photo, img_size=40).shape == (1, 3, 40, 40)
    assert quiet(preprocess, Image.new("RGBA", (32, 32)), img_size=32).shape == (1, 3, 32, 32)


def test_the_cli_says_what_it_did_to_an_image_in_one_line_each(tmp_path, capsys):
    path = tmp_path / "grey.png"
    Image.new("L", (20, 20), 100).save(path)
    code, out, err = run_main(capsys, "explain", "--model", SHIPPED / "vim.pth", "--image", path, "--method", "raw")
    assert code == 0 and out.startswith(f"{path}: class ")
    assert err.splitlines() == [
        f"mamba-captum explain: note: {str(path)!r} is grayscale (Pillow mode 'L'): its channel was copied to R, G "
        "and B, as the model reads colour images.",
        f"mamba-captum explain: note: {str(path)!r} is 20 × 20 pixels, smaller than the model's input of 32 × 32: "
        "it was upscaled (bicubic), so the model sees interpolated pixels."]


# -- a .pth where a folder is wanted, and a folder where a .pth is ---------------------------------------------------
@pytest.mark.parametrize("command, source, expected", [
    ("explain", ("--text", "hello"), "is a Vision Mamba checkpoint file (.pth): it explains --image files, not "
     "--text; give --image FILE, or an HF checkpoint directory as --model for texts."),
    ("explain", ("--dataset", "{data}"), "is a Vision Mamba checkpoint file (.pth): it explains --image files, not "
     "--dataset; give --image FILE, or an HF checkpoint directory as --model for texts."),
    ("matrices", ("--text", "hello"), "is a Vision Mamba checkpoint file (.pth), which explains images, not texts: "
     "`matrices` needs an HF checkpoint directory; explain images with `mamba-captum explain --model {model} "
     "--image FILE`."),
])
def test_a_vim_file_for_texts_is_named(tmp_path, capsys, command, source, expected):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "hello"}\n')
    model = SHIPPED / "vim.pth"
    source = [a.format(data=data) for a in source]
    code, _, err = run_main(capsys, command, "--model", model, *source)
    assert code == 2 and one_error_line(err) == (
        f"mamba-captum {command}: error: --model {str(model)!r} " + expected.format(model=model))


def test_load_names_a_file_given_as_a_folder():
    from mamba_captum.explain import UsageError, load

    with pytest.raises(UsageError) as raised:
        load(SHIPPED / "vim.pth")
    assert str(raised.value) == (f"{str(SHIPPED / 'vim.pth')!r} is a file, not a checkpoint directory: load() reads "
                                 "a folder written by save_pretrained (a Vision Mamba .pth file loads with "
                                 "mamba_captum.vision.load_vim).")


# -- --model demo ---------------------------------------------------------------------------------------------------
def test_model_demo_is_the_bundled_model(tmp_path, capsys, monkeypatch, photo):
    from mamba_captum.demo import model_dir

    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "explain", "--model", "demo", "--text", "the plot was not good",
                              "--method", "raw")
    assert (code, err) == (0, "") and out.startswith("'the plot was not good': negative (p ")
    code, out, err = run_main(capsys, "matrices", "--model", "demo", "--text", "the plot was good",
                              "--out-dir", tmp_path / "maps")
    assert (code, err) == (0, "") and (tmp_path / "maps" / "layer_00.png").is_file()
    code, _, err = run_main(capsys, "explain", "--model", "demo", "--image", photo)
    assert code == 2 and one_error_line(err) == (
        f"mamba-captum explain: error: --model {str(model_dir())!r} is a folder (an HF checkpoint, which explains "
        "--text); --image needs a Vision Mamba checkpoint file (.pth).")


def test_a_path_named_demo_wins(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    code, _, err = run_main(capsys, "explain", "--model", "demo", "--text", "hello")
    assert code == 2 and one_error_line(err) == (
        "mamba-captum explain: error: 'demo' holds no config.json: it is not a HF checkpoint directory.")


@pytest.mark.parametrize("command", ["explain", "matrices"])
def test_the_help_of_model_says_demo(capsys, command):
    code, out, _ = run_main(capsys, command, "--help")
    assert code == 0 and "or demo: the bundled demo model" in " ".join(out.split())


def test_the_record_gives_the_evaluation_crop_and_preprocess_takes_the_model(tmp_path):
    """The shipped Vims were trained on whole 32×32 images: training.json says crop_pct 1, load_vim keeps it and
    preprocess(model=) uses it, so the shipped example files come back as the tensors they were saved from and
    are classified as named (the official 0.875 crop would cut their border and enlarge the shapes)."""
    vim = quiet(load_vim, SHIPPED / "vim.pth")
    assert vim.crop_pct == 1.0 and vim.img_size == (32, 32)
    for name in NAMES:
        path = SHIPPED / f"example-{name}.png"
        pixels = quiet(preprocess, path, model=vim)
        assert torch.equal(pixels, preprocess(path, img_size=32, crop_pct=1.0))
        with torch.no_grad():
            assert vim.class_names[int(vim(pixels).argmax())] == name
    cropped = preprocess(SHIPPED / "example-ring.png", model=vim, crop_pct=0.875)  # an explicit value wins
    assert not torch.equal(cropped, preprocess(SHIPPED / "example-ring.png", model=vim))
    bare = make_vim()
    assert bare.crop_pct == 0.875  # the official models' transform when no record says otherwise
    with pytest.raises(TypeError, match="takes a Vision Mamba"):
        preprocess(SHIPPED / "example-ring.png", model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("crop", ["0.5", "0", "1.5", "true", '"all"'])
def test_a_bad_crop_in_the_record_is_named(bare, crop):
    record = json.loads((SHIPPED / "training.json").read_text())
    (bare.parent / "training.json").write_text(json.dumps(record)[:-1] + f', "crop_pct": {crop}}}')
    if crop == "0.5":
        assert read_training_record(bare)["crop_pct"] == 0.5
        return
    with pytest.raises(ValueError, match=r"has a 'crop_pct' of .*, not a number in \(0, 1\]"):
        read_training_record(bare)


def test_the_cli_explains_the_shipped_examples_as_named(capsys):
    code, out, err = run_main(capsys, "explain", "--model", SHIPPED / "vim.pth",
                              *[a for name in NAMES for a in ("--image", SHIPPED / f"example-{name}.png")])
    assert code == 0, err
    for name in NAMES:
        assert f"example-{name}.png: class {name} (p = 0.99" in out or f"example-{name}.png: class {name} (p > 0.999)" \
            in out, out


@pytest.mark.parametrize("fields, problem", [
    ({"class_names": ["ring", "ring", "plus", "cross"]}, r"repeats the class names \['ring'\]"),
    ({"img_size": 64}, r"gives two image sizes, 32 under 'config' and 64 at the top"),
    ({"img_size": "32"}, r"gives two image sizes"),
])
def test_a_record_that_would_be_read_two_ways_is_refused(bare, fields, problem):
    record = {**json.loads((SHIPPED / "training.json").read_text()), **fields}
    (bare.parent / "training.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=problem):
        load_vim(bare)


def test_a_null_size_under_config_falls_back_to_the_top_level_one(bare):
    record = json.loads((SHIPPED / "training.json").read_text())
    record["config"]["img_size"], record["img_size"] = None, 32
    (bare.parent / "training.json").write_text(json.dumps(record))
    assert quiet(load_vim, bare).img_size == (32, 32)


@pytest.mark.parametrize("options, problem", [
    ({"img_size": "224"}, "img_size='224'"), ({"img_size": True}, "img_size=True"),
    ({"img_size": (32, 32, 3)}, r"img_size=\(32, 32, 3\)"), ({"img_size": 32.5}, "img_size=32.5"),
    ({"img_size": (32,)}, r"img_size=\(32,\)"), ({"crop_pct": 0}, "crop_pct=0"), ({"crop_pct": 1.5}, "crop_pct=1.5"),
    ({"crop_pct": float("nan")}, "crop_pct=nan"), ({"crop_pct": "1"}, "crop_pct='1'"),
])
def test_preprocess_refuses_a_size_or_crop_it_would_misread(photo, options, problem):
    with pytest.raises(ValueError, match=problem):
        preprocess(photo, **options)


def test_a_stretch_without_crop_is_said(tmp_path):
    """crop_pct=1 (the shipped Vims) resizes the whole image: a 64 × 48 file is squashed to 32 × 32, and said; a
    square one and the official centre crop are quiet."""
    path = tmp_path / "wide.png"
    Image.new("RGB", (64, 48), "red").save(path)
    with pytest.warns(ImageNotice, match=r"64 × 48 pixels: it was resized to the model's 32 × 32 without a crop"):
        preprocess(path, img_size=32, crop_pct=1)
    quiet(preprocess, path, img_size=32)  # the centre crop keeps the aspect ratio
    Image.new("RGB", (64, 64), "red").save(path)
    quiet(preprocess, path, img_size=32, crop_pct=1)
