"""Images through the product: ``mamba-captum explain --model vim.pth --image ...``, the image report, the
explain_images layer, and the report rendered by headless Chromium."""
import base64
import json
import re
import shutil
import subprocess

import numpy
import pytest
import torch
from PIL import Image
from test_cli import one_error_line, read_png, run_main
from tiny_models import make_vim

from mamba_captum.html_report import overlay_rgb, render_image_html
from mamba_captum.vision.explain import explain_images


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vim")
    model = make_vim()
    torch.save({"model": model.state_dict(), "epoch": 1}, folder / "vim.pth")
    generator = torch.Generator().manual_seed(0)
    for name in ("a.png", "b.jpg"):
        pixels = (torch.rand(48, 40, 3, generator=generator) * 255).byte().numpy()
        Image.fromarray(pixels).save(folder / name)
    return folder, model


def test_explain_images_gives_pixel_maps_equal_to_the_methods(files):
    folder, model = files
    from mamba_captum import MambaAttribution
    from mamba_captum.vision import preprocess

    (item,) = explain_images(model, [str(folder / "a.png")], target=3)
    assert set(item.relevance) == {"raw", "rollout", "attribution"} and item.target == "3"
    pixels = preprocess(folder / "a.png", img_size=32)
    expected = MambaAttribution(model).attribute(pixels, target=3)[0, 0]
    assert torch.allclose(item.relevance["attribution"], expected)
    assert item.image.shape == (32, 32, 3)
    json.dumps(item.to_dict())  # JSON-safe


def test_the_cli_explains_images_into_a_report_and_jsonl(files, capsys, tmp_path):
    folder, _ = files
    out, jsonl = tmp_path / "report.html", tmp_path / "r.jsonl"
    code, stdout, err = run_main(capsys, "explain", "--model", folder / "vim.pth", "--img-size", 32, "--image",
                                 folder / "a.png", "--image", folder / "b.jpg", "--out", out, "--jsonl", jsonl,
                                 "--labels", "v", "w", "x", "y", "z", "--target", "y")
    assert code == 0, err
    assert stdout.count("explained: y") == 2 and "most relevant pixel" in stdout
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["target"] == "y" and len(rows[0]["relevance"]["attribution"]) == 32
    page = out.read_text()
    images = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(images) == 2 * (1 + 3)  # per image: the input and one overlay per method
    assert read_png(base64.b64decode(images[0])).shape == (32, 32, 3)
    assert "<script" not in page and "http" not in page.split("</style>", 1)[1]


@pytest.mark.parametrize("args, message", [
    (("--image", "missing.png"), "no image file"),
    (("--image", "{folder}/a.png", "--labels", "one", "two"), "2 names for a model of 5 classes"),
    (("--image", "{folder}/a.png", "--target", "cat"), "not a class index"),
    (("--image", "{folder}/a.png", "--target", "7"), "outside the model's classes"),
    (("--image", "{folder}/a.png", "--img-size", "10"), "no stride without gaps"),
    (("--image", "{folder}/a.png", "--img-size", "224"), "no stride without gaps"),
    (("--image", "{folder}/vim.pth"), "not an image"),
])
def test_bad_image_requests_are_one_line(files, capsys, args, message):
    folder, _ = files
    args = [a.format(folder=folder) for a in args]
    model = folder / "vim.pth" if "--img-size" in args else None
    extra = [] if model is not None else ["--img-size", "32"]
    code, _, err = run_main(capsys, "explain", "--model", folder / "vim.pth", *extra, *args)
    assert code == 2 and message in one_error_line(err)


def test_a_model_path_that_is_not_a_checkpoint_is_one_line(files, capsys):
    folder, _ = files
    code, _, err = run_main(capsys, "explain", "--model", folder / "a.png", "--image", folder / "a.png")
    assert code == 2 and "weights-only" in one_error_line(err)


def test_a_checkpoint_of_integer_weights_is_one_line(files, capsys, tmp_path):
    folder, model = files
    path = tmp_path / "int8.pth"
    torch.save({"model": {k: v.to(torch.int8) for k, v in model.state_dict().items()}}, path)
    code, _, err = run_main(capsys, "explain", "--model", path, "--img-size", 32, "--image", folder / "a.png")
    count = len(model.state_dict())
    assert code == 2 and f"holds {count} tensors that are not floating point: cls_token (int8)" in one_error_line(err)
    assert "quantized" in err and "Traceback" not in err


def test_overlay_colours_the_relevance():
    image = torch.full((2, 2, 3), 0.5, dtype=torch.float64)
    relevance = torch.tensor([[1.0, -1.0], [0.0, 0.5]])
    rgb = overlay_rgb(image, relevance)
    assert rgb[0, 0].tolist() == [56, 199, 56]  # 0.25 · 0.5 + 0.75 · the palette's green (32, 223, 32) / 255
    assert rgb[0, 1].tolist() == [204, 90, 90]  # its red (230, 77, 77) for negative
    assert rgb[1, 1].tolist() == [92, 163, 92]  # half the relevance: 0.375 opaque
    assert rgb[1, 0].tolist() == [128, 128, 128]  # untouched where the relevance is 0


def test_chromium_shows_the_image_report(files, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("headless Chromium is needed for this test: install Debian's chromium (apt-get install -y "
                    "chromium; the README's test command does).")
    folder, model = files
    page = tmp_path / "report.html"
    page.write_text(render_image_html(explain_images(model, [str(folder / "a.png")])), encoding="utf-8")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count("<img ") == 4 and "Mamba-Attribution" in dom
    shot = tmp_path / "shot.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1000,700", page.as_uri()],
                   capture_output=True, timeout=120)
    pixels = numpy.asarray(Image.open(shot).convert("RGB")).astype(int)
    reddish = ((pixels[..., 0] > 150) & (pixels[..., 1] < 100) & (pixels[..., 2] < 100)).sum()
    assert reddish > 500  # the overlays' positive relevance is drawn
