"""MambaOut (Yu & Wang 2024, "MambaOut: Do We Really Need Mamba for Vision?") in plain PyTorch, as timm builds it.

MambaOut is Mamba without the SSM: four stages of gated CNN blocks (:class:`GatedConvBlock`) over a channel-last
feature map (B, H, W, C), a stride-4 conv stem, a 3 × 3 stride-2 conv between stages, and a head on the mean of the
last stage's tokens. Module and parameter names are timm's (``timm.models.mambaout``), so timm's state dicts
(``stem.conv1.weight``, ``stages.{i}.downsample.conv.weight``, ``stages.{i}.blocks.{j}.fc1.weight``, ``.conv.weight``,
``head.pre_logits.fc.weight`` ...) load key for key; :func:`load_mambaout` reads a checkpoint file or a state dict
(timm's names, or the original repository's, renamed as timm renames them) and detects the variant from the shapes.

The constructors (:func:`mambaout_femto` ...) are timm's registered models; :meth:`MambaOut.token_layout` and
:meth:`MambaOut.stage_blocks` say where the tokens are for the library (the multi-stage contract,
:class:`mamba_captum.layout.StagedLayout`).
"""
from __future__ import annotations

import functools
import math
import os
import re
from collections import OrderedDict

import torch
from torch import nn

from ..layout import Stage, StagedLayout
from .checkpoints import (apply_training_record, check_dtype, check_float_weights, checkpoint_key,
                          load_state_dict_strictly, read_checkpoint, read_training_record, state_dict_of,
                          training_image_size)

ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU}


def _activation(act_layer) -> type[nn.Module]:
    """timm's ``act_layer`` argument: a name ('gelu', 'silu') or a module class."""
    if isinstance(act_layer, str):
        if act_layer not in ACTIVATIONS:
            raise ValueError(f"mamba_captum: act_layer={act_layer!r}; MambaOut uses one of {sorted(ACTIVATIONS)} "
                             "(or pass a module class).")
        return ACTIVATIONS[act_layer]
    return act_layer


def _pair(size) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _halved(size: int) -> int:
    """The output size of a 3 × 3, stride-2, padding-1 conv: every downsampling conv of MambaOut (the stem's two
    too)."""
    return (size + 2 * 1 - 3) // 2 + 1


class LayerNorm(nn.LayerNorm):
    """LayerNorm over the last dimension (channel-last tensors), eps 1e-6 by default (timm's ``LayerNorm``)."""

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True):
        super().__init__(num_channels, eps=eps, elementwise_affine=affine)


class LayerScale(nn.Module):
    """``x · gamma`` per channel (last dimension); parameter ``gamma`` as timm's."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Stem(nn.Module):
    """Pixels (B, C, H, W) -> tokens (B, H/4, W/4, D): conv 3 × 3 stride 2 to D/2 channels, [LayerNorm,] act, conv
    3 × 3 stride 2 to D, LayerNorm (channel-last)."""

    def __init__(self, in_chs: int = 3, out_chs: int = 96, mid_norm: bool = True, act_layer=nn.GELU,
                 norm_layer=LayerNorm):
        super().__init__()
        self.conv1 = nn.Conv2d(in_chs, out_chs // 2, kernel_size=3, stride=2, padding=1)
        self.norm1 = norm_layer(out_chs // 2) if mid_norm else None
        self.act = act_layer()
        self.conv2 = nn.Conv2d(out_chs // 2, out_chs, kernel_size=3, stride=2, padding=1)
        self.norm2 = norm_layer(out_chs)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.conv1(pixel_values)
        if self.norm1 is not None:  # the norm acts on channels: channel-last around it
            x = self.norm1(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = self.conv2(self.act(x))
        return self.norm2(x.permute(0, 2, 3, 1))


class Downsample(nn.Module):
    """(B, H, W, C) -> (B, ⌈H/2⌉, ⌈W/2⌉, C'): conv 3 × 3 stride 2 padding 1, then LayerNorm (the released models)."""

    def __init__(self, in_chs: int = 96, out_chs: int = 198, norm_layer=LayerNorm):
        super().__init__()
        self.conv = nn.Conv2d(in_chs, out_chs, kernel_size=3, stride=2, padding=1)
        self.norm = norm_layer(out_chs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))


class DownsampleNormFirst(nn.Module):
    """LayerNorm, then the conv 3 × 3 stride 2 padding 1 (timm's ``*_rw`` models, ``downsample='conv_nf'``)."""

    def __init__(self, in_chs: int = 96, out_chs: int = 198, norm_layer=LayerNorm):
        super().__init__()
        self.norm = norm_layer(in_chs)
        self.conv = nn.Conv2d(in_chs, out_chs, kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.norm(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


class MlpHead(nn.Module):
    """The released models' head on (B, H, W, C): mean over the tokens, LayerNorm, ``pre_logits`` (fc to
    ``mlp_ratio · C``, act, LayerNorm), dropout, fc to the classes. ``num_classes=0``: no fc (the features)."""

    def __init__(self, in_features: int, num_classes: int = 1000, pool_type: str = "avg", act_layer=nn.GELU,
                 mlp_ratio: int | None = 4, norm_layer=LayerNorm, drop_rate: float = 0.0, bias: bool = True):
        super().__init__()
        if pool_type not in ("", "avg"):
            raise ValueError(f"mamba_captum: MlpHead pools by 'avg' (or '' for none); got {pool_type!r}.")
        self.pool_type = pool_type
        self.in_features = in_features
        hidden = int(mlp_ratio * in_features) if mlp_ratio is not None else None
        self.hidden_size = hidden or in_features
        self.norm = norm_layer(in_features)
        if hidden:
            self.pre_logits = nn.Sequential(OrderedDict([("fc", nn.Linear(in_features, hidden)),
                                                         ("act", act_layer()), ("norm", norm_layer(hidden))]))
        else:
            self.pre_logits = nn.Identity()
        self.num_features = hidden or in_features
        self.fc = nn.Linear(self.num_features, num_classes, bias=bias) if num_classes > 0 else nn.Identity()
        self.head_dropout = nn.Dropout(drop_rate)

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.pool_type == "avg":
            x = x.mean((1, 2))
        x = self.head_dropout(self.pre_logits(self.norm(x)))
        return x if pre_logits else self.fc(x)


class ClNormMlpClassifierHead(nn.Module):
    """The ``*_rw`` models' head (timm's ``head_fn='norm_mlp'``): mean over the tokens, LayerNorm, ``pre_logits`` (fc
    to ``hidden_size``, GELU), dropout, fc to the classes."""

    def __init__(self, in_features: int, num_classes: int, hidden_size: int | None = None, pool_type: str = "avg",
                 drop_rate: float = 0.0, norm_layer=LayerNorm, act_layer=nn.GELU):
        super().__init__()
        if pool_type not in ("", "avg"):
            raise ValueError(f"mamba_captum: the MambaOut head pools by 'avg' (or '' for none); got {pool_type!r}.")
        self.pool_type = pool_type
        self.in_features = in_features
        self.hidden_size = hidden_size
        self.norm = norm_layer(in_features)
        if hidden_size:
            self.pre_logits = nn.Sequential(OrderedDict([("fc", nn.Linear(in_features, hidden_size)),
                                                         ("act", act_layer())]))
        else:
            self.pre_logits = nn.Identity()
        self.num_features = hidden_size or in_features
        self.drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.pool_type == "avg":
            x = x.mean((1, 2))
        x = self.drop(self.pre_logits(self.norm(x)))
        return x if pre_logits else self.fc(x)


class GatedConvBlock(nn.Module):
    """The gated CNN block, on channel-last tokens (B, H, W, C), with its own residual::

        u = fc1(norm(x));  g, i, c = split(u, (hidden, hidden − conv_channels, conv_channels))
        out = x + ls(fc2(act(g) ⊙ cat(i, conv(c))))

    ``conv`` is a depthwise ``kernel_size`` × ``kernel_size`` conv with 'same' zero padding over the grid.
    ``hidden = int(expansion_ratio · dim)``, ``conv_channels = int(conv_ratio · dim)``; ``ls`` a :class:`LayerScale`
    when ``ls_init_value`` is given, else the identity. The token mixer the library explains
    (:mod:`mamba_captum.families.mambaout`)."""

    def __init__(self, dim: int, expansion_ratio: float = 8 / 3, kernel_size: int = 7, conv_ratio: float = 1.0,
                 ls_init_value: float | None = None, norm_layer=LayerNorm, act_layer=nn.GELU):
        super().__init__()
        self.norm = norm_layer(dim)
        hidden = int(expansion_ratio * dim)
        conv_channels = int(conv_ratio * dim)
        if not 0 < conv_channels <= hidden:
            raise ValueError(f"mamba_captum: conv_ratio={conv_ratio} gives {conv_channels} conv channels of "
                             f"{hidden}; it must give between 1 and the hidden width.")
        self.fc1 = nn.Linear(dim, hidden * 2)
        self.act = act_layer()
        self.split_indices = (hidden, hidden - conv_channels, conv_channels)
        self.conv = nn.Conv2d(conv_channels, conv_channels, kernel_size=kernel_size, padding=kernel_size // 2,
                              groups=conv_channels)
        self.fc2 = nn.Linear(hidden, dim)
        self.ls = LayerScale(dim, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.drop_path = nn.Identity()  # timm's name; stochastic depth is a training option not built here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) -> (B, H, W, C)."""
        gate, identity, conved = torch.split(self.fc1(self.norm(x)), self.split_indices, dim=-1)
        conved = self.conv(conved.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # the conv runs channel-first
        mixed = self.act(gate) * torch.cat((identity, conved), dim=-1)
        return x + self.drop_path(self.ls(self.fc2(mixed)))


class MambaOutStage(nn.Module):
    """One resolution: ``downsample`` ('conv': :class:`Downsample`, 'conv_nf': :class:`DownsampleNormFirst`, '':
    none) and ``depth`` :class:`GatedConvBlock` s in ``blocks``."""

    def __init__(self, dim: int, dim_out: int | None = None, depth: int = 4, expansion_ratio: float = 8 / 3,
                 kernel_size: int = 7, conv_ratio: float = 1.0, downsample: str = "", ls_init_value=None,
                 norm_layer=LayerNorm, act_layer=nn.GELU):
        super().__init__()
        dim_out = dim_out or dim
        if downsample == "conv":
            self.downsample = Downsample(dim, dim_out, norm_layer=norm_layer)
        elif downsample == "conv_nf":
            self.downsample = DownsampleNormFirst(dim, dim_out, norm_layer=norm_layer)
        elif downsample == "":
            if dim != dim_out:
                raise ValueError(f"mamba_captum: a stage without downsampling keeps its width ({dim} -> {dim_out}).")
            self.downsample = nn.Identity()
        else:
            raise ValueError(f"mamba_captum: downsample={downsample!r}; choose 'conv', 'conv_nf' or ''.")
        self.blocks = nn.Sequential(*[
            GatedConvBlock(dim_out, expansion_ratio, kernel_size, conv_ratio, ls_init_value, norm_layer, act_layer)
            for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class MambaOut(nn.Module):
    """MambaOut: :class:`Stem` (stride 4), stages of :class:`GatedConvBlock` s (each stage after the first halves
    the grid with a 3 × 3 stride-2 conv), and a head on the mean of the last stage's tokens.

    Args (timm's names):
        in_chans, num_classes (0: no classifier, the head's pre-logits are returned), global_pool ('avg' or '').
        depths, dims: blocks and width per stage.  act_layer: 'gelu' / 'silu' or a module class.
        conv_ratio, expansion_ratio, kernel_size: the blocks.  stem_mid_norm: a LayerNorm between the stem's convs.
        ls_init_value: a LayerScale in every block (None: none).  downsample: 'conv' (conv, norm) or 'conv_nf'
            (norm, conv).  drop_rate: dropout before the classifier.  head_fn: 'default' (:class:`MlpHead`) or
            'norm_mlp' (:class:`ClNormMlpClassifierHead`).
        img_size: the input size (height, width) the library explains the model at (timm's model runs at any size;
            :meth:`token_layout` describes this one; ``preprocess(path, model=model)`` resizes to it).

    ``forward(pixel_values)`` (B, C, H, W) -> logits (B, num_classes). ``class_names``: the classes' names or None;
    ``crop_pct``: the evaluation transform's crop (timm's config: 1.0 for the original weights).
    """

    class_names = None
    crop_pct = 1.0
    variant = None  # timm's registered name (the constructors and load_mambaout set it)

    def __init__(self, in_chans: int = 3, num_classes: int = 1000, global_pool: str = "avg",
                 depths=(3, 3, 9, 3), dims=(96, 192, 384, 576), act_layer="gelu", conv_ratio: float = 1.0,
                 expansion_ratio: float = 8 / 3, kernel_size: int = 7, stem_mid_norm: bool = True,
                 ls_init_value: float | None = None, downsample: str = "conv", drop_rate: float = 0.0,
                 head_fn: str = "default", img_size=224):
        super().__init__()
        depths = list(depths) if isinstance(depths, (list, tuple)) else [depths]
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
        if len(depths) != len(dims) or not depths or min(depths) < 1:
            raise ValueError(f"mamba_captum: depths={depths} and dims={dims} must be as long as each other, with at "
                             "least one block per stage.")
        if head_fn not in ("default", "norm_mlp"):
            raise ValueError(f"mamba_captum: head_fn={head_fn!r}; choose 'default' or 'norm_mlp'.")
        act = _activation(act_layer)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.output_fmt = "NHWC"
        self.num_stage = len(depths)
        self._img_size = _pair(img_size)
        self.stem = Stem(in_chans, dims[0], mid_norm=stem_mid_norm, act_layer=act, norm_layer=LayerNorm)
        self.stages = nn.Sequential()
        previous = dims[0]
        for index, (depth, dim) in enumerate(zip(depths, dims)):
            self.stages.append(MambaOutStage(previous, dim, depth, expansion_ratio, kernel_size, conv_ratio,
                                             downsample if index > 0 else "", ls_init_value, LayerNorm, act))
            previous = dim
        if head_fn == "default":
            self.head = MlpHead(previous, num_classes, pool_type=global_pool, drop_rate=drop_rate,
                                norm_layer=LayerNorm)
        else:
            self.head = ClNormMlpClassifierHead(previous, num_classes, hidden_size=int(previous * 4),
                                                pool_type=global_pool, drop_rate=drop_rate, norm_layer=LayerNorm)
        self.num_features = previous
        self.head_hidden_size = self.head.num_features
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        """timm's initialisation: truncated normal (std 0.02) convs and linears, zero biases."""
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    @property
    def img_size(self) -> tuple[int, int]:
        """The input image size (height, width) the model is explained at."""
        return self._img_size

    # -- where the tokens are -----------------------------------------------------------------------------------
    def token_layout(self) -> StagedLayout:
        """The :class:`mamba_captum.layout.StagedLayout`: the stem's grid (img / 4, rounded up by its two stride-2
        convs), then each later stage's grid made by its 3 × 3 stride-2 padding-1 conv."""
        rows, cols = (_halved(_halved(n)) for n in self.img_size)
        stages = []
        for index, stage in enumerate(self.stages):
            if index > 0:
                rows, cols = _halved(rows), _halved(cols)
            stages.append(Stage(grid=(rows, cols), blocks=len(stage.blocks),
                                downsample=None if index == 0 else (3, 2, 1)))
        return StagedLayout(img_size=self.img_size, stages=tuple(stages), stream="channels_last")

    def stage_blocks(self) -> nn.ModuleList:
        """Every :class:`GatedConvBlock` of every stage, in execution order (a new list, not registered on the model:
        the state dict is unchanged)."""
        return nn.ModuleList([block for stage in self.stages for block in stage.blocks])

    # -- forward --------------------------------------------------------------------------------------------------
    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the last stage's tokens (B, H/32, W/32, C_last), channel-last."""
        return self.stages(self.stem(pixel_values))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, num_classes)."""
        return self.forward_head(self.forward_features(pixel_values))


# ---------------------------------------------------------------------------------------------------------------
# The registered models (timm's registrations) and their checkpoints

_RW = dict(stem_mid_norm=False, downsample="conv_nf", ls_init_value=1e-6, head_fn="norm_mlp")
VARIANTS: dict[str, dict] = {
    "mambaout_femto": dict(depths=(3, 3, 9, 3), dims=(48, 96, 192, 288)),
    "mambaout_kobe": dict(depths=(3, 3, 15, 3), dims=(48, 96, 192, 288)),
    "mambaout_tiny": dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 576)),
    "mambaout_small": dict(depths=(3, 4, 27, 3), dims=(96, 192, 384, 576)),
    "mambaout_base": dict(depths=(3, 4, 27, 3), dims=(128, 256, 512, 768)),
    "mambaout_small_rw": dict(depths=(3, 4, 27, 3), dims=(96, 192, 384, 576), **_RW),
    "mambaout_base_short_rw": dict(depths=(3, 3, 25, 3), dims=(128, 256, 512, 768), expansion_ratio=3.0,
                                   conv_ratio=1.25, **_RW),
    "mambaout_base_tall_rw": dict(depths=(3, 4, 30, 3), dims=(128, 256, 512, 768), expansion_ratio=2.5,
                                  conv_ratio=1.25, **_RW),
    "mambaout_base_wide_rw": dict(depths=(3, 4, 27, 3), dims=(128, 256, 512, 768), expansion_ratio=3.0,
                                  conv_ratio=1.5, act_layer="silu", **_RW),
    "mambaout_base_plus_rw": dict(depths=(3, 4, 30, 3), dims=(128, 256, 512, 768), expansion_ratio=3.0,
                                  conv_ratio=1.5, act_layer="silu", **_RW),
}
# the evaluation crop of timm's pretrained configs (the rest: 1.0)
_CROP_PCT = {"mambaout_base_short_rw": 0.95, "mambaout_base_tall_rw": 0.95, "mambaout_base_wide_rw": 0.95}


def _build(name: str, overrides: dict) -> MambaOut:
    model = MambaOut(**{**VARIANTS[name], **overrides})
    model.variant = name
    model.crop_pct = _CROP_PCT.get(name, 1.0)
    return model


def mambaout_femto(**overrides) -> MambaOut:
    """MambaOut-Femto (depths 3-3-9-3, dims 48-96-192-288), randomly initialised; ``overrides``: any
    :class:`MambaOut` argument (``num_classes``, ``img_size``, ...)."""
    return _build("mambaout_femto", overrides)


def mambaout_kobe(**overrides) -> MambaOut:
    """MambaOut-Kobe (depths 3-3-15-3, dims 48-96-192-288)."""
    return _build("mambaout_kobe", overrides)


def mambaout_tiny(**overrides) -> MambaOut:
    """MambaOut-Tiny (depths 3-3-9-3, dims 96-192-384-576)."""
    return _build("mambaout_tiny", overrides)


def mambaout_small(**overrides) -> MambaOut:
    """MambaOut-Small (depths 3-4-27-3, dims 96-192-384-576)."""
    return _build("mambaout_small", overrides)


def mambaout_base(**overrides) -> MambaOut:
    """MambaOut-Base (depths 3-4-27-3, dims 128-256-512-768)."""
    return _build("mambaout_base", overrides)


def mambaout_small_rw(**overrides) -> MambaOut:
    """timm's MambaOut-Small-RW (Small's sizes; no stem mid-norm, norm-first downsampling, LayerScale 1e-6, the
    norm-MLP head)."""
    return _build("mambaout_small_rw", overrides)


def mambaout_base_short_rw(**overrides) -> MambaOut:
    """timm's MambaOut-Base-Short-RW (depths 3-3-25-3, expansion 3, conv ratio 1.25; RW options)."""
    return _build("mambaout_base_short_rw", overrides)


def mambaout_base_tall_rw(**overrides) -> MambaOut:
    """timm's MambaOut-Base-Tall-RW (depths 3-4-30-3, expansion 2.5, conv ratio 1.25; RW options)."""
    return _build("mambaout_base_tall_rw", overrides)


def mambaout_base_wide_rw(**overrides) -> MambaOut:
    """timm's MambaOut-Base-Wide-RW (depths 3-4-27-3, expansion 3, conv ratio 1.5, SiLU; RW options)."""
    return _build("mambaout_base_wide_rw", overrides)


def mambaout_base_plus_rw(**overrides) -> MambaOut:
    """timm's MambaOut-Base-Plus-RW (depths 3-4-30-3, expansion 3, conv ratio 1.5, SiLU; RW options)."""
    return _build("mambaout_base_plus_rw", overrides)


def _original_names(state: dict) -> dict:
    """The original repository's keys (``downsample_layers.{i}``, ``stages.{i}.{j}``, ``norm``, ``head.fc1`` /
    ``head.norm`` / ``head.fc2``) renamed to timm's, as timm renames them when it loads those files; timm's keys are
    returned as they are."""
    if "stem.conv1.weight" in state:
        return state
    renamed = {}
    for key, value in state.items():
        key = key.replace("downsample_layers.0.", "stem.")
        key = re.sub(r"^stages\.(\d+)\.(\d+)\.", r"stages.\1.blocks.\2.", key)
        key = re.sub(r"^downsample_layers\.(\d+)\.", r"stages.\1.downsample.", key)
        if key.startswith("norm."):  # the norm after the pooling is the head's
            key = "head." + key
        elif key.startswith("head."):
            key = key.replace("head.fc1.", "head.pre_logits.fc.").replace("head.norm.", "head.pre_logits.norm.")
            key = key.replace("head.fc2.", "head.fc.")
        renamed[key] = value
    return renamed


def read_mambaout_checkpoint(path) -> dict:
    """The state dict of a MambaOut checkpoint file (:func:`mamba_captum.vision.read_checkpoint`: a
    ``.safetensors`` file, timm's hub files, or a PyTorch file read with ``weights_only=True``), in timm's key names
    (the original repository's are renamed as timm renames them).

    Raises:
        FileNotFoundError; ValueError naming what the file holds when it is not a checkpoint.
    """
    return _original_names(read_checkpoint(path))


def _ratio(what: str, dims: tuple[int, ...], counts: list[int]) -> float:
    """The ratio r with ``int(r · dims[i]) == counts[i]`` at every stage (how timm sizes the blocks): a released
    ratio (8/3, 3, 2.5, 1, 1.25, 1.5) when one fits, else the smallest quotient that fits.

    Raises:
        ValueError: no single ratio gives every stage's width (not a MambaOut's shapes)."""
    quotients = sorted({count / dim for count, dim in zip(counts, dims)})
    candidates = [8 / 3, 3.0, 2.5, 1.0, 1.25, 1.5, 2.0, 4.0] + [q for v in quotients for q in (v, math.nextafter(v, 9))]
    for ratio in candidates:
        if all(int(ratio * dim) == count for dim, count in zip(dims, counts)):
            return ratio
    raise ValueError(f"mamba_captum: the blocks' {what} widths {counts} are no single multiple of the stage widths "
                     f"{list(dims)}: not a MambaOut checkpoint.")


def detect_mambaout_config(state: dict) -> dict:
    """The :class:`MambaOut` arguments that give ``state``'s keys and shapes (timm's names): depths and dims, the
    expansion and conv ratios, the kernel, the stem's mid norm, the downsampling order, the LayerScale, the head and
    its classes. The activation (GELU or SiLU) leaves no trace in the weights: a state dict with the shapes of
    timm's ``mambaout_base_wide_rw`` / ``_plus_rw`` gets their SiLU, any other GELU (``act_layer=`` overrides).

    Raises:
        ValueError: a key the detection needs is missing, or the shapes fit no MambaOut.
    """
    need = functools.partial(checkpoint_key, state, what="a MambaOut")

    blocks: dict[int, int] = {}
    for key in state:
        if (m := re.match(r"stages\.(\d+)\.blocks\.(\d+)\.", key)):
            stage, block = int(m.group(1)), int(m.group(2))
            blocks[stage] = max(blocks.get(stage, 0), block + 1)
    if not blocks or sorted(blocks) != list(range(len(blocks))):
        raise ValueError("mamba_captum: the state dict has no stages.{i}.blocks.{j}.* keys for consecutive stages: "
                         "it is not a MambaOut checkpoint.")
    depths = tuple(blocks[i] for i in range(len(blocks)))
    fc2 = [need(f"stages.{i}.blocks.0.fc2.weight") for i in range(len(depths))]  # (dim, hidden)
    convs = [need(f"stages.{i}.blocks.0.conv.weight") for i in range(len(depths))]  # (conv channels, 1, k, k)
    dims = tuple(int(w.shape[0]) for w in fc2)
    head_fc = state.get("head.fc.weight")
    downsample = "conv"
    if len(depths) > 1:
        norm = need("stages.1.downsample.norm.weight")
        if dims[0] != dims[1]:  # conv then norm: the norm has the new width; norm first: the old one
            downsample = "conv_nf" if norm.shape[0] == dims[0] else "conv"
        else:  # same widths: the order of the keys is the order of the modules
            order = [key for key in state if key.startswith("stages.1.downsample.")]
            downsample = "conv_nf" if order and order[0].startswith("stages.1.downsample.norm.") else "conv"
    return dict(in_chans=int(need("stem.conv1.weight").shape[1]), depths=depths, dims=dims,
                expansion_ratio=_ratio("hidden", dims, [int(w.shape[1]) for w in fc2]),
                conv_ratio=_ratio("conv", dims, [int(w.shape[0]) for w in convs]),
                kernel_size=int(convs[0].shape[-1]), stem_mid_norm="stem.norm1.weight" in state,
                ls_init_value=1e-6 if "stages.0.blocks.0.ls.gamma" in state else None, downsample=downsample,
                head_fn="default" if "head.pre_logits.norm.weight" in state else "norm_mlp",
                num_classes=0 if head_fc is None else int(head_fc.shape[0]))


def variant_name(config: dict) -> str | None:
    """timm's registered name of a detected config, if it is a released one (the activation not compared)."""
    def same(options):
        full = {**dict(expansion_ratio=8 / 3, conv_ratio=1.0, stem_mid_norm=True, ls_init_value=None,
                       downsample="conv", head_fn="default", kernel_size=7), **options}
        return all(_same_value(full[key], config.get(key)) for key in full if key != "act_layer")

    return next((name for name, options in VARIANTS.items() if same(options)), None)


def _same_value(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return b is not None and a is not None and math.isclose(float(a), float(b), rel_tol=1e-6)
    return tuple(a) == tuple(b) if isinstance(a, (list, tuple)) else a == b


def load_mambaout(checkpoint, *, img_size=None, dtype=None, device=None, **overrides) -> MambaOut:
    """Build the MambaOut that ``checkpoint`` was trained as and load its weights key for key; eval mode.

    Args:
        checkpoint: a path (``.safetensors``, or a PyTorch file read weights-only: the weights alone or under
            ``"model"`` / ``"state_dict"``), a state dict (``timm.create_model("mambaout_femto",
            pretrained=True).state_dict()`` as it is), or a dict with the state dict under ``"model"``. timm's names
            or the original repository's.
        img_size: the size the model is explained at (default 224; an int or (height, width)).
        dtype: the model's dtype (default: the stored dtype of the stem's first conv).
        device: where to put the model (default: CPU).
        **overrides: :class:`MambaOut` arguments the weights cannot tell, e.g. ``act_layer="silu"``.

    Returns:
        the :class:`MambaOut`; ``model.variant`` is timm's registered name when the shapes are a released model's.

    Raises:
        ValueError: naming every missing or unexpected key and shape mismatch, the tensors that are not floating
            point, a dtype that is not floating point, or why the file is not a checkpoint.
    """
    record = None
    if isinstance(checkpoint, (str, os.PathLike)):
        record = read_training_record(checkpoint)
        state = read_mambaout_checkpoint(checkpoint)
    else:
        state = _original_names(state_dict_of(checkpoint, "the given dict"))
    config = detect_mambaout_config(state)
    name = variant_name(config)
    if name is not None and "act_layer" in VARIANTS[name]:
        config["act_layer"] = VARIANTS[name]["act_layer"]
    img_size = training_image_size(checkpoint, record, img_size)
    config = {**config, **overrides, "img_size": 224 if img_size is None else img_size}
    check_float_weights(state, "a MambaOut")
    check_dtype(dtype, "MambaOut")
    model = MambaOut(**config)
    model = model.to(state["stem.conv1.weight"].dtype if dtype is None else dtype)
    load_state_dict_strictly(model, state)
    model.variant = variant_name(config)
    model.crop_pct = _CROP_PCT.get(model.variant, 1.0)
    apply_training_record(model, record, checkpoint, config["num_classes"])
    if device is not None:
        model = model.to(device=device)
    return model.eval()
