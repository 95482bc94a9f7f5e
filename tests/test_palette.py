"""One colour language (mamba_captum.palette), Captum's: green positive, red negative, white zero, for the report's
tokens, its map thumbnails and legends, the Vim overlays and the ``mamba-captum matrices`` PNGs; token labels on the
maps of short texts."""
import colorsys
import io
import types

import numpy
import pytest
import torch
import transformers as tf
from PIL import Image

from mamba_captum import cli, html_report
from mamba_captum.demo import load_demo, model_dir
from mamba_captum.explain import Explanation, explain
from mamba_captum.html_report import (MAX_LABELLED_TOKENS, captum_colour, legend_html, map_png, map_rgb, overlay_rgb,
                                      render_html, render_image_html)
from mamba_captum.palette import palette_css, palette_hsl, palette_rgb

GRID = torch.linspace(-1, 1, 401, dtype=torch.float64).tolist()


def test_palette_at_minus_one_zero_and_one():
    assert palette_rgb(torch.tensor([-1.0, 0.0, 1.0])).tolist() == [[230, 77, 77], [255, 255, 255], [32, 223, 32]]
    assert [palette_css(s) for s in (-1, 0, 1)] == ["hsl(0, 75%, 60%)", "hsl(0, 75%, 100%)", "hsl(120, 75%, 50%)"]
    # clipped to [-1, 1]; a NaN entry of a map is drawn as 0
    assert palette_rgb(torch.tensor([-5.0, 7.0, float("nan")])).tolist() == [[230, 77, 77], [32, 223, 32],
                                                                                [255, 255, 255]]
    assert palette_rgb(torch.zeros(2, 3)).shape == (2, 3, 3) and palette_rgb(0.5).dtype == torch.uint8


def test_palette_is_captums_text_colour_and_its_rgb():
    from captum.attr._utils.visualization import _get_color

    rgb = palette_rgb(torch.tensor(GRID, dtype=torch.float64))
    for score, colour in zip(GRID, rgb.tolist()):
        assert palette_css(score) == _get_color(score) == captum_colour(score)
        hue, saturation, lightness = palette_hsl(score)
        exact = [255 * c for c in colorsys.hls_to_rgb(hue / 360, lightness / 100, saturation / 100)]
        assert all(abs(c - e) <= 0.5 + 1e-9 for c, e in zip(colour, exact)), (score, colour, exact)
        assert palette_rgb(score).tolist() == colour  # one score or a tensor of them: the same colour


def test_palette_speaks_captums_image_language():
    # visualize_image_attr(sign="all") draws red -> white -> green; the palette runs the same way (another ramp)
    from captum.attr._utils.visualization import _initialize_cmap_and_vmin_vmax

    cmap, vmin, vmax = _initialize_cmap_and_vmin_vmax("all")
    assert (vmin, vmax) == (-1, 1)
    for score in (-1.0, -0.5, -0.1, 0.1, 0.5, 1.0):
        theirs = [round(255 * c) for c in cmap((score + 1) / 2)[:3]]
        ours = palette_rgb(score).tolist()
        channel = 1 if score > 0 else 0  # green or red leads, the other two equal
        for colour in (ours, theirs):
            assert colour[channel] == max(colour) and sorted(colour)[0] == sorted(colour)[1] < max(colour), colour
    assert palette_rgb(0.0).tolist() == [255, 255, 255] and min(cmap(0.5)[:3]) > 0.99
    # the further from 0, the further from white
    far = [int(255 * 3 - palette_rgb(s).int().sum()) for s in (0.1, 0.4, 0.7, 1.0)]
    assert far == sorted(far) and len(set(far)) == 4


def test_thumbnail_of_a_known_matrix():
    matrix = torch.tensor([[2.0, 0.0], [-1.0, 0.5]])  # / 2: 1, 0, -0.5, 0.25
    assert map_rgb(matrix).tolist() == [[[32, 223, 32], [255, 255, 255]], [[242, 166, 166], [201, 247, 201]]]
    png = numpy.array(Image.open(io.BytesIO(map_png(matrix, scale=3))).convert("RGB"))
    assert png.shape == (6, 6, 3) and png[::3, ::3].tolist() == map_rgb(matrix).tolist()
    # a map that is all >= 0 (abs_mean) runs white -> green
    rgb = map_rgb(torch.tensor([[0.0, 1.0], [3.0, 4.0]])).int()
    assert rgb[0, 0].tolist() == [255, 255, 255] and rgb[1, 1].tolist() == [32, 223, 32]
    assert bool((rgb[..., 0] == rgb[..., 2]).all() and (rgb[..., 1] >= rgb[..., 0]).all())


def test_overlay_on_white_is_the_palette():
    unit = torch.linspace(-1, 1, 41, dtype=torch.float64)
    rgb = overlay_rgb(torch.ones(1, 41, 3, dtype=torch.float64), 3 * unit[None])[0].int()
    # the palette's colour of 0.75 · the scaled score, to within one of its 1 % lightness steps (4.5 / 255)
    assert (rgb - palette_rgb(0.75 * unit).int()).abs().max().item() <= 5
    assert rgb[20].tolist() == [255, 255, 255] and rgb[0].tolist() == [236, 122, 122]


def test_thumbnails_overlays_and_legends_use_the_one_palette(monkeypatch):
    # every colour the report draws comes from palette_rgb / palette_css: replace them, and all follow
    monkeypatch.setattr(html_report, "palette_rgb", lambda scores: torch.tensor([10, 20, 30], dtype=torch.uint8)
                        .expand(*torch.as_tensor(scores).shape, 3))
    monkeypatch.setattr(html_report, "palette_css", lambda score: f"rgb(1, 2, {score})")
    assert map_rgb(torch.tensor([[1.0, 0.0], [-1.0, 0.5]])).reshape(-1, 3).unique(dim=0).tolist() == [[10, 20, 30]]
    overlay = overlay_rgb(torch.zeros(1, 1, 3, dtype=torch.float64), torch.ones(1, 1))
    assert overlay.tolist() == [[[8, 15, 22]]]  # 0.75 · (10, 20, 30) over black
    assert captum_colour(0.5) == "rgb(1, 2, 0.5)"
    legend = legend_html("x")
    assert all(f"background-color: rgb(1, 2, {v})" in legend for v in (-1, 0, 1))
    assert "linear-gradient(to right, rgb(1, 2, -1), rgb(1, 2, 0), rgb(1, 2, 1))" in legend


def example(tokens, layers=1):
    return Explanation(text=" ".join(tokens), tokens=list(tokens), prediction="x", probability=0.5, target="x",
                       target_probability=0.5, relevance={"attribution": [1.0] * len(tokens)},
                       layer_maps={layer: torch.eye(len(tokens)) for layer in range(layers)})


def test_both_reports_state_the_convention_once_in_the_palettes_colours():
    image = dict(path="a.png", image=torch.zeros(2, 2, 3), relevance={"attribution": torch.ones(2, 2)},
                 prediction="x", probability=0.5, target="x", target_probability=0.5, settings={})
    pages = [render_html([example(["a", "b"])]), render_image_html([types.SimpleNamespace(**image)])]
    for page in pages:
        assert page.count("<strong>green</strong> raises the explained score") == 1
        assert page.count("<strong>red</strong> lowers it") == 1
        assert page.count("class='legend'") == 1 and "rgb(255, 64, 64)" not in page and "blue" not in page
        for score, name in ((-1, "negative"), (0, "zero"), (1, "positive")):
            assert f'<mark class="token" style="background-color: {palette_css(score)}">{name}</mark>' in page
        assert "linear-gradient(to right, hsl(0, 75%, 60%), hsl(0, 75%, 100%), hsl(120, 75%, 50%))" in page


def test_map_labels_for_a_short_text_none_for_a_long_one():
    short = render_html([example(["the", "<b>", "extraordinarily", "good"], layers=2)])
    assert short.count("<span class='key' ") == 8 and short.count("<span class='query' ") == 8  # 4 per map
    assert "<span class='key' title='&lt;b&gt;'>&lt;b&gt;</span>" in short
    assert "<span class='query' style='grid-row: 3' title='&lt;b&gt;'>&lt;b&gt;</span>" in short
    assert "title='extraordinarily'>extraordi…</span>" in short  # cut to 10 characters, whole on hover
    assert "grid-template-columns: auto repeat(4, 35px)" in short and "width: 140px; height: 140px" in short
    assert short.count("<img ") == 2 and "no token labels" not in short
    limit = render_html([example([f"t{i}" for i in range(MAX_LABELLED_TOKENS)])])
    assert limit.count("<span class='key' ") == 32 and "repeat(32, 12px)" in limit  # 384 px
    long = render_html([example([f"t{i}" for i in range(MAX_LABELLED_TOKENS + 1)])])
    assert "class='key'" not in long and "class='query'" not in long and "class='map'" not in long
    assert "no token labels: 33 tokens, more than the 32 that fit" in long and long.count("<img ") == 1


@pytest.fixture(scope="module")
def demo():
    return load_demo()


def test_matrices_pngs_are_the_palette_of_the_maps(demo, tmp_path, capsys):
    model, tokenizer = demo
    text = "the plot was not good"
    progress_bars = tf.utils.logging.is_progress_bar_enabled()
    try:
        assert cli.main(["matrices", "--model", str(model_dir()), "--text", text, "--out-dir",
                         str(tmp_path), "--scale", "2"]) == 0
    finally:
        if progress_bars:  # main turns HF's progress bars off for the rest of the process
            tf.utils.logging.enable_progress_bar()
    (item,) = explain(model, tokenizer, text, methods=())
    for layer, matrix in item.layer_maps.items():
        png = numpy.array(Image.open(tmp_path / f"layer_{layer:02d}.png").convert("RGB"))
        expected = palette_rgb(matrix.double() / matrix.abs().max())
        assert png[::2, ::2].tolist() == expected.tolist(), layer
        assert (png[..., 1] > png[..., 0] + 60).any() and (png[..., 0] > png[..., 1] + 60).any()  # green and red


def test_a_nan_score_is_white_in_css_and_in_pixels():
    from mamba_captum.palette import palette_css, palette_rgb

    assert palette_css(float("nan")) == palette_css(0.0) == "hsl(0, 75%, 100%)"
    assert palette_rgb(torch.tensor([float("nan")])).tolist() == [[255, 255, 255]]
