"""MambaVision (Hatamizadeh & Kautz, CVPR 2025) in plain PyTorch, with the official module and parameter names.

The official code (NVlabs/MambaVision, ``mambavision/models/mamba_vision.py``; the ``mambavision`` pip package and
the HF hub's ``trust_remote_code`` copy wrap the same class) imports mamba-ssm's CUDA scan and timm. This module
computes the same function anywhere: on CPU with the library's chunked selective scan, on CUDA with mamba-ssm's
kernel when it is installed (else Triton). Its ``state_dict`` has the official keys and shapes, so an official
checkpoint loads key for key (:func:`mamba_captum.vision.load_mambavision` detects the variant first).

Forward (``pixels`` (B, 3, H, W) -> logits (B, classes)):

1. ``patch_embed.conv_down``: Conv 3×3 s2 → BN → ReLU → Conv 3×3 s2 → BN → ReLU: a (B, dim, H/4, W/4) grid;
2. four levels at H/4, H/8, H/16, H/32 with ``dim · 2^i`` channels, each followed (except the last) by
   ``downsample.reduction.0`` (Conv 3×3 s2 p1, no bias, doubling the channels):
   - levels 0 and 1: :class:`MambaVisionConvBlock` s, ``x + BN(conv(GELU_tanh(BN(conv(x)))))`` (full 3×3
     convs);
   - levels 2 and 3: the grid is zero-padded on the right and bottom to a multiple of the level's window, and each
     :class:`Block` is ``x + γ₁ · mixer(LN(x))``, ``x + γ₂ · mlp(LN(x))`` where the mixer runs inside each
     ``window × window`` window (tokens row-major within it): a :class:`MambaVisionMixer` in the first half of the
     level's blocks, softmax :class:`MambaVisionAttention` in the rest (with an odd depth the Mamba half is the
     larger); the padding is cropped after the level's last block. γ are learned per-channel scales
     (``gamma_1`` / ``gamma_2``, the B and L models) or 1;
3. ``norm`` (BatchNorm2d), the mean over the last grid, ``head``.

The mixer (:class:`MambaVisionMixer`, d_state 8, conv width 3, expand 1): ``x, z = in_proj(h)`` (C/2 channels
each); ``x ← silu(conv1d_x(x))``, ``z ← silu(conv1d_z(z))`` (depthwise, zero 'same' padding: non-causal, no bias);
``y = S6(x) + D·x`` (mamba-ssm's selective scan, causal over the window's tokens, Δ = softplus(dt_proj(dt) +
dt_proj.bias): the official code adds the bias twice, once in ``dt_proj`` and once as the scan's ``delta_bias``);
``out = out_proj(cat([y, z]))``: z is concatenated, not a gate.

Where the engine looks: ``stage_blocks()`` lists every block of every level in order, each taking and returning the
level's (padded) grid (B, C, H, W); the token mixers (:class:`MambaVisionMixer`, :class:`MambaVisionAttention`)
take the grid channel-last (B, H, W, C) (``norm1``'s output) and window it themselves (a (B, N, C) input is one
window); the convs of a :class:`MambaVisionConvBlock` mix tokens too (3×3 neighbourhoods, across channels).

The class names differ from the official ones where those are generic (``Attention`` -> MambaVisionAttention,
``ConvBlock`` -> MambaVisionConvBlock): the engine finds token mixers by class name. Module and parameter names
(what the state dict holds) are the official ones.

Not built: drop path and dropout (training regularisers, identities in eval mode). BatchNorm runs as the module's
mode says; explanations and the tests use eval mode (running statistics).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.selective_scan import selective_scan
from ..kernels.windows import grid_to_windows, windows_to_grid
from ..layout import Stage, StagedLayout, check_image_size


# -- windows ------------------------------------------------------------------------------------------------------
# grid_to_windows / windows_to_grid: the window order the adapters scatter the windows' operators back with
# (mamba_captum.kernels.windows), re-exported here beside the official helpers' contracts.


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """The official helper's contract: (B, C, H, W) -> (B · nW, window², C) (see :func:`grid_to_windows`)."""
    return grid_to_windows(x.permute(0, 2, 3, 1), window)


def window_reverse(windows: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """The official helper's contract: (B · nW, window², C) -> (B, C, H, W), the inverse of
    :func:`window_partition`."""
    return windows_to_grid(windows, window, height, width).permute(0, 3, 1, 2)


def _windowed(mix, hidden: torch.Tensor, window: int | None) -> torch.Tensor:
    """Apply a sequence mixer (N, T, C) -> (N, T, C) to each window of a channel-last grid (B, H, W, C), or to a
    (B, N, C) sequence as it is."""
    if hidden.dim() == 3:
        return mix(hidden)
    if hidden.dim() != 4:
        raise ValueError(f"mamba_captum: a MambaVision mixer takes (B, H, W, C) or (B, N, C); got "
                         f"{tuple(hidden.shape)}.")
    batch, height, width, channels = hidden.shape
    if window is None:  # the whole grid is one window, row-major
        return mix(hidden.reshape(batch, height * width, channels)).reshape(hidden.shape)
    if height % window or width % window:
        raise ValueError(f"mamba_captum: a {height}×{width} grid is not a whole number of {window}×{window} windows "
                         "(MambaVisionLayer pads it before its blocks).")
    return windows_to_grid(mix(grid_to_windows(hidden, window)), window, height, width)


# -- the stem, the downsampling and the conv blocks -------------------------------------------------------------
class PatchEmbed(nn.Module):
    """The stem (official names ``proj`` (an identity) and ``conv_down``): two 3×3 stride-2 convs with BatchNorm
    (eps 1e-4) and ReLU, (B, in_chans, H, W) -> (B, dim, ⌈H/4⌉, ⌈W/4⌉)."""

    def __init__(self, in_chans: int = 3, in_dim: int = 64, dim: int = 96):
        super().__init__()
        self.proj = nn.Identity()
        self.conv_down = nn.Sequential(
            nn.Conv2d(in_chans, in_dim, 3, 2, 1, bias=False), nn.BatchNorm2d(in_dim, eps=1e-4), nn.ReLU(),
            nn.Conv2d(in_dim, dim, 3, 2, 1, bias=False), nn.BatchNorm2d(dim, eps=1e-4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_down(self.proj(x))


class Downsample(nn.Module):
    """``reduction.0``: Conv2d 3×3, stride 2, padding 1, no bias, dim -> 2·dim (dim with ``keep_dim``)."""

    def __init__(self, dim: int, keep_dim: bool = False):
        super().__init__()
        self.reduction = nn.Sequential(nn.Conv2d(dim, dim if keep_dim else 2 * dim, 3, 2, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduction(x)


class MambaVisionConvBlock(nn.Module):
    """Levels 0 and 1: ``x + γ · BN(conv2(GELU_tanh(BN(conv1(x)))))`` on (B, C, H, W); the convs are full 3×3 ones
    (all channels, bias, padding 1). γ (``gamma``) only with a numeric ``layer_scale`` (no released model)."""

    def __init__(self, dim: int, layer_scale=None, kernel_size: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, kernel_size=kernel_size, stride=1, padding=1)
        self.norm1 = nn.BatchNorm2d(dim, eps=1e-5)
        self.act1 = nn.GELU(approximate="tanh")
        self.conv2 = nn.Conv2d(dim, dim, kernel_size=kernel_size, stride=1, padding=1)
        self.norm2 = nn.BatchNorm2d(dim, eps=1e-5)
        self.layer_scale = isinstance(layer_scale, (int, float)) and not isinstance(layer_scale, bool)
        if self.layer_scale:
            self.gamma = nn.Parameter(layer_scale * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W)."""
        branch = self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x)))))
        if self.layer_scale:
            branch = branch * self.gamma.view(1, -1, 1, 1)
        return x + branch


# -- the token mixers ---------------------------------------------------------------------------------------------
class MambaVisionMixer(nn.Module):
    """MambaVision's Mamba mixer over each window's tokens (official names ``in_proj``, ``conv1d_x``, ``conv1d_z``,
    ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``).

    Args as the official constructor: ``d_model``; ``d_state`` (8 in every released block), ``d_conv`` (3),
    ``expand`` (1: ``in_proj`` gives d_model channels, split into x and z of d_model / 2), ``dt_rank``
    ("auto": ceil(d_model / 16)), ``conv_bias`` (the official ``bias=conv_bias // 2`` makes it False for True),
    ``bias`` (the projections; False). ``window_size``: the window its (B, H, W, C) input is cut into (set by the
    level; None: the whole grid is one window).
    """

    def __init__(self, d_model: int, d_state: int = 8, d_conv: int = 3, expand: int = 1, dt_rank="auto",
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4, conv_bias: bool = True,
                 bias: bool = False, window_size: int | None = None):
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        half = self.d_inner // 2
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.window_size = window_size
        self.level_grid = None  # the level's grid before its padding to whole windows (set by MambaVision)
        self.in_proj = nn.Linear(d_model, self.d_inner, bias=bias)
        self.x_proj = nn.Linear(half, self.dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, half, bias=True)
        std = self.dt_rank ** -0.5
        nn.init.uniform_(self.dt_proj.weight, -std, std)
        # mamba-ssm's time-step initialisation: softplus(bias) log-uniform in [dt_min, dt_max]
        dt = torch.exp(torch.rand(half) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(half, 1))
        self.D = nn.Parameter(torch.ones(half))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)
        conv_has_bias = bool(int(conv_bias) // 2)  # the official ``bias=conv_bias // 2``: no bias for True
        self.conv1d_x = nn.Conv1d(half, half, kernel_size=d_conv, groups=half, bias=conv_has_bias)
        self.conv1d_z = nn.Conv1d(half, half, kernel_size=d_conv, groups=half, bias=conv_has_bias)

    def mix(self, hidden: torch.Tensor) -> torch.Tensor:
        """One sequence per row: (N, T, d_model) -> (N, T, d_model)."""
        x, z = self.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)  # (N, C/2, T) each
        groups = self.d_inner // 2
        x = F.silu(F.conv1d(x, self.conv1d_x.weight, self.conv1d_x.bias, padding="same", groups=groups))
        z = F.silu(F.conv1d(z, self.conv1d_z.weight, self.conv1d_z.bias, padding="same", groups=groups))
        dt, B, C = torch.split(self.x_proj(x.transpose(1, 2)), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = self.dt_proj(dt).transpose(1, 2)  # with its bias: the scan adds the bias a second time (official)
        keep = torch.float64 if self.A_log.dtype == torch.float64 else torch.float32  # A, D, Δ bias in float32
        A = -torch.exp(self.A_log.to(keep))
        y = selective_scan(x, delta.contiguous(), A, B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(),
                           D=self.D.to(keep), z=None, delta_bias=self.dt_proj.bias.to(keep), delta_softplus=True)
        return self.out_proj(torch.cat([y.to(x.dtype), z], dim=1).transpose(1, 2))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, H, W, d_model) grid, mixed within each window, or one (B, N, d_model) sequence -> the same shape."""
        return _windowed(self.mix, hidden_states, self.window_size)


class MambaVisionAttention(nn.Module):
    """Softmax self-attention over each window's tokens (official names ``qkv``, ``q_norm``, ``k_norm``, ``proj``):
    ``softmax(q kᵀ / sqrt(head_dim)) v`` per head, no mask, no position bias. ``qk_norm``: a LayerNorm over each
    head's q and k (no released model). ``window_size`` as :class:`MambaVisionMixer`."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 window_size: int | None = None):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"mamba_captum: MambaVision attention of width {dim} cannot have {num_heads} heads.")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.window_size = window_size
        self.level_grid = None  # as MambaVisionMixer's
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)

    def mix(self, hidden: torch.Tensor) -> torch.Tensor:
        """One sequence per row: (N, T, dim) -> (N, T, dim)."""
        count, length, dim = hidden.shape
        q, k, v = self.qkv(hidden).reshape(count, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(q, k, v)  # the default scale: head_dim ** -0.5
        return self.proj(out.transpose(1, 2).reshape(count, length, dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, H, W, dim) grid, attending within each window, or one (B, N, dim) sequence -> the same shape."""
        return _windowed(self.mix, hidden_states, self.window_size)


class Mlp(nn.Module):
    """timm's Mlp as the official blocks use it: ``fc2(GELU(fc1(x)))`` (exact GELU)."""

    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Levels 2 and 3: ``x + γ₁ · mixer(norm1(x))``, then ``x + γ₂ · mlp(norm2(x))`` (official names ``norm1``,
    ``mixer``, ``norm2``, ``mlp``, ``gamma_1``, ``gamma_2``), on the level's (padded) grid (B, C, H, W); the mixer
    (:class:`MambaVisionAttention` when ``attention`` else :class:`MambaVisionMixer`) works within windows of
    ``window_size``.
    γ are parameters only with a numeric ``layer_scale`` (B and L models: 1e-5 at initialisation), else 1."""

    def __init__(self, dim: int, num_heads: int, window_size: int, attention: bool, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, qk_norm: bool = False, layer_scale=None, d_state: int = 8, d_conv: int = 3):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        if attention:
            self.mixer = MambaVisionAttention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                              window_size=window_size)
        else:
            self.mixer = MambaVisionMixer(dim, d_state=d_state, d_conv=d_conv, expand=1, window_size=window_size)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        if isinstance(layer_scale, (int, float)) and not isinstance(layer_scale, bool):
            self.gamma_1 = nn.Parameter(layer_scale * torch.ones(dim))
            self.gamma_2 = nn.Parameter(layer_scale * torch.ones(dim))
        else:
            self.gamma_1 = self.gamma_2 = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W); H and W multiples of the window."""
        tokens = x.permute(0, 2, 3, 1)  # channel-last: the norms, the mixer and the MLP act on the last dim
        tokens = tokens + self.gamma_1 * self.mixer(self.norm1(tokens))
        tokens = tokens + self.gamma_2 * self.mlp(self.norm2(tokens))
        return tokens.permute(0, 3, 1, 2)


def attention_blocks(depth: int) -> range:
    """The official placement of the attention blocks in a level of ``depth`` blocks: the last ``depth // 2`` (an
    odd depth keeps one more Mamba block)."""
    return range(depth // 2 + 1, depth) if depth % 2 else range(depth // 2, depth)


class MambaVisionLayer(nn.Module):
    """One level (official names ``blocks``, ``downsample``): ConvBlocks (``conv=True``) or windowed Blocks, then
    the downsampling conv (None in the last level)."""

    def __init__(self, dim: int, depth: int, num_heads: int, window_size: int, conv: bool = False,
                 downsample: bool = True, mlp_ratio: float = 4.0, qkv_bias: bool = True, qk_norm: bool = False,
                 layer_scale=None, layer_scale_conv=None, d_state: int = 8, d_conv: int = 3):
        super().__init__()
        self.conv = conv
        self.transformer_block = not conv
        self.window_size = window_size
        if conv:
            self.blocks = nn.ModuleList([MambaVisionConvBlock(dim, layer_scale=layer_scale_conv)
                                         for _ in range(depth)])
        else:
            attention = set(attention_blocks(depth))
            self.blocks = nn.ModuleList([
                Block(dim, num_heads, window_size, attention=index in attention, mlp_ratio=mlp_ratio,
                      qkv_bias=qkv_bias, qk_norm=qk_norm, layer_scale=layer_scale, d_state=d_state, d_conv=d_conv)
                for index in range(depth)])
        self.downsample = Downsample(dim) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 2C, ⌈H/2⌉, ⌈W/2⌉) (the last level: (B, C, H, W))."""
        height, width = x.shape[-2:]
        if self.transformer_block:  # zero padding to whole windows; the padded tokens run through the blocks too
            size = self.window_size
            x = F.pad(x, (0, (size - width % size) % size, 0, (size - height % size) % size))
        for block in self.blocks:
            x = block(x)
        if self.transformer_block:
            x = x[:, :, :height, :width].contiguous()
        return x if self.downsample is None else self.downsample(x)


def _halved(size: int) -> int:
    """A 3×3, stride-2, padding-1 conv's output size."""
    return (size - 1) // 2 + 1


class MambaVision(nn.Module):
    """MambaVision: a conv stem, two conv levels, two windowed Mamba/attention levels, BatchNorm, mean pool, head.

    Args (the official constructor's names):
        dim: the first level's channels (each level doubles them); in_dim: the stem's middle channels.
        depths, num_heads, window_size: per level (window_size matters in the windowed levels 2 and 3).
        mlp_ratio, qkv_bias, qk_scale (the official name of qk_norm: a LayerNorm on q and k), layer_scale (γ of the
            windowed blocks: a number makes them parameters), layer_scale_conv (the same for the ConvBlocks).
        in_chans, num_classes (0: no head, the pooled features are returned).
        img_size: the input size (an int or (height, width)); the official model accepts any size, this one checks
            it, so that :meth:`token_layout` describes the grids the forward runs on. ``resolution`` is its
            official name (accepted).
        d_state, d_conv: the Mamba mixers' state size and conv width (8 and 3, fixed in the official code).

    ``forward(pixels)`` -> logits (B, num_classes). :meth:`token_layout` gives the stages' grids, :meth:`stage_blocks`
    the blocks in execution order. Attributes ``crop_pct``, ``class_names`` and ``variant`` as :class:`VisionMamba`.
    """

    class_names = None
    crop_pct = 1.0  # mamba_vision_T's evaluation crop; the loader and the constructors set the variant's
    variant = None

    def __init__(self, dim: int, in_dim: int, depths, window_size, mlp_ratio: float, num_heads, in_chans: int = 3,
                 num_classes: int = 1000, qkv_bias: bool = True, qk_scale=None, layer_scale=None,
                 layer_scale_conv=None, img_size=224, resolution=None, d_state: int = 8, d_conv: int = 3):
        super().__init__()
        depths, num_heads, window_size = list(depths), list(num_heads), list(window_size)
        if not len(depths) == len(num_heads) == len(window_size):
            raise ValueError(f"mamba_captum: depths {depths}, num_heads {num_heads} and window_size {window_size} "
                             "must give one value per level.")
        if resolution is not None:
            img_size = resolution
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(int(v) for v in img_size)
        self.depths, self.num_heads, self.window_size = depths, num_heads, window_size
        self.num_classes = num_classes
        self.num_features = int(dim * 2 ** (len(depths) - 1))
        self.patch_embed = PatchEmbed(in_chans=in_chans, in_dim=in_dim, dim=dim)
        self.levels = nn.ModuleList([
            MambaVisionLayer(int(dim * 2 ** i), depths[i], num_heads[i], window_size[i], conv=i < 2,
                             downsample=i < len(depths) - 1, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                             qk_norm=bool(qk_scale), layer_scale=layer_scale, layer_scale_conv=layer_scale_conv,
                             d_state=d_state, d_conv=d_conv)
            for i in range(len(depths))])
        self.norm = nn.BatchNorm2d(self.num_features)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)
        # each windowed mixer knows its level's grid before the padding to whole windows: an operator over a padded
        # grid (padding tokens mixed with the real ones) is not over the StagedLayout's tokens (the adapter refuses it)
        for grid, level in zip(self.stage_grids(), self.levels):
            for block in level.blocks:
                if hasattr(block, "mixer"):
                    block.mixer.level_grid = grid

    @staticmethod
    def _init_weights(module):
        """The official initialisation: truncated normal linear weights (std 0.02, zero biases), unit norms."""
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, nn.BatchNorm2d)) and module.weight is not None:
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    # -- where the tokens are -------------------------------------------------------------------------------------
    def stage_grids(self) -> list[tuple[int, int]]:
        """(rows, columns) of each level's grid: the stem's two stride-2 convs, then one per downsample."""
        grid = tuple(_halved(_halved(size)) for size in self.img_size)
        grids = [grid]
        for _ in self.levels[1:]:
            grid = tuple(_halved(size) for size in grid)
            grids.append(grid)
        return grids

    def token_layout(self) -> StagedLayout:
        """The :class:`mamba_captum.layout.StagedLayout`: one stage per level (H/4, H/8, H/16, H/32 at 224² and
        similar), each made by a 3×3 stride-2 padding-1 conv from the previous one."""
        stages = tuple(Stage(grid=grid, blocks=len(level.blocks), downsample=None if index == 0 else (3, 2, 1))
                       for index, (grid, level) in enumerate(zip(self.stage_grids(), self.levels)))
        return StagedLayout(img_size=self.img_size, stages=stages, stream="channels_first")

    def stage_blocks(self) -> nn.ModuleList:
        """Every block of every level in execution order (a new, unregistered list: the state dict is unchanged)."""
        return nn.ModuleList([block for level in self.levels for block in level.blocks])

    # -- forward --------------------------------------------------------------------------------------------------
    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the pooled features (B, num_features): ``norm`` then the mean over the last grid."""
        check_image_size(pixel_values, self.img_size, "resize it, e.g. with preprocess(image, model=model), or build "
                         "the model with img_size=")
        x = self.patch_embed(pixel_values)
        for level in self.levels:
            x = level(x)
        return self.avgpool(self.norm(x)).flatten(1)

    def forward(self, pixel_values: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, num_classes) (the pooled features with ``return_features=True``)."""
        features = self.forward_features(pixel_values)
        return features if return_features else self.head(features)
