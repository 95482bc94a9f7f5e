"""One self-contained HTML file (no scripts, no network) for a list of :class:`~mamba_captum.explain.Explanation`:
a token heatmap per method, the prediction, per-layer map thumbnails (token labels on short texts), the settings.

Also a dependency-free PNG writer for the implicit-attention maps (``map_png``), used by ``mamba-captum matrices``.
Tokens, maps, overlays and legends all speak one colour language, Captum's (:mod:`mamba_captum.palette`): green
positive, red negative, white zero.
"""
from __future__ import annotations

import base64
import html
import struct
import zlib

import torch

from ._version import __version__
from .palette import palette_css, palette_rgb
from .viz import scale_to_unit

METHOD_TITLES = {"raw": "Raw attention (MambaRawAttention)", "rollout": "Attention rollout (MambaRollout)",
                 "attribution": "Mamba-Attribution (MambaAttribution)",
                 "selection": "Selection-aware attribution (MambaSelectionAttribution)", "lrp": "MambaLRP (MambaLRP)"}


def captum_colour(score: float) -> str:
    """The CSS colour Captum's ``visualize_text`` gives a score in [-1, 1]: green for positive, red for negative
    (:func:`mamba_captum.palette.palette_css`, the same formula as ``captum.attr._utils.visualization._get_color``;
    the tests compare the two)."""
    return palette_css(score)


def png_bytes(rgb: torch.Tensor) -> bytes:
    """(H, W, 3) uint8 -> the bytes of an 8-bit RGB PNG file."""
    rgb = torch.as_tensor(rgb, dtype=torch.uint8).contiguous()
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + bytes(rgb[row].flatten().tolist()) for row in range(height))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def map_rgb(matrix: torch.Tensor, scale: int = 1) -> torch.Tensor:
    """(L, L) map -> (L·scale, L·scale, 3) uint8 in the palette (:func:`mamba_captum.palette.palette_rgb`) of the
    entries divided by the largest |entry|: white at 0, green for positive, red for negative entries (a signed map
    stays signed, a map that is all >= 0, e.g. ``reduce="abs_mean"``, runs white -> green; the causal upper
    triangle is white)."""
    matrix = torch.as_tensor(matrix).detach().double().cpu()
    peak = matrix.abs().max()
    rgb = palette_rgb(matrix / peak if peak > 0 else matrix)
    if scale > 1:
        rgb = rgb.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return rgb


def map_png(matrix: torch.Tensor, scale: int = 1) -> bytes:
    """A PNG file of an (L, L) implicit-attention map (see :func:`map_rgb`)."""
    return png_bytes(map_rgb(matrix, scale))


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# token labels on a map thumbnail up to this many tokens: a label needs a row of about 12 CSS px to be read (10 px
# type), and 32 × 12 px = 384 px keeps two labelled maps side by side in the report's width; longer texts would
# give rows too thin to label (or maps wider than the page), so their maps stay 140 px and unlabelled
MAX_LABELLED_TOKENS = 32
LABEL_ROW_PX = 12  # the least height of a labelled row / width of a labelled column
THUMB_PX = 140  # the side of an unlabelled thumbnail (and the least side of a labelled one)
LABEL_CHARS = 10  # longer tokens are cut to 9 characters and "…" (the whole token on hover)


def _label(token) -> str:
    text = str(token).strip() or repr(str(token))  # a whitespace token shows as its repr, not as nothing
    short = text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"
    return f"title='{html.escape(str(token), quote=True)}'>{html.escape(short)}"


def map_figure(matrix: torch.Tensor, caption: str, tokens=None) -> str:
    """HTML of one (L, L) map thumbnail (a PNG inlined as a data URI) with its caption; with ``tokens`` (L of them)
    and L <= :data:`MAX_LABELLED_TOKENS`, the keys are labelled along the top (columns) and the queries down the left
    (rows), in a CSS grid around the image: one label per row / column, ``class='key'`` and ``class='query'``."""
    length = torch.as_tensor(matrix).shape[-1]
    image = _data_uri(map_png(matrix))
    alt = html.escape(caption, quote=True)
    if tokens is None or len(tokens) != length or length > MAX_LABELLED_TOKENS:
        return f"<figure><img alt='{alt} map' src='{image}'><figcaption>{html.escape(caption)}</figcaption></figure>"
    cell = max(LABEL_ROW_PX, -(-THUMB_PX // length))  # px per token: at least 12, the image at least 140 px
    side = cell * length
    keys = "".join(f"<span class='key' {_label(token)}</span>" for token in tokens)
    queries = "".join(f"<span class='query' style='grid-row: {row + 2}' {_label(token)}</span>"
                      for row, token in enumerate(tokens))
    return (f"<figure><div class='map' style='grid-template-columns: auto repeat({length}, {cell}px); "
            f"grid-template-rows: auto repeat({length}, {cell}px)'><span class='corner'></span>{keys}"
            f"<img alt='{alt} map' src='{image}' style='width: {side}px; height: {side}px; grid-row: 2 / span "
            f"{length}; grid-column: 2 / span {length}'>{queries}</div>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def legend_html(subject: str) -> str:
    """The one legend of every report: the sign convention, once, with swatches of the palette at -1, 0 and 1 and
    its ramp (a CSS gradient through the same three colours; each half of the palette is a straight line in RGB,
    as a gradient is). ``subject`` says what is scaled."""
    swatches = " ".join(f'<mark class="token" style="background-color: {palette_css(v)}">{name}</mark>'
                        for v, name in ((-1, "negative"), (0, "zero"), (1, "positive")))
    ramp = ", ".join(palette_css(v) for v in (-1, 0, 1))
    return ("<p class='legend'>Colours, Captum's, the same for tokens, maps and overlays: <strong>green</strong> "
            "raises the explained score (positive relevance; in a map, a positive weight), <strong>red</strong> lowers "
            f"it (negative), white is zero. {subject}: {swatches} <span class='ramp-end'>-1</span><span class='ramp' "
            f"style='background: linear-gradient(to right, {ramp})'></span><span class='ramp-end'>+1</span></p>")


def token_heatmap(tokens, scores) -> str:
    """HTML of tokens highlighted by their scores (scaled by the largest |score|), in Captum's colours."""
    unit = scale_to_unit(torch.tensor(scores, dtype=torch.float64)).tolist() if len(scores) else []
    marks = []
    for token, raw, value in zip(tokens, scores, unit):
        marks.append(f'<mark class="token" style="background-color: {captum_colour(value)}" '
                     f'title="{raw:.4g}">{html.escape(str(token))}</mark>')
    return " ".join(marks)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 70em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table.methods td { padding: 0.3em 0.8em; vertical-align: top; } td.method { white-space: nowrap; color: #555; }
mark.token { padding: 0.1em 0.25em; line-height: 2; border-radius: 0.2em; color: black; }
.thumbs { display: flex; flex-wrap: wrap; gap: 1em; } .thumbs figure { margin: 0; text-align: center; }
.thumbs img { width: 140px; height: 140px; image-rendering: pixelated; border: 1px solid #ccc; }
.legend mark { margin-right: 0.5em; } table.settings td { padding: 0.1em 0.8em; } .note { color: #555; }
.ramp { display: inline-block; width: 10em; height: 0.9em; margin: 0 0.3em; vertical-align: middle;
        border: 1px solid #ccc; } .ramp-end { font-size: 0.8em; color: #555; }
.map { display: grid; font-size: 10px; line-height: 1; color: #333; }
.map span { overflow: hidden; white-space: nowrap; }
.thumbs .map img { border: none; outline: 1px solid #ccc; }
.map .key { writing-mode: vertical-rl; transform: rotate(180deg); justify-self: center; align-self: end;
            max-height: 6em; padding-top: 2px; }
.map .query { grid-column: 1; justify-self: end; align-self: center; max-width: 6em; padding-right: 3px; }
"""


def render_html(explanations, *, title: str = "mamba-captum report", settings: dict | None = None) -> str:
    """The report as one HTML string (images inlined as data URIs; no scripts, no external resources)."""
    settings = dict(settings or {})
    if explanations:
        settings = {**explanations[0].settings, **settings}
    settings.setdefault("mamba-captum", __version__)
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in settings.items())
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<table class='settings'>{rows}</table>",
             legend_html("Relevance is scaled per method, and each map, by its largest |value| (hover a token for "
                         "its raw score)")]
    for number, item in enumerate(explanations, start=1):
        parts.append(f"<section class='example'><h2>{number}. {html.escape(item.text)}</h2>"
                     f"<p>Prediction: <b>{html.escape(item.prediction)}</b> (p = {item.probability:.3f}); explained: "
                     f"<b>{html.escape(item.target)}</b> (p = {item.target_probability:.3f}).</p>"
                     "<table class='methods'>")
        for name, scores in item.relevance.items():
            parts.append(f"<tr><td class='method'>{html.escape(METHOD_TITLES.get(name, name))}</td>"
                         f"<td>{token_heatmap(item.shown(), scores)}</td></tr>")
        parts.append("</table>")
        if item.layer_maps:
            tokens = item.shown()
            labelled = len(tokens) <= MAX_LABELLED_TOKENS
            parts.append("<p class='note'>Per-layer implicit attention (channel mean; row = query, column = key"
                         + ("" if labelled else f"; no token labels: {len(tokens)} tokens, more than the "
                            f"{MAX_LABELLED_TOKENS} that fit") + "):</p><div class='thumbs'>")
            for layer, matrix in item.layer_maps.items():
                parts.append(map_figure(matrix, f"layer {layer}", tokens if labelled else None))
            parts.append("</div>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def overlay_rgb(image, relevance) -> torch.Tensor:
    """An image (H, W, 3) in [0, 1] with its (H, W) relevance laid over it in the palette
    (:func:`mamba_captum.palette.palette_rgb`): the palette's green (score 1) where positive, its red (score -1)
    where negative, with opacity 0.75 · |relevance| / its largest |value| (untouched where 0). On a white image
    this is the palette's colour of 0.75 · the scaled score (to within its 1 % lightness steps). Returns
    (H, W, 3) uint8."""
    image = torch.as_tensor(image, dtype=torch.float64)
    relevance = torch.as_tensor(relevance, dtype=torch.float64)
    peak = relevance.abs().max()
    unit = relevance / peak if peak > 0 else relevance
    alpha = (0.75 * unit.abs())[..., None]
    colour = palette_rgb(unit.sign()).double() / 255  # each half of the palette: white -> this end colour
    return ((image * (1 - alpha) + colour * alpha) * 255).round().clamp(0, 255).to(torch.uint8)


IMAGE_STYLE = """
.images { display: flex; flex-wrap: wrap; gap: 1em; } .images figure { margin: 0; text-align: center; }
.images img { width: 224px; height: 224px; image-rendering: pixelated; border: 1px solid #ccc; }
"""


def render_image_html(explanations, *, title: str = "mamba-captum report") -> str:
    """The report of :class:`~mamba_captum.explain.images.ImageExplanation` s as one HTML string: per image, the
    image and one overlay per method (images inlined; no scripts, no external resources)."""
    settings = {**(explanations[0].settings if explanations else {}), "mamba-captum": __version__}
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in settings.items())
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}{IMAGE_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<table class='settings'>{rows}</table>",
             legend_html("Relevance is laid over each image, scaled per method by its largest |value|, opaque "
                         "up to 75 %")]
    for number, item in enumerate(explanations, start=1):
        image = torch.as_tensor(item.image, dtype=torch.float64)
        parts.append(f"<section class='example'><h2>{number}. {html.escape(item.path)}</h2>"
                     f"<p>Prediction: <b>{html.escape(item.prediction)}</b> (p = {item.probability:.3f}); explained: "
                     f"<b>{html.escape(item.target)}</b> (p = {item.target_probability:.3f}).</p><div class='images'>"
                     f"<figure><img alt='the image' src='{_data_uri(png_bytes((image * 255).round().to(torch.uint8)))}'>"
                     "<figcaption>input</figcaption></figure>")
        for name, relevance in item.relevance.items():
            overlay = png_bytes(overlay_rgb(image, relevance))
            parts.append(f"<figure><img alt='{html.escape(name)} overlay' src='{_data_uri(overlay)}'>"
                         f"<figcaption>{html.escape(METHOD_TITLES.get(name, name))}</figcaption></figure>")
        parts.append("</div></section>")
    parts.append("</body></html>")
    return "\n".join(parts)
