"""The one colour language of everything mamba-captum draws (the HTML report's tokens, its map thumbnails and legends,
the Vim overlays, the ``mamba-captum matrices`` PNGs, the TensorBoard maps): Captum's own.

Green is positive (raises the explained score; a positive weight), red is negative (lowers it; a negative weight),
white is zero. The colour of a score in [-1, 1] is the one Captum's ``visualize_text`` gives a token
(``captum.attr._utils.visualization._get_color``: ``hsl(120, 75%, 100 - int(50·s)%)`` for s > 0,
``hsl(0, 75%, 100 - int(-40·s)%)`` otherwise), so a token and a map entry of the same score have the same colour.
Captum's ``visualize_image_attr(sign="all")`` speaks the same language with another ramp (``red -> white -> green``,
pure red (255, 0, 0) to (0, 128, 0)); the text ramp is the one kept, since the report's token colours must be
Captum's exactly. Each half of the ramp is a straight line in RGB from white to its end colour (the lightness is
linear in the score), so a CSS ``linear-gradient`` through the colours at -1, 0 and 1 shows the same ramp.
"""
from __future__ import annotations

import math

import torch

SATURATION = 75  # percent, Captum's
POSITIVE_HUE, NEGATIVE_HUE = 120, 0  # green, red


def _lightness(unit: torch.Tensor) -> torch.Tensor:
    """Captum's lightness (percent, integer) of scores already clipped to [-1, 1]: the one formula of the palette."""
    unit = unit.double()
    return torch.where(unit > 0, 100 - torch.trunc(50 * unit), 100 - torch.trunc(-40 * unit)).long()


def palette_hsl(score: float) -> tuple[int, int, int]:
    """(hue in degrees, saturation %, lightness %) of a score (clipped to [-1, 1]), as Captum's ``_get_color``."""
    score = float(score)
    # Python's clip, as Captum's; a NaN has no sign: white, as palette_rgb draws it (Captum's clip makes it 1)
    score = 0.0 if math.isnan(score) else max(-1.0, min(1.0, score))
    hue = POSITIVE_HUE if score > 0 else NEGATIVE_HUE
    return hue, SATURATION, int(_lightness(torch.tensor(score, dtype=torch.float64)))


def palette_css(score: float) -> str:
    """The CSS colour of a score: the very string Captum's ``visualize_text`` writes (``"hsl(120, 75%, 75%)"``)."""
    hue, saturation, lightness = palette_hsl(score)
    return f"hsl({hue}, {saturation}%, {lightness}%)"


def palette_rgb(scores) -> torch.Tensor:
    """Scores (any shape, clipped to [-1, 1]; NaN drawn as 0) -> (..., 3) uint8 RGB: the colour of
    :func:`palette_css`, converted from HSL exactly (rounded half up): -1 -> (230, 77, 77), 0 -> (255, 255, 255),
    1 -> (32, 223, 32)."""
    # float64 from the start: a Python float read as float32 could land on the other side of a lightness step
    unit = torch.as_tensor(scores, dtype=torch.float64).detach().cpu()
    unit = torch.nan_to_num(unit, nan=0.0).clamp(-1, 1)
    lightness = _lightness(unit)
    # HSL -> RGB at saturation 3/4 and lightness l >= 50%: the hue's channel is 255·(l + 300)/400, the others
    # 255·(7l - 300)/400; in integers (x.5 rounds up) so that no float error decides a half
    high = (255 * (lightness + 300) * 2 + 400) // 800
    low = (255 * (7 * lightness - 300) * 2 + 400) // 800
    green = torch.stack([low, high, low], -1)
    red = torch.stack([high, low, low], -1)
    return torch.where((unit > 0)[..., None], green, red).to(torch.uint8)
