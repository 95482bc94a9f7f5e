"""Images in, explanations out, at the path users import: a re-export of :mod:`mamba_captum.explain.images`.

The explanation of images runs the attribution classes, so it lives above them, outside the model zoo; this
re-export is the zoo's one import from above it (named in the import contracts, pyproject.toml).
"""
from ..explain.images import METHODS, ImageExplanation, explain_images, load_vim_file, resolve_class

__all__ = ["METHODS", "ImageExplanation", "explain_images", "load_vim_file", "resolve_class"]
