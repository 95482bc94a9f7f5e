"""One self-contained HTML file (no scripts, no network) for a list of :class:`~mamba_captum.explain.Explanation`:
a token heatmap per method, the prediction, per-layer map thumbnails (token labels on short texts), the settings,
paragraphs on what its numbers are (:func:`reading_notes`: p, the query token, each method's scale) and, under a text,
its words that became the tokenizer's unknown token. :func:`probability_text` writes every probability it shows.

Also a dependency-free PNG writer for the implicit-attention maps (``map_png``), used by ``mamba-captum matrices``.
Tokens, maps, overlays and legends all speak one colour language, Captum's (:mod:`mamba_captum.palette`): green
positive, red negative, white zero.
"""
from __future__ import annotations

import base64
import html
import re
import struct
import zlib

import torch

from ._version import __version__
from .palette import palette_css, palette_rgb
from .tokens import word_listing
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


def probability_text(p: float) -> str:
    """``p = 0.873``; a probability that three decimals would show as 1.000 or 0.000 as ``p > 0.999`` / ``p < 0.001``
    (a trained classifier is often that sure, and "1.000" reads as certainty it does not have). Every probability the
    reports show, and the CLI prints, is written by this."""
    if p >= 0.9995:
        return "p > 0.999"
    if p < 0.0005:
        return "p < 0.001"
    return f"p = {p:.3f}"


def _probability_html(p: float) -> str:
    return html.escape(probability_text(p))


SATURATION = ('"p > 0.999" (or "p < 0.001") means saturated: the probability rounds to 1 (or 0) at three decimals, '
              "as it often does for a trained model on a text it has learnt; it says which label, not how sure a "
              "person would be (the methods read the model's scores, not p).")

# each method's scale, as its class computes it with explain()'s settings (attribution: the recipe its default
# resolved to, settings["attribution_recipe"]: "relevance", |MambaLRP|, or "product"): raw is the
# layer mean of the query's row of A (attr/raw_attention.py), signed; rollout, attribution and selection read the
# query's row of a product of row-normalised non-negative matrices (attr/_rollout.py rollout_step), so it is >= 0
# and sums to 1; MambaLRP's relevance sums to the explained logit less the biases' share (attr/lrp.py)
SHARE_METHODS = ("rollout", "attribution", "selection")
METHOD_SCALES = {
    "raw": "raw is the query's row of the implicit attention, averaged over the layers (the model's own mixing "
           "weights, signed)",
    "shares": "{names} (each text's scores are >= 0 and sum to 1)",
    "lrp": "lrp is in logit units (its scores, signed, sum to the explained logit less the biases' share{larger})",
    "relevance": "attribution is the magnitude of MambaLRP's relevance, in logit units (>= 0; MambaAttribution's "
                 "default recipe on this model)",
}
SHOWN_NAMES = 10  # label words / class names a paragraph lists; the rest are counted


def _names(words, quote: bool) -> str:
    words = [repr(str(w)) if quote else str(w) for w in words]
    more = len(words) - SHOWN_NAMES
    return ", ".join(words[:SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")


def _is_classifier(settings: dict) -> bool:
    return str(settings.get("model_class", "")).endswith("ForSequenceClassification")  # as explain's is_classifier


def probability_meaning(settings: dict) -> str:
    """What p is for the explanations made with ``settings`` (an :class:`~mamba_captum.explain.Explanation`'s:
    ``model_class`` and ``labels``, as :func:`mamba_captum.explain.explain` sets them): the softmax of the model's
    scores over the classifier's classes, the label words, or the whole vocabulary."""
    labels = settings.get("labels")
    if _is_classifier(settings):
        return "the softmax of the classifier's scores over its classes" + (
            f" ({_names(labels, quote=False)})" if labels else "")
    if labels:
        return f"the softmax of the next-token scores at the query over the label words only ({_names(labels, True)})"
    if "model_class" in settings:
        return "the softmax of the next-token scores at the query over the whole vocabulary"
    return "the softmax of the model's scores over its possible answers"


def reading_notes(explanations, settings: dict | None = None) -> list[str]:
    """The report's plain-text paragraphs on its numbers: what p is, that ``p > 0.999`` means saturated, which token
    is the query, and the scale of each method the ``explanations`` hold (see :data:`METHOD_SCALES`). ``settings``
    defaults to the first explanation's. Returns a list of strings (not HTML)."""
    settings = dict(explanations[0].settings if explanations and settings is None else settings or {})
    notes = [f"p is the probability of the predicted label (and of the explained one, when another was asked for): "
             f"{probability_meaning(settings)}. {SATURATION}"]
    last = {item.shown()[-1] for item in explanations if item.shown()}
    query = f"The query is the last token of each text{f' (here {next(iter(last))})' if len(last) == 1 else ''}"
    if "model_class" in settings and not _is_classifier(settings):  # explain() takes causal LMs and classifiers
        notes.append(f"{query}: this causal LM's next-token scores there are its answer, so every method explains "
                     "that position, and the query itself gets a score too.")
    else:
        notes.append(f"{query}: the position whose output every method explains.")
    methods = list(dict.fromkeys(name for item in explanations for name in item.relevance))
    relevance = settings.get("attribution_recipe") == "relevance" and "attribution" in methods
    shares = [name for name in SHARE_METHODS if name in methods and not (relevance and name == "attribution")]
    scales = [METHOD_SCALES["raw"]] if "raw" in methods else []
    if relevance:
        scales.append(METHOD_SCALES["relevance"])
    if shares:
        names = f"{shares[0]} is a share" if len(shares) == 1 else \
            f"{', '.join(shares[:-1])} and {shares[-1]} are shares"
        scales.append(METHOD_SCALES["shares"].format(names=names))
    if "lrp" in methods:
        scales.append(METHOD_SCALES["lrp"].format(larger=", so they are often much larger than the shares"
                                                  if shares else ""))
    if scales:
        notes.append("The methods' numbers (hover a token to read its score): " + "; ".join(scales) + ".")
    return notes


def unknown_words_note(item) -> str | None:
    """The note under a text's heading when words of it became the tokenizer's unknown token (``item``'s
    ``unknown_words`` / ``unknown_token``, :class:`~mamba_captum.explain.Explanation`), or None: plain text."""
    words = list(getattr(item, "unknown_words", None) or [])
    if not words:
        return None
    token = getattr(item, "unknown_token", None) or "the unknown token"
    count = len(words)
    known = [word for word in words if word is not None]
    named = ": " + word_listing(known, shown=None) if known else " (this tokenizer gives no offsets to name them)"
    return (f"{count} word{'s' if count > 1 else ''} not in the tokenizer's vocabulary became {token}{named}; the "
            f"model saw, and the methods score, {token} in {'its' if count == 1 else 'their'} place.")


def _paragraphs(notes) -> list[str]:
    """``notes`` (one string, or a list of them) as plain-text paragraphs: a blank line starts a new one."""
    notes = [notes] if isinstance(notes, str) else list(notes or ())
    return [" ".join(block.split()) for note in notes for block in re.split(r"\n\s*\n", str(note)) if block.strip()]


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 70em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table.methods td { padding: 0.3em 0.8em; vertical-align: top; } td.method { white-space: nowrap; color: #555; }
mark.token { padding: 0.1em 0.25em; line-height: 2; border-radius: 0.2em; color: black; }
.thumbs { display: flex; flex-wrap: wrap; gap: 1em; } .thumbs figure { margin: 0; text-align: center; }
.thumbs img { width: 140px; height: 140px; image-rendering: pixelated; border: 1px solid #ccc; }
.legend mark { margin-right: 0.5em; } table.settings td { padding: 0.1em 0.8em; } .note { color: #555; }
.reading p, .preamble { max-width: 60em; } .note.unknown { color: #8a4b00; }
.ramp { display: inline-block; width: 10em; height: 0.9em; margin: 0 0.3em; vertical-align: middle;
        border: 1px solid #ccc; } .ramp-end { font-size: 0.8em; color: #555; }
.map { display: grid; font-size: 10px; line-height: 1; color: #333; }
.map span { overflow: hidden; white-space: nowrap; }
.thumbs .map img { border: none; outline: 1px solid #ccc; }
.map .key { writing-mode: vertical-rl; transform: rotate(180deg); justify-self: center; align-self: end;
            max-height: 6em; padding-top: 2px; }
.map .query { grid-column: 1; justify-self: end; align-self: center; max-width: 6em; padding-right: 3px; }
"""


def render_html(explanations, *, title: str = "mamba-captum report", settings: dict | None = None,
                notes=()) -> str:
    """The report as one HTML string (images inlined as data URIs; no scripts, no external resources).

    Args:
        explanations: :class:`~mamba_captum.explain.Explanation` s, one section each.
        title: the page's title and heading.
        settings: rows added to (or replacing) the first explanation's settings in the settings table.
        notes: plain text shown under the title, before the report's own paragraphs on its numbers
            (:func:`reading_notes`): one string or a list of them, a blank line starting a new paragraph; escaped.
    """
    settings = dict(settings or {})
    if explanations:
        settings = {**explanations[0].settings, **settings}
    settings.setdefault("mamba-captum", __version__)
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in settings.items())
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             *(f"<p class='preamble'>{html.escape(text)}</p>" for text in _paragraphs(notes)),
             f"<table class='settings'>{rows}</table>",
             "<div class='reading'>" + "".join(f"<p>{html.escape(text)}</p>"
                                               for text in reading_notes(explanations, settings)) + "</div>",
             legend_html("Relevance is scaled per method, and each map, by its largest |value| (hover a token for "
                         "its raw score)")]
    for number, item in enumerate(explanations, start=1):
        unknown = unknown_words_note(item)
        parts.append(f"<section class='example'><h2>{number}. {html.escape(item.text)}</h2>"
                     + (f"<p class='note unknown'>{html.escape(unknown)}</p>" if unknown else "")
                     + f"<p>Prediction: <b>{html.escape(item.prediction)}</b> ({_probability_html(item.probability)}); "
                     f"explained: <b>{html.escape(item.target)}</b> ({_probability_html(item.target_probability)}).</p>"
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
             "<div class='reading'><p>p is the probability of the predicted class (and of the explained one, when "
             "another was asked for): the softmax of the model's scores over its classes. "
             f"{html.escape(SATURATION)}</p></div>",
             legend_html("Relevance is laid over each image, scaled per method by its largest |value|, opaque "
                         "up to 75 %")]
    for number, item in enumerate(explanations, start=1):
        image = torch.as_tensor(item.image, dtype=torch.float64)
        parts.append(f"<section class='example'><h2>{number}. {html.escape(item.path)}</h2>"
                     f"<p>Prediction: <b>{html.escape(item.prediction)}</b> ({_probability_html(item.probability)}); "
                     f"explained: <b>{html.escape(item.target)}</b> ({_probability_html(item.target_probability)})."
                     "</p><div class='images'>"
                     f"<figure><img alt='the image' src='{_data_uri(png_bytes((image * 255).round().to(torch.uint8)))}'>"
                     "<figcaption>input</figcaption></figure>")
        for name, relevance in item.relevance.items():
            overlay = png_bytes(overlay_rgb(image, relevance))
            parts.append(f"<figure><img alt='{html.escape(name)} overlay' src='{_data_uri(overlay)}'>"
                         f"<figcaption>{html.escape(METHOD_TITLES.get(name, name))}</figcaption></figure>")
        parts.append("</div></section>")
    parts.append("</body></html>")
    return "\n".join(parts)
