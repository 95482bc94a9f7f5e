"""Images in, explanations out: the CLI's and the report's view of an image classifier of the zoo (Vim, VMamba,
EfficientViM, MambaOut, MambaVision: ``mamba-captum explain --model vim.pth --image cat.jpg``). It sits above the attribution classes, outside the model zoo
(:mod:`mamba_captum.vision`, which depends on the kernels and the token layout only), and is the one module of
:mod:`mamba_captum.explain` that imports the zoo; ``mamba_captum.vision.explain``, the path users import, re-exports it.

:func:`load_vim_file` reads a checkpoint file with clear errors; :func:`explain_images` explains each image with
the three methods and returns :class:`ImageExplanation` records (pixel maps per method, the prediction, the
image for display), which :func:`mamba_captum.html_report.render_image_html` turns into a report.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..attr import MambaAttribution, MambaRawAttention, MambaRollout
from ..vision.images import preprocess, to_display
from ..vision.zoo import load_image_model
from .loading import DTYPES, UsageError, check_device

METHODS = {"raw": MambaRawAttention, "rollout": MambaRollout, "attribution": MambaAttribution}


@dataclasses.dataclass
class ImageExplanation:
    """One explained image.

    Attributes:
        path: the image file.  image: (H, W, 3) floats in [0, 1], the model's input as shown to people.
        prediction, probability: the top class (its name when the model has ``class_names``) and its probability.
        target, target_probability: the explained class.
        relevance: method name -> (H, W) pixel relevance (raw and rollout are class-agnostic).
        settings: the model file, formulation and CLS position, for the report.
    """

    path: str
    image: object
    prediction: str
    probability: float
    target: str
    target_probability: float
    relevance: dict
    settings: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-safe: the prediction, the target and, per method, the relevance of each pixel (rows of floats)."""
        return {"image": self.path, "prediction": self.prediction, "probability": self.probability,
                "target": self.target, "target_probability": self.target_probability,
                "relevance": {name: [[round(float(v), 6) for v in row] for row in scores.tolist()]
                              for name, scores in self.relevance.items()}, "settings": self.settings}


def load_vim_file(path, *, device: str = "cpu", dtype: str = "float32", img_size: int | None = None,
                  variant: str | None = None):
    """An image model's checkpoint file (Vim, VMamba, EfficientViM, MambaOut or MambaVision, told apart by its keys:
    :func:`mamba_captum.vision.zoo.load_image_model`) -> the model in eval mode on ``device`` (a ``training.json``
    beside it gives the image size and the class names). ``variant``: a released variant's name the weights must
    be. Errors are :class:`UsageError`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no image-model checkpoint file at {str(path)!r}; pass a .pth or .safetensors file.")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    check_device(device)
    options = {} if img_size is None else {"img_size": img_size}
    try:
        model = load_image_model(path, variant=variant, **options)
    except (ValueError, FileNotFoundError, TypeError) as error:
        raise UsageError(str(error).removeprefix("mamba_captum: ")) from None
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def _class_name(model, index: int) -> str:
    names = getattr(model, "class_names", None)
    return str(names[index]) if names is not None and index < len(names) else str(index)


def resolve_class(model, target) -> int | None:
    """``target`` (None, an int, a digit string, or a class name when the model has ``class_names``) -> an index."""
    if target is None:
        return None
    names = [str(n) for n in getattr(model, "class_names", None) or ()]
    if isinstance(target, str) and target in names:
        return names.index(target)
    try:
        index = int(target)
    except (TypeError, ValueError):
        known = f" or one of {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}" if names else ""
        raise UsageError(f"target {target!r} is not a class index{known}.") from None
    if not 0 <= index < model.num_classes:
        raise UsageError(f"target {index} is outside the model's classes 0..{model.num_classes - 1}.")
    return index


def explain_images(model, images, *, target=None, methods=tuple(METHODS), formulation: str = "unified",
                   paths=None) -> list[ImageExplanation]:
    """Explain each image (a path, a PIL image, or a (3, H, W) / (B, 3, H, W) pixel tensor: B images) with
    ``methods``.

    Files and PIL images are preprocessed as the official evaluation does (:func:`preprocess`, at the model's
    image size). Returns one :class:`ImageExplanation` per image.
    """
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    flat = []  # a (B, 3, H, W) tensor is B images
    for image in images:
        if torch.is_tensor(image) and image.dim() == 4:
            flat.extend(image[i:i + 1] for i in range(image.shape[0]))
        else:
            flat.append(image)
    images = flat
    if getattr(model, "num_classes", 1) <= 0:
        raise UsageError("the model has no classifier head (num_classes=0): there is no class to explain; load a "
                         "checkpoint with its head weights.")
    methods = [methods] if isinstance(methods, str) else list(dict.fromkeys(methods))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r}; choose among {', '.join(METHODS)}.")
    wanted = resolve_class(model, target)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    size = tuple(model.token_layout().img_size)
    results = []
    for number, image in enumerate(images):
        if torch.is_tensor(image):
            pixels = image if image.dim() == 4 else image[None]  # (1, 3, H, W)
            name = paths[number] if paths else f"image {number + 1}"
        else:
            try:
                # the model's evaluation transform: its size, and the crop its training.json names (0.875 else)
                pixels = preprocess(image, img_size=size, crop_pct=getattr(model, "crop_pct", None))
            except (FileNotFoundError, ValueError) as error:
                raise UsageError(str(error).removeprefix("mamba_captum: ")) from None
            name = str(image) if isinstance(image, (str, Path)) else f"image {number + 1}"
        pixels = pixels.to(device=device, dtype=dtype)
        with torch.no_grad():
            probabilities = model(pixels)[0].float().softmax(-1)
        predicted = int(probabilities.argmax())
        explained = predicted if wanted is None else wanted
        relevance = {}
        for method in methods:
            options = {"target": explained} if method == "attribution" else {}
            relevance[method] = METHODS[method](model).attribute(pixels, formulation=formulation,
                                                                 **options)[0, 0].float().cpu()
        results.append(ImageExplanation(
            path=name, image=to_display(pixels.float().cpu()), prediction=_class_name(model, predicted),
            probability=float(probabilities[predicted]), target=_class_name(model, explained),
            target_probability=float(probabilities[explained]), relevance=relevance,
            settings={"model": getattr(model, "variant", None) or type(model).__name__,
                      "formulation": formulation, "CLS token": str(getattr(model, "cls_position", None))}))
    return results
