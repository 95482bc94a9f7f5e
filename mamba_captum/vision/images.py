"""Image files in, pixel tensors out: the evaluation transform of the official Vim models (DeiT / timm's).

``preprocess(path, img_size=model.img_size)``: the pixels in [0, 1] (every Pillow mode at its own scale: 8-bit,
16-bit, float; transparency composited on white; see ``docs/vision.md``), shorter side resized to
``int(img_size / crop_pct)`` (bicubic), centre crop ``img_size`` (as torchvision's Resize and CenterCrop compute them),
normalised with ImageNet's mean and std -> (1, 3, img_size, img_size) float32. ``to_display`` undoes the
normalisation for ``captum.attr.visualization.visualize_image_attr`` (an (H, W, 3) array in [0, 1]).

What changes what the model sees without being an error (a grayscale image replicated to RGB, an image smaller than
the model's input upscaled) is said with an :class:`ImageNotice` warning, one per image.

Files are bounded before their pixels are decoded: an image over :data:`MAX_PIXELS` pixels, or one whose resize
would make an image over it (a 1 × 30000 strip), is refused with an :class:`ImageError`.
"""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The pixel budget of a decoded image and of a resized one (read at each call: raise it for large files you trust).
# Pillow's default Image.MAX_IMAGE_PIXELS, where it starts warning of decompression bombs, so that what Pillow warns
# about is what the library refuses; ~340 MiB decoded at 4 bytes a pixel.
MAX_PIXELS = 89_478_485
_WHITE = 255  # the background transparent pixels are composited on (8-bit): white, as a page shows them
# Pillow modes by how their values become [0, 1] (docs/vision.md, "Image files")
_CONVERTED = ("1", "L", "RGBX", "CMYK", "YCbCr", "LAB", "HSV")  # Pillow's conversion to 8-bit RGB
_WITH_ALPHA = {"LA": "LA", "La": "LA", "P": "P", "PA": "PA", "RGBA": "RGBA", "RGBa": "RGBA"}  # -> straight alpha
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
# A colour key (PNG's tRNS, a GIF's transparent index read as L): Pillow turns it into alpha for these, as for P
_KEYED = {"1": "LA", "L": "LA", "RGB": "RGBA"}
_SIXTEEN_BIT_MAX = 65535
# Pillow's single-channel modes: the one channel becomes R, G and B (an ImageNotice says so)
_GREY = ("1", "L", "LA", "La", "I", "F", *_SIXTEEN_BIT)


_FILTERS_LOCK = threading.Lock()  # see _open_bounded


class ImageError(ValueError):
    """An image the library will not read: not an image, over the pixel budget, or values it cannot scale to
    [0, 1]. The message names the problem and the fix; the CLI prints it as one line (exit code 2)."""


class ImageNotice(UserWarning):
    """What :func:`preprocess` did to fit an image to the model that changes what the model sees, without being an
    error: a grayscale image's channel copied to R, G and B; an image smaller than the model's input upscaled to
    it. Also :func:`mamba_captum.vision.load_vim` given an ``img_size=`` that differs from the checkpoint's
    ``training.json``. The CLI prints each as one line on stderr; ``warnings.simplefilter("ignore", ImageNotice)``
    silences them."""


def load_image(path):
    """The image at ``path`` as an RGB ``PIL.Image`` (PNG, JPEG, anything Pillow reads), 8 bits a channel.

    Every mode is scaled to its own range (a 16-bit image is rounded to 8 bits, not clipped), transparency is
    composited on white and the EXIF orientation applied; :func:`preprocess` keeps 16-bit and float images at
    full precision.

    Raises:
        TypeError: ``path`` is not a path.
        FileNotFoundError: no file at ``path``.
        ImageError: (a ValueError) the file is not an image, holds more than :data:`MAX_PIXELS` pixels, or values
            outside its mode's range.
    """
    from PIL import Image

    name = repr(_path_or_refused(path, "load_image", "a path (str or os.PathLike)"))
    with _open_bounded(path) as opened:
        image = _scaled(_decoded(opened, name), name)
    if image.mode == "F":
        image = Image.fromarray(np.round(np.asarray(image) * 255).astype(np.uint8)).convert("RGB")
    return image


def preprocess(image, img_size=None, crop_pct: float | None = None, mean=IMAGENET_MEAN, std=IMAGENET_STD, *,
               model=None, size=None):
    """An image (a path or a PIL image) -> normalised pixels (1, 3, H, W), float32.

    ``preprocess(path, model=vim)`` prepares an image for a loaded Vim: its ``img_size`` and ``crop_pct``
    (:func:`load_vim` reads both from the training.json beside a checkpoint). Otherwise ``img_size``: the input
    size, an int or (height, width), default 224; ``crop_pct`` default 0.875 (the official models'); given
    explicitly, either wins over the model's. ``size=`` is ``img_size``'s old name (a FutureWarning).

    As torchvision's ``Resize(int(img_size / crop_pct), BICUBIC)`` then ``CenterCrop(img_size)`` (the official
    evaluation transform): the shorter side to ``int(img_size / crop_pct)``, the longer one truncated in proportion,
    the centre crop's offsets rounded. ``crop_pct=1`` resizes the whole image to ``img_size`` × ``img_size``; a
    non-square ``(height, width)`` (a model trained on non-square images) resizes to it without cropping.

    Before normalisation the pixels are in [0, 1], each Pillow mode at its own scale (16-bit grey by 65535, float
    images as they are; docs/vision.md lists every mode); transparent pixels are composited on white; a file's
    EXIF orientation is applied. A file is checked against :data:`MAX_PIXELS` from its header, before decoding.
    A grayscale image (its channel copied to R, G and B) and one smaller than ``img_size`` on a side (upscaled:
    the model sees interpolated pixels) are accepted with an :class:`ImageNotice` warning.

    Raises:
        TypeError: ``image`` is neither a path nor a PIL image (an array or a tensor).
        FileNotFoundError: no file at the path.
        ImageError: (a ValueError) a file that is not an image, an image over the pixel budget or whose resize
            would be, or values outside the mode's range.
    """
    from PIL import Image

    if size is not None:  # the old name, kept working for a while
        if img_size is not None:
            raise TypeError("mamba_captum: preprocess got img_size= and size=, its old name; give img_size= only.")
        warnings.warn("mamba_captum: preprocess(size=) is now preprocess(img_size=), the name load_vim uses; "
                      "size= will be removed.", FutureWarning, stacklevel=2)
        img_size = size
    if model is not None:
        if not hasattr(model, "img_size") or not hasattr(model, "crop_pct"):
            raise TypeError(f"mamba_captum: preprocess(model=) takes a Vision Mamba (load_vim's), not a "
                            f"{type(model).__name__}; give img_size= (and crop_pct=) instead.")
        img_size = tuple(model.img_size) if img_size is None else img_size
        crop_pct = model.crop_pct if crop_pct is None else crop_pct
    img_size = 224 if img_size is None else img_size
    crop_pct = 0.875 if crop_pct is None else crop_pct
    _check_transform(img_size, crop_pct)
    if isinstance(img_size, tuple) and len(img_size) == 2 and img_size[0] == img_size[1]:
        img_size = int(img_size[0])  # a square model: the shorter-side resize and centre crop, as for an int
    height, width = (img_size, img_size) if isinstance(img_size, int) else (int(img_size[0]), int(img_size[1]))
    if isinstance(image, Image.Image):
        name = "the image"
        _resize_plan(image.size, height, width, crop_pct, name)
        mode = image.mode
        image = _scaled(image, name)
    else:
        name = repr(_path_or_refused(image, "preprocess", "a path (str or os.PathLike) or a PIL.Image.Image"))
        with _open_bounded(image) as opened:
            # from the header, before decoding (an EXIF turn swaps the sides: the resized size is the same)
            _resize_plan(opened.size, height, width, crop_pct, name)
            decoded = _decoded(opened, name)
            mode = decoded.mode
            image = _scaled(decoded, name)
    _notices(name, mode, image.size, height, width, stretched=height != width or crop_pct >= 1)
    resized, crop = _resize_plan(image.size, height, width, crop_pct, name)  # the EXIF orientation applied
    image = image.resize(resized, Image.BICUBIC)
    if crop is not None:
        image = image.crop(crop)
    if image.mode == "F":  # grey, at full precision; bicubic overshoots, as it does (clipped) in 8 bits
        grey = np.clip(np.asarray(image, dtype=np.float32), 0.0, 1.0)
        values = np.repeat(grey[:, :, None], 3, axis=2)
    else:
        values = np.asarray(image, dtype=np.float32) / 255.0
    pixels = torch.from_numpy(values).permute(2, 0, 1)
    pixels = (pixels - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return pixels[None].contiguous()


def is_image_size(value) -> bool:
    """A positive int, or a (height, width) tuple / list of them: what ``img_size`` may be (preprocess, load_vim,
    training.json)."""
    def positive(v):
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    return positive(value) or (isinstance(value, (tuple, list)) and len(value) == 2 and all(map(positive, value)))


def is_crop_pct(value) -> bool:
    """A number in (0, 1] (NaN is not): the share of the resized image the evaluation transform keeps."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def _check_transform(img_size, crop_pct) -> None:
    """``img_size`` a positive int or a (height, width) pair of them; ``crop_pct`` a number in (0, 1]: anything
    else would give pixels of another size than asked (``"224"`` read as a pair of '2's) or a division by zero."""
    if not is_image_size(img_size):
        raise ValueError(f"mamba_captum: preprocess img_size={img_size!r}: give a positive int or (height, width) "
                         "of positive ints (the model's input size, e.g. model.img_size).")
    if not is_crop_pct(crop_pct):
        raise ValueError(f"mamba_captum: preprocess crop_pct={crop_pct!r}: give a number in (0, 1], the share of "
                         "the resized image the centre crop keeps (0.875 for the official models, 1 for no crop).")


def to_display(pixels: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> np.ndarray:
    """Normalised pixels (3, H, W) or (1, 3, H, W) -> an (H, W, 3) array in [0, 1] (for plotting)."""
    if pixels.dim() == 4:
        pixels = pixels[0]
    image = pixels.detach().float().cpu() * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    return image.clamp(0, 1).permute(1, 2, 0).numpy()


def _notices(name, mode, image_size, height, width, stretched=False):
    """An :class:`ImageNotice` for a grayscale image, for one smaller than the model's input, and for one whose
    shape ``stretched`` to the input's (no crop: ``crop_pct=1`` or a non-square input) changes (warned from the
    caller of :func:`preprocess`)."""
    if mode in _GREY:
        warnings.warn(f"mamba_captum: {name} is grayscale (Pillow mode {mode!r}): its channel was copied to R, G and "
                      "B, as the model reads colour images.", ImageNotice, stacklevel=3)
    w, h = image_size
    if w < width or h < height:
        warnings.warn(f"mamba_captum: {name} is {w} × {h} pixels, smaller than the model's input of {width} × "
                      f"{height}: it was upscaled (bicubic), so the model sees interpolated pixels.", ImageNotice,
                      stacklevel=3)
    if stretched and w * height != h * width:  # aspect ratios differ: shapes in it are squashed
        warnings.warn(f"mamba_captum: {name} is {w} × {h} pixels: it was resized to the model's {width} × {height} "
                      "without a crop (crop_pct=1 or a non-square input), so its aspect ratio changed and what it "
                      "shows is stretched; crop it to the model's shape first to avoid that.", ImageNotice,
                      stacklevel=3)


def _path_or_refused(path, function, accepted):
    """``os.fspath(path)``, or a one-line TypeError naming what was given and what ``function`` takes."""
    if isinstance(path, (str, bytes, os.PathLike)):
        return os.fspath(path)
    given = type(path).__qualname__ if type(path).__module__ == "builtins" else \
        f"{type(path).__module__}.{type(path).__qualname__}"
    if hasattr(path, "shape") and hasattr(path, "dtype"):  # numpy, torch: the pixels, not a file
        given += f" of shape {tuple(path.shape)} and dtype {path.dtype}"
    raise TypeError(f"mamba_captum: {function} takes {accepted}, not a {given}; for pixels you already hold, pass "
                    "preprocess a PIL image of them (PIL.Image.fromarray on an (H, W, 3) uint8 array).")


def _open_bounded(path):
    """The file opened (its header read, no pixel decoded), refused over the pixel budget."""
    from PIL import Image, UnidentifiedImageError

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"mamba_captum: no image file at {path!r}.")
    try:
        # Pillow's bomb warning: refused here, not printed under the error. catch_warnings saves and restores the
        # process's filter list: two threads interleaving it would leave this "error" filter behind for good, so
        # the library's own calls take turns (the header read only; decoding runs in parallel)
        with _FILTERS_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise ImageError(f"mamba_captum: {path!r} is too large to decode ({error}); the library reads images of "
                         f"up to {MAX_PIXELS:,} pixels (mamba_captum.vision.images.MAX_PIXELS): downscale it "
                         "first.") from None
    except (UnidentifiedImageError, OSError, ValueError, EOFError, SyntaxError) as error:
        raise ImageError(f"mamba_captum: {path!r} is not an image Pillow can read ({error}).") from None
    width, height = image.size
    if width * height > MAX_PIXELS:
        image.close()
        raise ImageError(f"mamba_captum: {path!r} is {width} × {height} = {width * height:,} pixels, over the "
                         f"budget of {MAX_PIXELS:,} (mamba_captum.vision.images.MAX_PIXELS): downscale it first.")
    return image


def _decoded(opened, name):
    """The pixels of an opened file, turned as its EXIF orientation says (as image viewers show it)."""
    from PIL import ImageOps

    try:
        opened.load()
        return ImageOps.exif_transpose(opened)
    except (OSError, ValueError, EOFError, SyntaxError) as error:  # truncated or corrupt data
        raise ImageError(f"mamba_captum: {name} is not an image Pillow can read ({error}).") from None


def _scaled(image, name):
    """``image`` as Pillow's RGB (8 bits a channel) or F (grey, floats in [0, 1]): each mode at its own scale."""
    mode = image.mode
    key = image.info.get("transparency")
    if key is not None and mode not in _WITH_ALPHA:  # an alpha channel (or P's palette) already says it
        if mode in _KEYED:
            try:
                image, mode = image.convert(_KEYED[mode]), _KEYED[mode]  # composited on white below
            except (ValueError, TypeError) as error:  # a key that is not this mode's colour
                raise ImageError(f"mamba_captum: {name} has a transparent colour {key!r} that Pillow cannot "
                                 f"apply to mode {mode!r} ({error}); composite it yourself and pass the PIL "
                                 "image.") from None
        elif (mode in _SIXTEEN_BIT or mode in ("I", "F")) and isinstance(key, (int, float)):
            return _keyed_on_white(_scaled_opaque(image, name), np.asarray(image) == key)
        else:
            raise ImageError(f"mamba_captum: {name} has Pillow mode {mode!r} with a transparent colour {key!r}, "
                             "which the library does not apply; composite it on a background yourself (or drop "
                             "image.info['transparency']) and pass the PIL image.")
    return _scaled_opaque(image, name)


def _keyed_on_white(grey, transparent):
    """A float grey image (mode F) with its ``transparent`` pixels white (1.0), at full precision."""
    from PIL import Image

    values = np.array(grey, dtype=np.float32)
    values[transparent] = 1.0
    return Image.fromarray(values, "F")


def _scaled_opaque(image, name):
    """:func:`_scaled` past the transparent colour (``info["transparency"]``), which it has applied."""
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _CONVERTED:
        try:
            return image.convert("RGB")
        except (ValueError, ImportError, OSError) as error:  # LAB: Pillow >= 9.4 converts it with littlecms
            raise ImageError(f"mamba_captum: {name} has Pillow mode {mode!r}, which this Pillow cannot convert to "
                             f"RGB ({error}); convert it to RGB yourself (e.g. with PIL.ImageCms) and pass the "
                             "PIL image.") from None
    if mode in _WITH_ALPHA:  # premultiplied modes to straight alpha first: Pillow converts those to RGBA
        rgba = np.asarray(image.convert(_WITH_ALPHA[mode]).convert("RGBA"), dtype=np.uint32)
        colour, alpha = rgba[:, :, :3], rgba[:, :, 3:]
        composited = (colour * alpha + _WHITE * (255 - alpha) + 127) // 255  # rounded to 8 bits
        return Image.fromarray(composited.astype(np.uint8), "RGB")
    if mode in _SIXTEEN_BIT:
        return Image.fromarray(np.asarray(image, dtype=np.float32) / _SIXTEEN_BIT_MAX, "F")
    if mode == "I":
        values = np.asarray(image)
        low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
        if low < 0 or high > _SIXTEEN_BIT_MAX:
            raise ImageError(f"mamba_captum: {name} has Pillow mode 'I' (32-bit integers) with values from {low} "
                             f"to {high}; the library reads mode I as 16-bit (0 to 65535, as Pillow reads 16-bit "
                             "PGM and TIFF files) and Pillow gives no other range: scale it to floats in [0, 1] "
                             "(mode F) yourself and pass the PIL image.")
        return Image.fromarray((values / _SIXTEEN_BIT_MAX).astype(np.float32), "F")
    if mode == "F":
        values = np.asarray(image, dtype=np.float32)
        finite = bool(np.isfinite(values).all())
        if values.size and (not finite or values.min() < 0 or values.max() > 1):
            found = f"from {values.min():g} to {values.max():g}" if finite else "that are NaN or infinite"
            raise ImageError(f"mamba_captum: {name} has Pillow mode 'F' (32-bit floats) with values {found}; "
                             "float images are read as given, in [0, 1]: scale them to [0, 1] first.")
        return image
    raise ImageError(f"mamba_captum: {name} has Pillow mode {mode!r}, which the library does not read; convert it "
                     "to RGB yourself and pass the PIL image.")


def _resize_plan(image_size, height, width, crop_pct, name):
    """The resized (width, height) and the centre crop's box (None: no crop), refused over the pixel budget."""
    w, h = image_size
    if w < 1 or h < 1:
        raise ImageError(f"mamba_captum: {name} has no pixels ({w} × {h}).")
    if height != width or crop_pct >= 1:
        resized, crop, how = (width, height), None, f"resizing it to {width} × {height}"
    else:
        scale = int(height / crop_pct)
        resized = (scale, int(scale * h / w)) if w <= h else (int(scale * w / h), scale)
        top, left = int(round((resized[1] - height) / 2.0)), int(round((resized[0] - width) / 2.0))
        crop, how = (left, top, left + width, top + height), f"resizing its shorter side to {scale}"
    if resized[0] * resized[1] > MAX_PIXELS:  # an extreme aspect ratio (1 × 30000) or an extreme size asked for
        raise ImageError(f"mamba_captum: {name} is {w} × {h} pixels: {how} would make a {resized[0]} × "
                         f"{resized[1]} image, over the budget of {MAX_PIXELS:,} pixels "
                         "(mamba_captum.vision.images.MAX_PIXELS); crop it nearer to the model's shape first.")
    return resized, crop
