"""EfficientViM (Lee et al., CVPR 2025) in plain PyTorch, with timm's module and parameter names.

timm's ``efficientvim_m1`` .. ``efficientvim_m4`` (``timm/models/efficientvim.py``, timm ≥ 1.0.20) in the library's
own code: the ``state_dict`` has timm's keys and shapes, so a timm hub file (``model.safetensors``) or
``timm.create_model("efficientvim_m2", pretrained=True).state_dict()`` loads key for key
(:func:`load_efficientvim`). The model is fully convolutional; ``img_size`` (224, 256 for M4) only fixes the token
grids the explanations are laid over (:meth:`EfficientViM.token_layout`).

Forward (eval mode):

1. ``patch_embed``: four 3×3 stride-2 Conv-BN(-ReLU) layers, stride 16: a (C₀, H/16, W/16) map;
2. three stages; a block (:class:`EfficientViMBlock`) is, with ``α = sigmoid(alpha)`` (4, C)::

       x ← x + α₀ (dwconv1(x) − x)          depthwise 3×3 conv + BN
       x ← x + α₁ (HSMSSD(norm(x)) − x)     the token mixer, LayerNorm over channels first
       x ← x + α₂ (dwconv2(x) − x)          depthwise 3×3 conv + BN
       x ← x + α₃ (ffn(x) − x)              1×1 conv-BN-ReLU, 1×1 conv-BN

   and every stage but the last ends with :class:`PatchMerging` (a 3×3 stride-2 depthwise MBConv with
   squeeze-excite, between two residual depthwise 3×3 convs): grids H/16, H/32, H/64 (each (n − 1) // 2 + 1);
3. the head: for each stage the hidden state ``h`` (B, C, N) of its **last block's** mixer, LayerNorm over the
   channels of each state n, mean over the N states, a Linear; and the final map, LayerNorm2d, mean over tokens,
   a Linear; the four logits summed with the weights ``softmax(weights)``. The logits therefore read every
   stage's last ``h``, not only the last stage's tokens.

HSMSSD (:class:`HSMSSD`), on x (B, C, L) with L = H·W tokens and N states::

    b, c, dt = split(dw(BCdt_proj(x)))          (B, N, L) each; dw a depthwise 3×3 conv over the grid
    a = softmax_L(dt + A)                       over the tokens, per state
    h = x (a ⊙ b)ᵀ                              (B, C, N)
    h, z = split(hz_proj(h))                    1×1 over channels
    h = out_proj(h ⊙ silu(z) + h ⊙ D)           (B, C, N), the hidden state the head reads
    y = h c                                     (B, C, L)

Not built: drop path and dropout (identities in eval mode), gradient checkpointing, ``forward_intermediates``, and
timm's reparameterised ("fused") form; a fused model's weights are refused by :func:`load_efficientvim` (load the
weights before ``reparameterize_model``).
"""
from __future__ import annotations

import functools
import math
import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from ..layout import Stage, StagedLayout
from .checkpoints import (apply_training_record, check_dtype, check_float_weights, checkpoint_key,
                          load_state_dict_strictly, read_checkpoint, read_training_record, state_dict_of,
                          training_image_size)

# timm's registered configurations (efficientvim_m1 .. m4); M4 is evaluated at 256², the others at 224²
VARIANTS = {
    "efficientvim_m1": dict(embed_dim=(128, 192, 320), depths=(2, 2, 2), state_dim=(49, 25, 9), img_size=224),
    "efficientvim_m2": dict(embed_dim=(128, 256, 512), depths=(2, 2, 2), state_dim=(49, 25, 9), img_size=224),
    "efficientvim_m3": dict(embed_dim=(224, 320, 512), depths=(2, 2, 2), state_dim=(49, 25, 9), img_size=224),
    "efficientvim_m4": dict(embed_dim=(224, 320, 512), depths=(3, 4, 2), state_dim=(64, 32, 16), img_size=256),
}
# the downsample of a PatchMerging as the explanations cross it: its stride-2 depthwise conv's window
DOWNSAMPLE_WINDOW = (3, 2, 1)


class ConvLayer1d(nn.Module):
    """Conv1d (no bias) + optional BatchNorm1d + optional activation (timm's names: ``conv``, ``norm``, ``act``)."""

    def __init__(self, in_dim, out_dim, kernel_size=3, stride=1, padding=0, dilation=1, groups=1,
                 norm=nn.BatchNorm1d, act_layer=nn.ReLU, bn_weight_init=1.0):
        super().__init__()
        self.conv = nn.Conv1d(in_dim, out_dim, kernel_size, stride=stride, padding=padding, dilation=dilation,
                              groups=groups, bias=False)
        self.norm = norm(out_dim) if norm else None
        self.act = act_layer() if act_layer else None
        if isinstance(self.norm, nn.modules.batchnorm._BatchNorm):
            nn.init.constant_(self.norm.weight, bn_weight_init)
            nn.init.zeros_(self.norm.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = x if self.norm is None else self.norm(x)
        return x if self.act is None else self.act(x)


class ConvLayer2d(nn.Module):
    """Conv2d (no bias) + optional BatchNorm2d + optional activation (timm's names: ``conv``, ``norm``, ``act``)."""

    def __init__(self, in_dim, out_dim, kernel_size=3, stride=1, padding=0, dilation=1, groups=1,
                 norm=nn.BatchNorm2d, act_layer=nn.ReLU, bn_weight_init=1.0):
        super().__init__()
        self.conv = nn.Conv2d(in_dim, out_dim, kernel_size, stride=stride, padding=padding, dilation=dilation,
                              groups=groups, bias=False)
        self.norm = norm(out_dim) if norm else None
        self.act = act_layer() if act_layer else None
        if isinstance(self.norm, nn.modules.batchnorm._BatchNorm):
            nn.init.constant_(self.norm.weight, bn_weight_init)
            nn.init.zeros_(self.norm.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = x if self.norm is None else self.norm(x)
        return x if self.act is None else self.act(x)


class LayerNorm(nn.LayerNorm):
    """LayerNorm over the last dimension (timm.layers.LayerNorm)."""


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map (timm.layers.LayerNorm2d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def make_divisible(value: float, divisor: int = 8) -> int:
    """timm's channel rounding for the squeeze-excite width (round to the nearest multiple, at least ``divisor``)."""
    return max(divisor, int(value + divisor / 2) // divisor * divisor)


class SqueezeExcite(nn.Module):
    """timm's SEModule: ``x · sigmoid(fc2(relu(fc1(mean_hw x))))`` (1×1 convs with biases)."""

    def __init__(self, channels: int, rd_ratio: float = 1 / 16):
        super().__init__()
        reduced = make_divisible(channels * rd_ratio)
        self.fc1 = nn.Conv2d(channels, reduced, kernel_size=1)
        self.act = nn.ReLU()
        self.fc2 = nn.Conv2d(reduced, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(self.act(self.fc1(x.mean((2, 3), keepdim=True))))
        return x * scale.sigmoid()


class Stem(nn.Module):
    """Four 3×3 stride-2 Conv-BN layers (ReLU but after the last): stride 16, channels C/8, C/4, C/2, C."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        widths = (in_dim, dim // 8, dim // 4, dim // 2, dim)
        self.conv = nn.Sequential(*[
            ConvLayer2d(widths[i], widths[i + 1], kernel_size=3, stride=2, padding=1,
                        act_layer=nn.ReLU if i < 3 else None) for i in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class FFN(nn.Module):
    """1×1 Conv-BN-ReLU then 1×1 Conv-BN."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.fc1 = ConvLayer2d(in_dim, dim, 1)
        self.fc2 = ConvLayer2d(dim, in_dim, 1, act_layer=None, bn_weight_init=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class PatchMerging(nn.Module):
    """The downsample between stages: ``x + dwconv1(x)``, then 1×1 expand (×4 of the output width), 3×3 stride-2
    depthwise, squeeze-excite, 1×1 project, then ``x + dwconv2(x)``."""

    fused = False  # timm's reparameterised form is not built

    def __init__(self, in_dim: int, out_dim: int, ratio: float = 4.0):
        super().__init__()
        hidden = int(out_dim * ratio)
        self.conv = nn.Sequential(
            ConvLayer2d(in_dim, hidden, kernel_size=1),
            ConvLayer2d(hidden, hidden, kernel_size=3, stride=2, padding=1, groups=hidden),
            SqueezeExcite(hidden, 0.25),
            ConvLayer2d(hidden, out_dim, kernel_size=1, act_layer=None),
        )
        self.dwconv1 = ConvLayer2d(in_dim, in_dim, 3, padding=1, groups=in_dim, act_layer=None)
        self.dwconv2 = ConvLayer2d(out_dim, out_dim, 3, padding=1, groups=out_dim, act_layer=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dwconv1(x)
        x = self.conv(x)
        return x + self.dwconv2(x)


class HSMSSD(nn.Module):
    """Hidden-state-mixer SSD: (B, C, H, W) -> (y (B, C, H, W), h (B, C, N)); see the module docstring.

    Parameters (timm's): ``BCdt_proj`` (1×1, C -> 3N), ``dw`` (depthwise 3×3 over the grid of the 3N gate
    channels), ``hz_proj`` (1×1, C -> 2·C_in), ``out_proj`` (1×1, C_in -> C), ``A`` (N,), ``D`` (1,)."""

    def __init__(self, dim: int, ssd_expand: float = 1.0, state_dim: int = 64, a_init_range=(1.0, 16.0)):
        super().__init__()
        self.ssd_expand = ssd_expand
        self.d_inner = int(ssd_expand * dim)
        self.state_dim = state_dim
        self.BCdt_proj = ConvLayer1d(dim, 3 * state_dim, 1, norm=None, act_layer=None)
        self.dw = ConvLayer2d(3 * state_dim, 3 * state_dim, 3, 1, 1, groups=3 * state_dim, norm=None,
                              act_layer=None)
        self.hz_proj = ConvLayer1d(dim, 2 * self.d_inner, 1, norm=None, act_layer=None)
        self.out_proj = ConvLayer1d(self.d_inner, dim, 1, norm=None, act_layer=None)
        self.A = nn.Parameter(torch.empty(state_dim).uniform_(*a_init_range))
        self.act = nn.SiLU()
        self.D = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, _, height, width = x.shape
        x = x.flatten(2)  # (B, C, L)
        gates = self.dw(self.BCdt_proj(x).reshape(batch, -1, height, width)).flatten(2)
        b, c, dt = gates.split(self.state_dim, dim=1)  # (B, N, L) each
        a = (dt + self.A.view(1, -1, 1)).softmax(-1)  # over the tokens
        h = x @ (a * b).transpose(-2, -1)  # (B, C, N)
        h, z = self.hz_proj(h).split(self.d_inner, dim=1)
        h = self.out_proj(h * self.act(z) + h * self.D)
        y = h @ c  # (B, C, L)
        return y.reshape(batch, -1, height, width), h


class EfficientViMBlock(nn.Module):
    """dwconv1 -> HSMSSD -> dwconv2 -> FFN, each a residual branch gated by ``sigmoid(alpha[k])``:
    (B, C, H, W) -> (x, the mixer's h (B, C, N))."""

    fused = False  # timm's reparameterised form is not built

    def __init__(self, dim: int, mlp_ratio: float = 4.0, ssd_expand: float = 1.0, state_dim: int = 64):
        super().__init__()
        self.mixer = HSMSSD(dim, ssd_expand=ssd_expand, state_dim=state_dim)
        self.norm = LayerNorm2d(dim, eps=1e-5)
        self.dwconv1 = ConvLayer2d(dim, dim, 3, padding=1, groups=dim, bn_weight_init=0, act_layer=None)
        self.dwconv2 = ConvLayer2d(dim, dim, 3, padding=1, groups=dim, bn_weight_init=0, act_layer=None)
        self.ffn = FFN(dim, int(dim * mlp_ratio))
        self.alpha = nn.Parameter(1e-4 * torch.ones(4, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha = self.alpha.sigmoid().view(4, -1, 1, 1)
        x = x + alpha[0] * (self.dwconv1(x) - x)
        y, h = self.mixer(self.norm(x))
        x = x + alpha[1] * (y - x)
        x = x + alpha[2] * (self.dwconv2(x) - x)
        x = x + alpha[3] * (self.ffn(x) - x)
        return x, h


class EfficientViMStage(nn.Module):
    """``depth`` blocks at one resolution, then the downsample (none after the last stage):
    x -> (the stage's map, the next stage's input, the last block's h)."""

    def __init__(self, in_dim: int, out_dim: int, depth: int, mlp_ratio: float = 4.0, downsample: bool = False,
                 ssd_expand: float = 1.0, state_dim: int = 64):
        super().__init__()
        self.depth = depth
        self.blocks = nn.ModuleList([EfficientViMBlock(in_dim, mlp_ratio, ssd_expand, state_dim)
                                     for _ in range(depth)])
        self.downsample = PatchMerging(in_dim, out_dim) if downsample else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = None
        for block in self.blocks:
            x, h = block(x)
        return x, (x if self.downsample is None else self.downsample(x)), h


def stage_grids(img_size, stages: int) -> list[tuple[int, int]]:
    """The token grid of each stage for ``img_size`` (height, width) images: the stem's four 3×3 stride-2 padding-1
    convs, then one more such step per stage (each side n -> (n − 1) // 2 + 1)."""
    step = lambda n: (n - 1) // 2 + 1  # noqa: E731
    rows, cols = img_size
    for _ in range(4):
        rows, cols = step(rows), step(cols)
    grids = [(rows, cols)]
    for _ in range(stages - 1):
        grids.append((step(grids[-1][0]), step(grids[-1][1])))
    return grids


def efficientvim_layout(model: nn.Module, img_size) -> StagedLayout:
    """The :class:`StagedLayout` of an EfficientViM (this module's or timm's: it reads ``model.stages[i].blocks``)
    for ``img_size`` images: one :class:`Stage` per stage, the later ones made by the PatchMerging window
    (:data:`DOWNSAMPLE_WINDOW`)."""
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(int(v) for v in img_size)
    grids = stage_grids(size, len(model.stages))
    return StagedLayout(img_size=size, stages=tuple(
        Stage(grid=grid, blocks=len(stage.blocks), downsample=None if i == 0 else DOWNSAMPLE_WINDOW)
        for i, (grid, stage) in enumerate(zip(grids, model.stages))), stream="channels_first")


def efficientvim_blocks(model: nn.Module) -> nn.ModuleList:
    """Every block of every stage of an EfficientViM (this module's or timm's), in execution order, as a new
    (unregistered) ModuleList."""
    return nn.ModuleList([block for stage in model.stages for block in stage.blocks])


class EfficientViM(nn.Module):
    """EfficientViM with timm's names: ``forward(pixels (B, 3, H, W))`` -> logits (B, num_classes).

    Args:
        in_chans, num_classes (0: ``forward`` returns the four pooled features concatenated), embed_dim, depths,
        state_dim (per stage), mlp_ratio, ssd_expand: as timm's. img_size: the image size the explanations are laid
        over (the model itself takes any size). distilled: the ``_dist`` variants' second head set
        (``heads_dist``, ``weights_dist``); eval output ``(logits + logits_dist) / 2`` as timm's.
    """

    def __init__(self, in_chans=3, num_classes=1000, embed_dim=(128, 256, 512), depths=(2, 2, 2), mlp_ratio=4.0,
                 ssd_expand=1.0, state_dim=(49, 25, 9), img_size=224, distilled=False):
        super().__init__()
        if not len(depths) == len(embed_dim) == len(state_dim):
            raise ValueError(f"mamba_captum: depths {depths}, embed_dim {embed_dim} and state_dim {state_dim} must "
                             "give one value per stage.")
        self.num_classes = num_classes
        self.num_layers = len(depths)
        self.embed_dim = tuple(embed_dim)
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.patch_embed = Stem(in_chans, embed_dim[0])
        self.stages = nn.ModuleList([
            EfficientViMStage(embed_dim[i], embed_dim[i + 1] if i < self.num_layers - 1 else 0, depths[i],
                              mlp_ratio, downsample=i < self.num_layers - 1, ssd_expand=ssd_expand,
                              state_dim=state_dim[i]) for i in range(self.num_layers)])
        self.weights = nn.Parameter(torch.ones(self.num_layers + 1))
        self.norm = nn.ModuleList([*[LayerNorm(dim, eps=1e-5) for dim in embed_dim],
                                   LayerNorm2d(embed_dim[-1], eps=1e-5)])
        self.heads = self._heads()
        if distilled:
            self.weights_dist = nn.Parameter(torch.ones(self.num_layers + 1))
            self.heads_dist = self._heads()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def _heads(self) -> nn.ModuleList:
        return nn.ModuleList([nn.Linear(dim, self.num_classes) if self.num_classes > 0 else nn.Identity()
                              for dim in (*self.embed_dim, self.embed_dim[-1])])

    def token_layout(self) -> StagedLayout:
        """The tokens of each stage (:func:`efficientvim_layout`) at ``self.img_size``."""
        return efficientvim_layout(self, self.img_size)

    def stage_blocks(self) -> nn.ModuleList:
        """Every block in execution order (a new ModuleList, not registered)."""
        return efficientvim_blocks(self)

    def forward_features(self, x: torch.Tensor) -> list[torch.Tensor]:
        """pixels -> per stage its last block's h normalised over channels (B, C_s, N_s), and the normalised final
        map (B, C, L)."""
        x = self.patch_embed(x)
        features = []
        for stage, norm in zip(self.stages, self.norm):
            _, x, h = stage(x)
            features.append(norm(h.transpose(1, 2)).transpose(1, 2))
        features.append(self.norm[-1](x).flatten(2))
        return features

    def forward_head(self, features: list[torch.Tensor]) -> torch.Tensor:
        """Each feature's mean over its last axis through its head, summed with ``softmax(weights)``."""
        pooled = [t.mean(-1) for t in features]
        if self.num_classes == 0:
            return torch.cat(pooled, dim=1)
        logits = self._fuse(pooled, self.heads, self.weights)
        if hasattr(self, "heads_dist"):
            logits = (logits + self._fuse(pooled, self.heads_dist, self.weights_dist)) / 2
        return logits

    @staticmethod
    def _fuse(pooled, heads, weights):
        weights = weights.softmax(-1)
        return sum(weights[i] * head(p) for i, (p, head) in enumerate(zip(pooled, heads)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(pixel_values))


def _build(name: str, overrides: dict) -> EfficientViM:
    return EfficientViM(**{**VARIANTS[name], **overrides})


def efficientvim_m1(**overrides) -> EfficientViM:
    """EfficientViM-M1 (embed 128/192/320, depths 2/2/2, states 49/25/9, 224²), randomly initialised;
    ``overrides``: any :class:`EfficientViM` argument."""
    return _build("efficientvim_m1", overrides)


def efficientvim_m2(**overrides) -> EfficientViM:
    """EfficientViM-M2 (embed 128/256/512, depths 2/2/2, states 49/25/9, 224²); as :func:`efficientvim_m1`."""
    return _build("efficientvim_m2", overrides)


def efficientvim_m3(**overrides) -> EfficientViM:
    """EfficientViM-M3 (embed 224/320/512, depths 2/2/2, states 49/25/9, 224²); as :func:`efficientvim_m1`."""
    return _build("efficientvim_m3", overrides)


def efficientvim_m4(**overrides) -> EfficientViM:
    """EfficientViM-M4 (embed 224/320/512, depths 3/4/2, states 64/32/16, 256²); as :func:`efficientvim_m1`."""
    return _build("efficientvim_m4", overrides)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


# where the weights sit in a training checkpoint: timm's order, the EMA weights first
ENVELOPES = ("model_ema", "model", "state_dict")


def read_efficientvim_checkpoint(path) -> dict:
    """The state dict of an EfficientViM checkpoint file (:func:`mamba_captum.vision.read_checkpoint`): a
    ``.safetensors`` file (timm's hub files) or a PyTorch file read with ``weights_only=True`` (the weights alone, or
    under ``"model_ema"`` / ``"model"`` / ``"state_dict"``: the official training checkpoints nest them so, and timm
    prefers the EMA weights).

    Raises:
        FileNotFoundError; ValueError naming what the file holds when it is not a checkpoint.
    """
    return read_checkpoint(path, ENVELOPES)


def detect_efficientvim_config(state: dict) -> dict:
    """The :class:`EfficientViM` arguments that give ``state``'s keys and shapes (timm's names): stages, depths,
    widths, state sizes, the FFN ratio, the SSD expansion, input channels, classes, and the distillation head.

    Raises:
        ValueError: a key the detection needs is missing (not an EfficientViM state dict), or the model is timm's
            reparameterised ("fused") form.
    """
    need = functools.partial(checkpoint_key, state, what="an EfficientViM")

    folded = r"stages\.\d+\.(blocks\.\d+|downsample)\.dwconv[12]\.conv\.bias"  # fuse() gives the convs biases
    fused = sorted(key for key in state if re.fullmatch(folded, key))
    if fused:
        raise ValueError(f"mamba_captum: the state dict is timm's reparameterised (fused) EfficientViM ({fused[0]}: "
                         "BatchNorm and the residual folded into the depthwise convs); load the weights of the model "
                         "before timm.models.reparameterize_model.")
    blocks: dict[int, int] = {}
    for key in state:
        if (m := re.match(r"stages\.(\d+)\.blocks\.(\d+)\.", key)):
            stage, block = int(m.group(1)), int(m.group(2))
            blocks[stage] = max(blocks.get(stage, 0), block + 1)
    if not blocks or sorted(blocks) != list(range(len(blocks))):
        raise ValueError("mamba_captum: the state dict has no stages.{i}.blocks.{j}.* keys for consecutive stages: "
                         "it is not an EfficientViM checkpoint.")
    depths = tuple(blocks[i] for i in range(len(blocks)))
    embed_dim = tuple(int(need(f"stages.{i}.blocks.0.alpha").shape[1]) for i in range(len(depths)))
    state_dim = tuple(int(need(f"stages.{i}.blocks.0.mixer.A").shape[0]) for i in range(len(depths)))
    hz = need("stages.0.blocks.0.mixer.hz_proj.conv.weight").shape[0] // 2
    ffn = need("stages.0.blocks.0.ffn.fc1.conv.weight").shape[0]
    head = state.get("heads.0.weight")
    return dict(in_chans=int(need("patch_embed.conv.0.conv.weight").shape[1]), num_classes=0 if head is None
                else int(head.shape[0]), embed_dim=embed_dim, depths=depths, state_dim=state_dim,
                mlp_ratio=_ratio(ffn, embed_dim[0]), ssd_expand=_ratio(hz, embed_dim[0]),
                distilled="weights_dist" in state)


def _ratio(count: int, dim: int) -> float:
    """count / dim, nudged up where ``int(ratio · dim)`` would round below ``count``."""
    ratio = count / dim
    return ratio if int(ratio * dim) == count else math.nextafter(ratio, math.inf)


def variant_name(config: dict) -> str | None:
    """timm's registered name of a detected config (``efficientvim_m2``; ``_dist`` for the distilled head), if it is
    a released one."""
    for name, sizes in VARIANTS.items():
        if all(tuple(config[key]) == sizes[key] for key in ("embed_dim", "depths", "state_dim")) \
                and config["mlp_ratio"] == 4.0 and config["ssd_expand"] == 1.0:
            return name + ("_dist" if config.get("distilled") else "")
    return None


def _flatten_norms(state: dict, model: EfficientViM) -> dict:
    """The official checkpoints store the LayerNorms' affine parameters broadcast-shaped ((1, C, 1, 1) ...), as
    timm's checkpoint filter says: reshaped to (C,) where the element count fits."""
    own = model.state_dict()
    out = dict(state)
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            for suffix in ("weight", "bias"):
                key = f"{name}.{suffix}"
                if key in out and out[key].shape != own[key].shape and out[key].numel() == own[key].numel():
                    out[key] = out[key].reshape(own[key].shape)
    return out


def load_efficientvim(checkpoint, *, img_size=None, dtype=None, device=None, **overrides) -> EfficientViM:
    """Build the EfficientViM that ``checkpoint`` holds and load its weights key for key; eval mode.

    Args:
        checkpoint: a path (``.safetensors``, timm's hub file; or a PyTorch file read weights-only), a state dict
            (``timm_model.state_dict()`` as it is), a dict with it under ``"model_ema"`` / ``"model"`` /
            ``"state_dict"``, or an ``nn.Module`` (a timm EfficientViM: its ``state_dict()``; a fused one is
            refused).
        img_size: the image size the explanations are laid over (default 256 for M4's shapes, else 224).
        dtype: the model's dtype (default: the stored dtype of the stem's first conv).
        device: where to put the model (default: CPU).
        **overrides: :class:`EfficientViM` arguments, e.g. ``distilled=False`` to drop a ``_dist`` model's second
            head set (as timm does for a non-distilled model: the output changes).

    Returns:
        the :class:`EfficientViM`; ``model.variant`` is timm's registered name when the shapes are a released model's.

    Raises:
        ValueError: naming every missing or unexpected key and shape mismatch, tensors that are not floating point,
            a fused model, or why the file is not a checkpoint.
    """
    record = None
    if isinstance(checkpoint, nn.Module):
        if any(getattr(m, "fused", False) for m in checkpoint.modules()):
            raise ValueError("mamba_captum: this EfficientViM is reparameterised (fused: BatchNorm and the residual "
                             "folded into the depthwise convs); pass the model before "
                             "timm.models.reparameterize_model.")
        state = {k: v.detach() for k, v in checkpoint.state_dict().items()}
    elif isinstance(checkpoint, (str, os.PathLike)):
        record = read_training_record(checkpoint)
        state = read_efficientvim_checkpoint(checkpoint)
    else:
        state = state_dict_of(checkpoint, "the given dict", ENVELOPES)
    config = detect_efficientvim_config(state)
    variant = variant_name(config)
    config.update(overrides)
    if not config.get("distilled"):
        state = {k: v for k, v in state.items() if not (k.startswith("heads_dist.") or k == "weights_dist")}
    img_size = training_image_size(checkpoint, record, img_size)
    if img_size is None:
        img_size = VARIANTS[variant.removesuffix("_dist")]["img_size"] if variant else 224
    check_float_weights(state, "an EfficientViM")
    check_dtype(dtype, "an EfficientViM")
    model = EfficientViM(img_size=img_size, **config)
    model = model.to(state["patch_embed.conv.0.conv.weight"].dtype if dtype is None else dtype)
    load_state_dict_strictly(model, _flatten_norms(state, model))
    model.variant = variant
    apply_training_record(model, record, checkpoint, config["num_classes"])
    if device is not None:
        model = model.to(device=device)
    return model.eval()
