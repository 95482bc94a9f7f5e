"""Image files and PIL images into pixels (mamba_captum.vision.images): every Pillow mode at its own scale, in
[0, 1] before normalisation; the pixel budget, checked from the header before decoding; and both through the CLI
(one line, exit code 2). The images are built here, a few pixels each, with values whose expected [0, 1] form is
written out by hand (LAB: the sRGB colours it was made from, to its 8-bit quantisation)."""
import io
import struct
import zlib

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageCms
from test_cli import one_error_line, run_main
from tiny_models import make_vim

import mamba_captum.vision.images as images
from mamba_captum.vision import IMAGENET_MEAN, IMAGENET_STD, load_image, preprocess

EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True, database=None)
# grey and tiny images are what these tests read: preprocess's notices about them are tested in test_vim_cli.py
pytestmark = pytest.mark.filterwarnings("ignore::mamba_captum.vision.ImageNotice")


def unnormalised(pixels: torch.Tensor) -> numpy.ndarray:
    """(1, 3, H, W) normalised pixels -> (H, W, 3) values in [0, 1], as they were before the normalisation."""
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    return (pixels[0] * std + mean).permute(1, 2, 0).numpy()


def loaded(image) -> numpy.ndarray:
    """The [0, 1] pixels of an image (a PIL image or a file), with the resize to its own size (no resampling)."""
    if not isinstance(image, Image.Image):
        with Image.open(image) as opened:
            width, height = opened.size
    else:
        width, height = image.size
    return unnormalised(preprocess(image, img_size=(height, width), crop_pct=1.0))


def grey(values) -> numpy.ndarray:
    values = numpy.asarray(values, dtype=numpy.float64)
    return numpy.repeat(values[..., None], 3, axis=-1)


def saved(image, tmp_path, name, **options):
    path = tmp_path / name
    image.save(path, **options)
    return path


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` × ``height`` 1-bit pixels and holds none (an empty IDAT): a header Pillow reads,
    pixels it cannot decode, so an error about decoding means the size was not checked first."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def on_white(colour, alpha):
    """Colour with alpha (0..255) on a white background, rounded to 8 bits, in [0, 1]."""
    return (colour * alpha + 255 * (255 - alpha) + 127) // 255 / 255


# -- every mode at its own scale ----------------------------------------------------------------------------------
RAMP = numpy.round(numpy.linspace(0, 65535, 64)).astype(numpy.uint16).reshape(2, 32)  # a 16-bit ramp, 0 to 65535


def cases(tmp_path):
    """(label, image or file, expected (H, W, 3) values in [0, 1]) for every mode Pillow opens or builds."""
    palette = Image.new("P", (3, 1))
    palette.putpalette([255, 0, 0, 0, 0, 255, 10, 20, 30])
    palette.putdata([0, 1, 2])
    palette.info["transparency"] = 1  # entry 1 (blue) transparent
    palette_expected = numpy.array([[[1, 0, 0], [1, 1, 1], [10 / 255, 20 / 255, 30 / 255]]])
    palette_alpha = Image.frombytes("PA", (2, 1), bytes([0, 51, 2, 255]))
    palette_alpha.putpalette([200, 0, 100, 0, 0, 0, 10, 20, 30])
    rgba = numpy.array([[[200, 0, 100, 51], [10, 20, 30, 255], [9, 9, 9, 0]]], dtype=numpy.uint8)
    rgba_expected = on_white(rgba[..., :3].astype(int), rgba[..., 3:].astype(int))
    lab_rgb = Image.fromarray(numpy.array([[[0, 0, 0], [255, 255, 255], [128, 128, 128], [200, 100, 50]]],
                                          numpy.uint8))  # colours that 8-bit L*a*b* holds to a unit or two
    srgb, lab = ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB")
    lab_image = ImageCms.applyTransform(lab_rgb, ImageCms.buildTransform(srgb, lab, "RGB", "LAB"))
    cmyk = Image.fromarray(numpy.array([[[0, 100, 255, 0], [0, 0, 0, 255], [0, 0, 0, 0]]], numpy.uint8), "CMYK")
    cmyk_expected = numpy.array([[[1, 155 / 255, 0], [0, 0, 0], [1, 1, 1]]])
    big = cmyk.resize((24, 8), Image.NEAREST)  # flat 8×8 blocks: JPEG keeps them to a unit or two
    floats = numpy.array([[0.0, 0.125, 1 / 3, 1.0]], dtype=numpy.float32)
    pgm = tmp_path / "sixteen.pgm"
    pgm.write_bytes(b"P5 3 1 65535\n" + numpy.array([0, 1000, 65535], dtype=">u2").tobytes())
    return [
        ("1", Image.fromarray(numpy.array([[True, False, True]])), grey([[1, 0, 1]])),
        ("1 PNG", saved(Image.fromarray(numpy.array([[False, True]])), tmp_path, "bits.png"), grey([[0, 1]])),
        ("L", Image.fromarray(numpy.array([[0, 51, 255]], numpy.uint8)), grey([[0, 0.2, 1]])),
        ("LA", Image.fromarray(numpy.array([[[200, 51], [0, 0], [10, 255]]], numpy.uint8), "LA"),
         grey([[244 / 255, 1, 10 / 255]])),
        ("La", Image.frombytes("La", (3, 1), bytes([40, 51, 0, 0, 10, 255])), grey([[244 / 255, 1, 10 / 255]])),
        ("P + transparency", palette, palette_expected),
        ("P + transparency PNG", saved(palette, tmp_path, "palette.png"), palette_expected),
        ("P + transparency GIF", saved(palette, tmp_path, "palette.gif"), palette_expected),
        ("PA", palette_alpha, numpy.array([[[244 / 255, 204 / 255, 224 / 255], [10 / 255, 20 / 255, 30 / 255]]])),
        ("RGB", Image.fromarray(rgba[..., :3]), rgba[..., :3] / 255),
        ("RGBA", Image.fromarray(rgba, "RGBA"), rgba_expected),
        ("RGBA PNG", saved(Image.fromarray(rgba, "RGBA"), tmp_path, "rgba.png"), rgba_expected),
        ("RGBa", Image.frombytes("RGBa", (2, 1), bytes([40, 0, 20, 51, 10, 20, 30, 255])),
         numpy.array([[[244 / 255, 204 / 255, 224 / 255], [10 / 255, 20 / 255, 30 / 255]]])),
        ("RGBX", Image.fromarray(rgba, "RGBA").convert("RGBX"), rgba[..., :3] / 255),
        ("CMYK", cmyk, cmyk_expected),
        ("CMYK TIFF", saved(cmyk, tmp_path, "cmyk.tif"), cmyk_expected),
        ("YCbCr", Image.fromarray(numpy.array([[[255, 128, 128], [0, 128, 128], [128, 128, 128]]], numpy.uint8),
                                  "YCbCr"), grey([[1, 0, 128 / 255]])),
        ("HSV", Image.fromarray(numpy.array([[[0, 0, 255], [0, 255, 255], [85, 255, 255], [170, 255, 255]]],
                                            numpy.uint8), "HSV"),
         numpy.array([[[1, 1, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1]]])),
        ("LAB", lab_image, numpy.asarray(lab_rgb) / 255),
        ("I;16 PNG", saved(Image.fromarray(RAMP), tmp_path, "ramp.png"), grey(RAMP / 65535)),
        ("I;16 TIFF", saved(Image.fromarray(RAMP), tmp_path, "ramp.tif"), grey(RAMP / 65535)),
        *[(mode, Image.frombytes(mode, (32, 2), RAMP.astype(order).tobytes()), grey(RAMP / 65535))
          for mode, order in (("I;16", "<u2"), ("I;16L", "<u2"), ("I;16B", ">u2"), ("I;16N", "=u2"))],
        ("I", Image.fromarray(RAMP.astype(numpy.int32)), grey(RAMP / 65535)),
        ("I PGM (16-bit)", pgm, grey([[0, 1000 / 65535, 1]])),
        ("F", Image.fromarray(floats), grey(floats)),
        ("F TIFF", saved(Image.fromarray(floats), tmp_path, "floats.tif"), grey(floats)),
        ("CMYK JPEG", saved(big, tmp_path, "cmyk.jpg", quality=100), numpy.repeat(cmyk_expected, 8, 1).repeat(8, 0)),
    ]


def test_every_pillow_mode_gives_its_values_at_its_own_scale(tmp_path):
    """The hostile probe's case among them: a 16-bit ramp PNG gave 99.6 % white through convert("RGB")."""
    wrong = []
    for label, image, expected in cases(tmp_path):
        tolerance = 2 / 255 if "JPEG" in label or label == "LAB" else 1e-6  # lossy; 8-bit L*a*b*
        got = loaded(image)
        if got.shape != expected.shape or not numpy.allclose(got, expected, atol=tolerance, rtol=0):
            wrong.append(f"{label}: {numpy.round(got[0, :4] * 255, 1).tolist()} != "
                         f"{numpy.round(expected[0, :4] * 255, 1).tolist()}")
    assert not wrong, "\n".join(wrong)


def test_load_image_rounds_a_16_bit_ramp_to_8_bits_instead_of_clipping(tmp_path):
    got = numpy.asarray(load_image(saved(Image.fromarray(RAMP), tmp_path, "ramp.png")))
    assert got.shape == (2, 32, 3) and (got == numpy.round(RAMP / 257).astype(numpy.uint8)[..., None]).all()


@pytest.mark.parametrize("image, message", [
    (Image.fromarray(numpy.array([[0, 70000]], numpy.int32)), "mode 'I' (32-bit integers) with values from 0 to 70000"),
    (Image.fromarray(numpy.array([[-1, 10]], numpy.int32)), "values from -1 to 10"),
    (Image.fromarray(numpy.array([[0.0, 2.0]], numpy.float32)), "mode 'F' (32-bit floats) with values from 0 to 2"),
    (Image.fromarray(numpy.array([[-0.5, 1.0]], numpy.float32)), "values from -0.5 to 1"),
    (Image.fromarray(numpy.array([[numpy.nan, 1.0]], numpy.float32)), "values that are NaN or infinite"),
])
def test_integer_and_float_images_outside_their_range_are_refused_in_one_line(image, message):
    with pytest.raises(images.ImageError) as refused:
        preprocess(image)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert isinstance(refused.value, ValueError)


# -- a transparent colour (PNG's tRNS) composited on white, as an alpha channel is ------------------------------
def keyed(mode, values, key):
    """An image of ``values`` in ``mode`` whose colour ``key`` is transparent (Pillow's info["transparency"])."""
    image = Image.fromarray(values, "CMYK") if mode == "CMYK" else Image.fromarray(values)
    assert image.mode == mode
    image.info["transparency"] = key
    return image


KEYED = [  # (label, image with a transparent colour, save it as PNG?, expected [0, 1] values)
    ("L PNG", keyed("L", numpy.array([[0, 51, 255]], numpy.uint8), 51), True, grey([[0, 1, 1]])),
    ("L", keyed("L", numpy.array([[0, 51, 255]], numpy.uint8), 0), False, grey([[1, 0.2, 1]])),
    ("1 PNG", keyed("1", numpy.array([[False, True]]), 0), True, grey([[1, 1]])),
    ("RGB PNG", keyed("RGB", numpy.array([[[200, 0, 100], [10, 20, 30]]], numpy.uint8), (10, 20, 30)), True,
     numpy.array([[[200 / 255, 0, 100 / 255], [1, 1, 1]]])),
    ("I;16 PNG", keyed("I;16", numpy.array([[0, 1000, 65535]], numpy.uint16), 1000), True, grey([[0, 1, 1]])),
    ("I", keyed("I", numpy.array([[0, 1000, 30000]], numpy.int32), 30000), False, grey([[0, 1000 / 65535, 1]])),
    ("F", keyed("F", numpy.array([[0.0, 0.25, 0.5]], numpy.float32), 0.25), False, grey([[0, 1, 0.5]])),
]


@pytest.mark.parametrize("label, image, as_file, expected", KEYED, ids=[case[0] for case in KEYED])
def test_a_transparent_colour_is_composited_on_white(tmp_path, label, image, as_file, expected):
    """The probe: L, RGB and 1 with tRNS came out black where LA, P + tRNS and RGBA came out white."""
    source = saved(image, tmp_path, "keyed.png", transparency=image.info["transparency"]) if as_file else image
    got = loaded(source)
    assert got.shape == expected.shape and numpy.allclose(got, expected, atol=1e-6, rtol=0), got[0] * 255
    if as_file:  # load_image: the same pixels, 8 bits a channel
        assert (numpy.asarray(load_image(source)) == numpy.round(expected * 255).astype(numpy.uint8)).all()


@pytest.mark.parametrize("mode, key", [("L", 0), ("RGB", (0, 0, 0)), ("1", 0), ("I;16", 0)])
def test_a_fully_transparent_file_is_white_whatever_its_mode(tmp_path, mode, key):
    path = saved(Image.new(mode, (8, 8)), tmp_path, "clear.png", transparency=key)
    assert (unnormalised(preprocess(path, img_size=32)) == 1.0).all()


def test_a_transparent_colour_on_a_mode_without_one_is_refused_in_one_line():
    """CMYK has no transparent colour in Pillow: a key set on one is refused, not silently ignored."""
    image = keyed("CMYK", numpy.zeros((1, 2, 4), numpy.uint8), 0)
    with pytest.raises(images.ImageError, match=r"mode 'CMYK' with a transparent colour 0") as refused:
        preprocess(image)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("function", [preprocess, load_image])
@pytest.mark.parametrize("given, named", [
    (numpy.zeros((8, 8, 3), numpy.uint8), "not a numpy.ndarray of shape (8, 8, 3) and dtype uint8"),
    (torch.zeros(3, 8, 8), "not a torch.Tensor of shape (3, 8, 8) and dtype torch.float32"),
])
def test_an_array_or_tensor_for_a_path_is_refused_in_one_line(function, given, named):
    with pytest.raises(TypeError) as refused:
        function(given)
    message = str(refused.value)
    assert message.startswith(f"mamba_captum: {function.__name__} takes a path") and named in message
    assert "PIL.Image.fromarray" in message and "\n" not in message


def test_a_files_exif_orientation_is_applied(tmp_path):
    """A phone photo stored sideways with orientation 6 (rotate 90° clockwise to view) is read as it is viewed."""
    stored = numpy.arange(6, dtype=numpy.uint8).reshape(2, 3) * 50
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[0x0112] = 6
    got = unnormalised(preprocess(saved(image, tmp_path, "sideways.png", exif=exif), img_size=(3, 2), crop_pct=1.0))
    assert numpy.allclose(got, grey(numpy.rot90(stored, -1) / 255), atol=1e-6)  # 3 high, 2 wide: no resampling


# -- property: random pixels of every lossless mode -----------------------------------------------------------------
def _reference(mode, values, palette):
    """The expected [0, 1] pixels, from the mode's definition (not Pillow's conversion)."""
    if mode == "1":
        return grey(values)
    if mode in ("L", "RGB"):
        return grey(values / 255) if mode == "L" else values / 255
    if mode in ("I;16", "I;16B", "I"):
        return grey(values / 65535)
    if mode == "F":
        return grey(values)
    if mode == "P":
        colour, alpha = palette[values, :3], palette[values, 3:]
    else:  # LA, RGBA
        colour, alpha = values[..., :-1], values[..., -1:]
        colour = numpy.repeat(colour, 3, axis=-1) if mode == "LA" else colour
    return on_white(colour, alpha)


@st.composite
def images_of_every_mode(draw):
    mode = draw(st.sampled_from(["1", "L", "LA", "RGB", "RGBA", "P", "I;16", "I;16B", "I", "F"]))
    height, width = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2 ** 16))
    generator = numpy.random.default_rng(seed)
    palette = generator.integers(0, 256, (4, 4)).astype(numpy.int64)
    if mode == "1":
        values = generator.integers(0, 2, (height, width)).astype(bool)
        return mode, Image.fromarray(values), values, palette
    if mode == "F":
        values = generator.random((height, width), dtype=numpy.float32)
        return mode, Image.fromarray(values), values, palette
    if mode in ("I;16", "I;16B", "I"):
        values = generator.integers(0, 65536, (height, width))
        if mode == "I":
            return mode, Image.fromarray(values.astype(numpy.int32)), values, palette
        order = "<u2" if mode == "I;16" else ">u2"
        return mode, Image.frombytes(mode, (width, height), values.astype(order).tobytes()), values, palette
    if mode == "P":
        values = generator.integers(0, 4, (height, width))
        image = Image.fromarray(values.astype(numpy.uint8), "P")
        image.putpalette(palette[:, :3].astype(numpy.uint8).tobytes())
        image.info["transparency"] = palette[:, 3].astype(numpy.uint8).tobytes()  # per-entry alpha (tRNS)
        return mode, image, values, palette
    channels = {"L": (), "LA": (2,), "RGB": (3,), "RGBA": (4,)}[mode]
    values = generator.integers(0, 256, (height, width, *channels))
    return mode, Image.fromarray(values.astype(numpy.uint8), mode), values.astype(numpy.int64), palette


@EXAMPLES
@given(images_of_every_mode())
def test_property_every_mode_loads_to_its_definition_in_0_1(drawn):
    mode, image, values, palette = drawn
    got = loaded(image)
    assert numpy.allclose(got, _reference(mode, values, palette), atol=1e-6, rtol=0), mode
    assert got.min() >= -1e-6 and got.max() <= 1 + 1e-6


@EXAMPLES
@given(st.integers(4, 40), st.integers(4, 40), st.integers(0, 2 ** 16))
def test_property_a_16_bit_image_resizes_as_its_8_bit_rounding_does(height, width, seed):
    """Through the bicubic resize and the crop, a 16-bit image gives what its 8-bit rounding gives, to the 8-bit
    rounding (of the input, of Pillow's two passes), not clipped at 255 of 65535. The values stay in the middle
    half of the range, where the bicubic overshoot never reaches 0 or 1: there the 8-bit passes clip in between (the
    16-bit path clips once, at the end), and a full-range image is only checked to stay in [0, 1]."""
    generator = numpy.random.default_rng(seed)
    values = generator.integers(16384, 49152, (height, width))
    sixteen = Image.frombytes("I;16", (width, height), values.astype("<u2").tobytes())
    eight = Image.fromarray(numpy.round(values / 257).astype(numpy.uint8))
    difference = numpy.abs(unnormalised(preprocess(sixteen, img_size=8)) - unnormalised(preprocess(eight, img_size=8)))
    assert difference.max() <= 2 / 255
    full_range = generator.integers(0, 65536, (height, width)).astype("<u2").tobytes()
    got = unnormalised(preprocess(Image.frombytes("I;16", (width, height), full_range), img_size=8))
    assert got.min() >= -1e-6 and got.max() <= 1 + 1e-6


# -- the pixel budget -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("width, height, pillow_limit, message", [
    (14000, 14000, "default", "too large to decode (Image size (196000000 pixels) exceeds limit"),  # Pillow's error
    (10000, 9000, "default", "too large to decode (Image size (90000000 pixels) exceeds limit"),  # Pillow's warning
    (10000, 9000, None, "10000 × 9000 = 90,000,000 pixels, over the budget of 89,478,485"),  # Pillow's check off
])
def test_a_header_over_the_pixel_budget_is_refused_before_decoding(tmp_path, monkeypatch, width, height,
                                                                   pillow_limit, message):
    """The header claims the size and the file holds no pixels: decoding it would fail otherwise ("not an image")."""
    if pillow_limit is None:  # a user who switched Pillow's check off still gets the library's
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    path = tmp_path / "bomb.png"
    path.write_bytes(png_header(width, height))
    for call in (preprocess, load_image):
        with pytest.raises(images.ImageError) as refused:
            call(path)
        assert message in str(refused.value) and "MAX_PIXELS" in str(refused.value)
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("size", [(1, 30000), (30000, 1)])
def test_an_aspect_ratio_whose_resize_would_explode_is_refused(tmp_path, size):
    """The probe's 169-byte 1 × 30000 PNG: its shorter side resized to 256 made a 256 × 7,680,000 image."""
    path = saved(Image.new("L", size), tmp_path, "strip.png")
    for image in (path, Image.new("L", size)):
        with pytest.raises(images.ImageError, match="would make a (256 × 7680000|7680000 × 256) image, over the "
                                                    "budget of 89,478,485 pixels"):
            preprocess(image)


def test_the_budget_is_the_documented_constant(tmp_path, monkeypatch):
    monkeypatch.setattr(images, "MAX_PIXELS", 40 * 30 - 1)
    with pytest.raises(images.ImageError, match="40 × 30 = 1,200 pixels, over the budget of 1,199"):
        preprocess(saved(Image.new("RGB", (40, 30)), tmp_path, "small.png"), img_size=8)
    monkeypatch.setattr(images, "MAX_PIXELS", 40 * 30)
    assert preprocess(tmp_path / "small.png", img_size=8).shape == (1, 3, 8, 8)


# -- through the CLI and explain_images ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vim") / "vim.pth"
    torch.save({"model": make_vim().state_dict()}, path)
    return path


def bad_file(kind: str, folder):
    """The probe's files: a header claiming 14000² pixels, a 1-pixel strip, 32-bit integers beyond 16 bits."""
    if kind == "bomb":
        (folder / "bomb.png").write_bytes(png_header(14000, 14000))
        return folder / "bomb.png"
    if kind == "strip":  # at the tiny model's 32², a 36-pixel shorter side: 36 × 3.6M pixels
        return saved(Image.new("L", (1, 100000)), folder, "strip.png")
    return saved(Image.fromarray(numpy.array([[0, 70000]], numpy.int32)), folder, "wide.tif")


@pytest.mark.parametrize("kind, message", [("bomb", "too large to decode"),
                                           ("strip", "over the budget of 89,478,485 pixels"),
                                           ("integers", "values from 0 to 70000")])
def test_the_cli_refuses_bad_image_files_in_one_line(checkpoint, capsys, tmp_path, kind, message):
    image = bad_file(kind, tmp_path)
    code, _, err = run_main(capsys, "explain", "--model", checkpoint, "--img-size", 32, "--image", image)
    assert code == 2 and message in one_error_line(err) and "Traceback" not in err


def test_explain_images_sees_a_16_bit_ramp_as_a_ramp(tmp_path):
    """36 × 36 at the tiny model's 32²: the shorter side resized to int(32 / 0.875) = 36 (no resampling), the centre
    32² cropped at (2, 2): the report shows the ramp itself, not 99.6 % white."""
    from mamba_captum.vision.explain import explain_images

    ramp = numpy.round(numpy.linspace(0, 65535, 36 * 36)).astype(numpy.uint16).reshape(36, 36)
    (item,) = explain_images(make_vim(), [str(saved(Image.fromarray(ramp), tmp_path, "ramp.png"))], methods="raw")
    assert numpy.allclose(item.image, grey(ramp[2:34, 2:34] / 65535), atol=1e-6)


def test_preprocess_from_threads_leaves_the_warning_filters_as_they_were(tmp_path):
    """Each call refuses Pillow's bomb warning inside catch_warnings, which saves and restores the process's filter
    list: interleaved across threads it left the "error" filter behind (3 runs of 3 before the lock)."""
    import threading
    import warnings

    path = tmp_path / "red.png"
    Image.new("RGB", (64, 64), "red").save(path)
    before = list(warnings.filters)

    def work():
        for _ in range(100):
            preprocess(path, img_size=32, crop_pct=1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert warnings.filters == before
