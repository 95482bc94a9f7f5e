"""One self-contained HTML file (no scripts, no network) for a list of :class:`~mamba_captum.explain.Explanation`:
a token heatmap per method in Captum's colours, the prediction, per-layer map thumbnails, the settings.

Also a dependency-free PNG writer for the implicit-attention maps (``map_png``), used by ``mamba-captum matrices``.
"""
from __future__ import annotations

import base64
import html
import struct
import zlib

import torch

from ._version import __version__
from .viz import scale_to_unit

METHOD_TITLES = {"raw": "Raw attention (MambaRawAttention)", "rollout": "Attention rollout (MambaRollout)",
                 "attribution": "Mamba-Attribution (MambaAttribution)",
                 "selection": "Selection-aware attribution (MambaSelectionAttribution)", "lrp": "MambaLRP (MambaLRP)"}


def captum_colour(score: float) -> str:
    """The CSS colour Captum's ``visualize_text`` gives a score in [-1, 1]: green for positive, red for negative
    (the same formula as ``captum.attr._utils.visualization._get_color``; the tests compare the two)."""
    score = max(-1.0, min(1.0, float(score)))
    if score > 0:
        return f"hsl(120, 75%, {100 - int(50 * score)}%)"
    return f"hsl(0, 75%, {100 - int(-40 * score)}%)"


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
    """(L, L) map -> (L·scale, L·scale, 3) uint8: white at 0, red for positive, blue for negative entries, each
    divided by the largest |entry| (a signed map stays signed; the causal upper triangle is white)."""
    matrix = torch.as_tensor(matrix).detach().double().cpu()
    peak = matrix.abs().max()
    unit = (matrix / peak if peak > 0 else matrix).clamp(-1, 1)
    fade = (1 - unit.abs()) * 255
    red = torch.where(unit >= 0, torch.full_like(unit, 255.0), fade)
    blue = torch.where(unit <= 0, torch.full_like(unit, 255.0), fade)
    rgb = torch.stack([red, fade, blue], -1).round().to(torch.uint8)
    if scale > 1:
        rgb = rgb.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return rgb


def map_png(matrix: torch.Tensor, scale: int = 1) -> bytes:
    """A PNG file of an (L, L) implicit-attention map (see :func:`map_rgb`)."""
    return png_bytes(map_rgb(matrix, scale))


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


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
"""


def render_html(explanations, *, title: str = "mamba-captum report", settings: dict | None = None) -> str:
    """The report as one HTML string (images inlined as data URIs; no scripts, no external resources)."""
    settings = dict(settings or {})
    if explanations:
        settings = {**explanations[0].settings, **settings}
    settings.setdefault("mamba-captum", __version__)
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in settings.items())
    legend = " ".join(f'<mark class="token" style="background-color: {captum_colour(v)}">{name}</mark>'
                      for v, name in ((-1, "negative"), (0, "neutral"), (1, "positive")))
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             f"<table class='settings'>{rows}</table>",
             f"<p class='legend'>Relevance, scaled per method by its largest |value| (hover a token for the raw "
             f"score): {legend}</p>"]
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
            parts.append("<p class='note'>Per-layer implicit attention (channel mean; row = query, column = key; "
                         "red positive, blue negative):</p><div class='thumbs'>")
            for layer, matrix in item.layer_maps.items():
                parts.append(f"<figure><img alt='layer {layer} map' src='{_data_uri(map_png(matrix))}'>"
                             f"<figcaption>layer {layer}</figcaption></figure>")
            parts.append("</div>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def overlay_rgb(image, relevance) -> torch.Tensor:
    """An image (H, W, 3) in [0, 1] with its (H, W) relevance laid over it: red for positive, blue for negative,
    opacity growing with |relevance| / its largest |value| (at most 0.75). Returns (H, W, 3) uint8."""
    image = torch.as_tensor(image, dtype=torch.float64)
    relevance = torch.as_tensor(relevance, dtype=torch.float64)
    peak = relevance.abs().max()
    unit = relevance / peak if peak > 0 else relevance
    alpha = (0.75 * unit.abs())[..., None]
    colour = torch.where(unit[..., None] >= 0, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
                         torch.tensor([0.0, 0.2, 1.0], dtype=torch.float64))
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
             "<p class='legend'>Relevance laid over each image, scaled per method by its largest |value|: "
             "<mark class='token' style='background-color: rgb(255, 64, 64)'>positive</mark> "
             "<mark class='token' style='background-color: rgb(64, 96, 255)'>negative</mark></p>"]
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
