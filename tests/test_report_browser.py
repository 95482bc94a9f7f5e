"""The HTML report rendered by a real browser: headless Chromium (Debian's ``chromium``; the README's test command
installs it) loads the self-contained file offline, its DOM holds every token, and the screenshot shows Captum's
green and red highlights."""
import dataclasses
import html
import shutil
import subprocess

import pytest
import torch
import numpy
from PIL import Image

from mamba_captum.demo import DEMO_TEXTS, load_demo
from mamba_captum.explain import explain
from mamba_captum.html_report import render_html

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic", "--hide-scrollbars"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("headless Chromium is needed for this test: install Debian's chromium "
                    "(apt-get install -y chromium; the README's test command does).")
    model, tokenizer = load_demo()
    explanations = explain(model, tokenizer, DEMO_TEXTS[:2])
    folder = tmp_path_factory.mktemp("report")
    page = folder / "report.html"
    page.write_text(render_html(explanations), encoding="utf-8")
    return browser, folder, page, explanations


def run_browser(browser, folder, *args):
    return subprocess.run([browser, *FLAGS, f"--user-data-dir={folder / 'profile'}", *args], capture_output=True,
                          text=True, timeout=120)


def test_chromium_renders_every_token(report):
    browser, folder, page, explanations = report
    dom = run_browser(browser, folder, "--dump-dom", page.as_uri()).stdout
    assert dom.count('<mark class="token"') == 3 + sum(len(e.tokens) * len(e.relevance) for e in explanations)
    for item in explanations:  # (the 3 extra marks are the legend's)
        for token in item.tokens:
            assert f">{html.escape(token)}</mark>" in dom
    assert dom.count("<img ") == sum(len(e.layer_maps) for e in explanations)


def screenshot_colours(browser, folder, page):
    shot = folder / f"{page.stem}.png"
    run_browser(browser, folder, f"--screenshot={shot}", "--window-size=1100,900", page.as_uri())
    pixels = torch.from_numpy(numpy.array(Image.open(shot).convert("RGB"))).int()
    assert pixels.shape == (900, 1100, 3)
    red, green, blue = pixels.unbind(-1)
    return {"green": ((green - red > 60) & (green - blue > 60)).sum().item(),  # captum's positive highlights
            "red": ((red - green > 60) & (red - blue > 60)).sum().item(),
            "dark": (pixels.sum(-1) < 150).sum().item()}  # rendered text


def test_chromium_screenshot_shows_the_heatmap(report):
    browser, folder, page, explanations = report
    shown = screenshot_colours(browser, folder, page)
    # the same page with every relevance 0: white tokens; the legend and the map thumbnails stay
    blank = [dataclasses.replace(e, relevance={k: [0.0] * len(v) for k, v in e.relevance.items()})
             for e in explanations]
    plain = folder / "plain.html"
    plain.write_text(render_html(blank), encoding="utf-8")
    without = screenshot_colours(browser, folder, plain)
    assert shown["dark"] > 2000 and without["dark"] > 2000
    assert shown["green"] - without["green"] > 2000, (shown, without)  # the highlighted tokens
