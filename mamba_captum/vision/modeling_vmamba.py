"""VMamba (Liu et al. 2024, MzeroMiko/VMamba) in plain PyTorch, with the official module and parameter names.

The official code (``classification/models/vmamba.py``) runs its scans through CUDA extensions (or a slow torch
fallback). This module computes the same function anywhere: on CPU with the library's chunked selective scan, on
CUDA with mamba-ssm's kernel when it is installed (else Triton). Its ``state_dict`` has the official keys and shapes,
so an official checkpoint loads key for key (:func:`mamba_captum.vision.load_vmamba` detects the variant first).

The model (``VSSM``): a stem (``patch_embed``) to a grid at 1/4 of the image, four stages of VSS blocks, each but the
last followed by a strided downsampling layer (``layers.{i}.downsample``), then ``classifier``: norm, the mean over
the last stage's tokens, ``head``. A VSS block is ``x + op(norm(x))`` then ``x + mlp(norm2(x))`` (no MLP when
``mlp_ratio`` is 0, the v0 models).

The token mixer, SS2D (``op``): ``x (, z) = in_proj(h)``; ``u = silu(conv2d(x))`` (3×3 depthwise over the grid);
four selective scans (S6, Mamba-1's) of u, each over its own order of the grid's tokens — row-major, column-major,
and both reversed — each with its own ``x_proj_weight[k]`` (dt, B, C, shared by the scan's channels),
``dt_projs_weight[k]``, ``dt_projs_bias[k]``, ``A_logs`` and ``Ds`` rows; their outputs (with the D skips) are put
back in token order and summed; ``out_norm`` (LayerNorm over the channels); ``· silu(z)`` in the variants with a gate;
``out_proj``.

Released variants (``forward_type``): "v05_noz" (VMamba-T/S/B v2: d_state 1, no gate, no conv bias, channel-first
with LayerNorm2d, ``downsample`` v3, ``patch_embed`` v2) and "v0" (the first VMamba: d_state 16, gate, conv bias,
channel-last, PatchMerging2D, ``patch_embed`` v1); the other cross-2-D forward types with the same parameters ("v2",
"v3", "v01" ... "v05", with or without "_noz") compute the same function and are accepted. Not built: drop path and
dropout (identities in eval mode), position embeddings (no released model has them), the other scan modes and out
norms of the ablations.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.selective_scan import selective_scan
from ..kernels.grid_orders import cross_scan_orders
from ..layout import check_image_size

# the cross-2-D forward types (official SS2Dv0 / SS2Dv2): same parameters, same function, other kernels
FORWARD_TYPES = ("v0", "v01", "v02", "v03", "v04", "v05", "v2", "v3")


def parse_forward_type(forward_type: str) -> tuple[str, bool]:
    """("v05", False) for "v05_noz": the base type and whether the layer has its output gate z.

    Raises:
        NotImplementedError: a forward type that is not a cross-2-D scan with a LayerNorm out norm.
    """
    base, gated = forward_type, True
    if base.endswith("_noz"):
        base, gated = base[:-len("_noz")], False
    if base not in FORWARD_TYPES or (base == "v0" and not gated):
        raise NotImplementedError(
            f"mamba_captum: VMamba forward_type {forward_type!r} is not supported; supported: "
            f"{', '.join(FORWARD_TYPES)} (and their '_noz' forms but v0's), the four-direction scans with a "
            "LayerNorm out norm of the released models.")
    return base, gated


class Permute(nn.Module):
    """``x.permute(*dims)`` (the official ``Permute``, no parameters)."""

    def __init__(self, *dims):
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.dims)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a channel-first (B, C, H, W) tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


class Linear2d(nn.Linear):
    """A linear map over the channels of a channel-first (B, C, H, W) tensor (a 1×1 conv); its weight is stored
    (out, in) as ``nn.Linear``'s, and a (out, in, 1, 1) conv weight loads too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight[:, :, None, None], self.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if key in state_dict and state_dict[key].dim() == 4:
            state_dict[key] = state_dict[key].flatten(1)
        return super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def channel_norm(dim: int, channel_first: bool) -> nn.LayerNorm:
    return LayerNorm2d(dim) if channel_first else nn.LayerNorm(dim)


class SS2D(nn.Module):
    """The 2-D selective scan mixer (official names: ``in_proj``, ``conv2d``, ``x_proj_weight`` (K, R + 2N, D),
    ``dt_projs_weight`` (K, D, R), ``dt_projs_bias`` (K, D), ``A_logs`` (K·D, N), ``Ds`` (K·D,), ``out_norm``,
    ``out_proj``; K = 4 scans, D = ``d_inner``).

    Args as the official class: ``d_model``, ``d_state``, ``ssm_ratio`` (d_inner = ratio · d_model), ``dt_rank``
    ("auto": ceil(d_model / 16)), ``d_conv`` (3), ``conv_bias``, ``forward_type``, ``channel_first`` (the input and
    output are (B, C, H, W); else (B, H, W, C)).
    """

    k_group = 4

    def __init__(self, d_model: int = 96, d_state: int = 16, ssm_ratio: float = 2.0, dt_rank="auto", d_conv: int = 3,
                 conv_bias: bool = True, forward_type: str = "v2", channel_first: bool = False,
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4):
        super().__init__()
        _, self.gated = parse_forward_type(forward_type)
        if d_conv < 2:
            raise NotImplementedError("mamba_captum: SS2D without its depthwise conv (d_conv < 2) is not supported.")
        self.forward_type = forward_type
        self.d_model, self.d_state = int(d_model), int(d_state)
        self.d_inner = int(ssm_ratio * d_model)
        self.dt_rank = int(math.ceil(self.d_model / 16) if dt_rank == "auto" else dt_rank)
        self.channel_first = channel_first
        self.disable_z = not self.gated
        linear = Linear2d if channel_first else nn.Linear
        self.in_proj = linear(self.d_model, self.d_inner * (2 if self.gated else 1), bias=False)
        self.act = nn.SiLU()
        self.conv2d = nn.Conv2d(self.d_inner, self.d_inner, d_conv, padding=(d_conv - 1) // 2, groups=self.d_inner,
                                bias=conv_bias)
        K, D, R, N = self.k_group, self.d_inner, self.dt_rank, self.d_state
        bound = 1 / math.sqrt(D)  # nn.Linear's default init of the stacked x projections
        self.x_proj_weight = nn.Parameter(torch.empty(K, R + 2 * N, D).uniform_(-bound, bound))
        std = R ** -0.5
        self.dt_projs_weight = nn.Parameter(torch.empty(K, D, R).uniform_(-std, std))
        dt = torch.exp(torch.rand(K, D) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        self.dt_projs_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        self.A_logs = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(K * D, 1))
        self.Ds = nn.Parameter(torch.ones(K * D))
        self.out_norm = channel_norm(D, channel_first)
        self.out_proj = linear(D, self.d_model, bias=False)

    def scans(self, u: torch.Tensor) -> torch.Tensor:
        """The four selective scans of u (B, D, H, W), D skips included, summed in token order: (B, D, H, W), in the
        scan's precision (float32, or float64 for a float64 layer)."""
        batch, channels, rows, cols = u.shape
        K, D, R, N = self.k_group, self.d_inner, self.dt_rank, self.d_state
        keep = torch.float64 if u.dtype == torch.float64 else torch.float32
        tokens = u.flatten(2)  # (B, D, L) row-major
        orders = cross_scan_orders(rows, cols, u.device)
        A = -torch.exp(self.A_logs.to(keep)).view(K, D, N)
        skips, biases = self.Ds.to(keep).view(K, D), self.dt_projs_bias.to(keep)
        total = torch.zeros(batch, D, rows * cols, dtype=keep, device=u.device)
        for k in range(K):
            seq = tokens[:, :, orders[k]]  # (B, D, L) in scan order k
            projected = torch.einsum("cd,bdl->bcl", self.x_proj_weight[k].to(seq.dtype), seq)
            dt_low, B, C = torch.split(projected, [R, N, N], dim=1)
            delta = torch.einsum("dr,brl->bdl", self.dt_projs_weight[k].to(seq.dtype), dt_low)
            y = selective_scan(seq.to(keep), delta.to(keep), A[k], B.to(keep).contiguous(), C.to(keep).contiguous(),
                               D=skips[k], delta_bias=biases[k], delta_softplus=True)
            total[:, :, orders[k]] += y.to(keep)  # back to token order
        return total.view(batch, D, rows, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) (channel_first) or (B, H, W, C) -> the same shape."""
        x = self.in_proj(x)
        z = None
        if self.gated:
            x, z = x.chunk(2, dim=1 if self.channel_first else -1)
            z = self.act(z)
        if not self.channel_first:
            x = x.permute(0, 3, 1, 2)
        u = self.act(self.conv2d(x))
        y = self.scans(u)
        if not self.channel_first:
            y = y.permute(0, 2, 3, 1)
        y = self.out_norm(y.to(self.out_norm.weight.dtype) if y.dtype != torch.float64 else y).to(x.dtype)
        if z is not None:
            y = y * z
        return self.out_proj(y)


class Mlp(nn.Module):
    """``fc2(gelu(fc1(x)))`` over the channels (official ``Mlp``)."""

    def __init__(self, dim: int, hidden: int, channel_first: bool):
        super().__init__()
        linear = Linear2d if channel_first else nn.Linear
        self.fc1 = linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VSSBlock(nn.Module):
    """``x + op(norm(x))``, then ``x + mlp(norm2(x))`` when ``mlp_ratio`` > 0 (official names)."""

    def __init__(self, hidden_dim: int, channel_first: bool, mlp_ratio: float = 4.0, **ssm):
        super().__init__()
        self.norm = channel_norm(hidden_dim, channel_first)
        self.op = SS2D(d_model=hidden_dim, channel_first=channel_first, **ssm)
        self.mlp_branch = mlp_ratio > 0
        if self.mlp_branch:
            self.norm2 = channel_norm(hidden_dim, channel_first)
            self.mlp = Mlp(hidden_dim, int(hidden_dim * mlp_ratio), channel_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.op(self.norm(x))
        if self.mlp_branch:
            x = x + self.mlp(self.norm2(x))
        return x


class PatchMerging2D(nn.Module):
    """The v1 downsampling: each 2×2 window's four tokens concatenated (official order: (0,0), (1,0), (0,1), (1,1)),
    ``norm`` (over 4C), ``reduction`` (4C -> out, no bias). Odd grids are padded at the end, as the official."""

    def __init__(self, dim: int, out_dim: int, channel_first: bool):
        super().__init__()
        self.channel_first = channel_first
        linear = Linear2d if channel_first else nn.Linear
        self.reduction = linear(4 * dim, out_dim, bias=False)
        self.norm = channel_norm(4 * dim, channel_first)

    def forward(self, x):
        if not self.channel_first:
            x = x.permute(0, 3, 1, 2)
        rows, cols = x.shape[-2:]
        x = F.pad(x, (0, cols % 2, 0, rows % 2))
        x = torch.cat([x[..., 0::2, 0::2], x[..., 1::2, 0::2], x[..., 0::2, 1::2], x[..., 1::2, 1::2]], dim=1)
        if not self.channel_first:
            x = x.permute(0, 2, 3, 1)
        return self.reduction(self.norm(x))


def _to_first(channel_first):
    return nn.Identity() if channel_first else Permute(0, 3, 1, 2)


def _to_last(channel_first):
    return nn.Identity() if channel_first else Permute(0, 2, 3, 1)


def make_patch_embed(version: str, in_chans: int, dim: int, patch_size: int, channel_first: bool) -> nn.Sequential:
    """The official stems: "v1" a patch_size-strided conv and a norm (``patch_embed.0``, ``.2``); "v2" two 3×3
    stride-2 convs with a norm and GELU between them (``patch_embed.0``, ``.2``, ``.5``, ``.7``)."""
    if version == "v1":
        return nn.Sequential(nn.Conv2d(in_chans, dim, patch_size, stride=patch_size), _to_last(channel_first),
                             channel_norm(dim, channel_first))
    if version == "v2":
        stride = patch_size // 2
        return nn.Sequential(
            nn.Conv2d(in_chans, dim // 2, stride + 1, stride=stride, padding=1), _to_last(channel_first),
            channel_norm(dim // 2, channel_first), _to_first(channel_first), nn.GELU(),
            nn.Conv2d(dim // 2, dim, stride + 1, stride=stride, padding=1), _to_last(channel_first),
            channel_norm(dim, channel_first))
    raise NotImplementedError(f"mamba_captum: VMamba patchembed_version {version!r}; supported: 'v1', 'v2'.")


def patch_embed_window(version: str, patch_size: int) -> tuple[tuple[int, int, int], ...]:
    """The stem's conv windows (kernel, stride, padding), in order."""
    if version == "v1":
        return ((patch_size, patch_size, 0),)
    stride = patch_size // 2
    return ((stride + 1, stride, 1), (stride + 1, stride, 1))


DOWNSAMPLE_WINDOWS = {"v1": (2, 2, 0), "v2": (2, 2, 0), "v3": (3, 2, 1)}


def make_downsample(version: str, dim: int, out_dim: int, channel_first: bool) -> nn.Module:
    """The official downsampling layers: "v1" PatchMerging2D, "v2" a 2×2 stride-2 conv and a norm, "v3" a 3×3
    stride-2 conv (padding 1) and a norm (``downsample.1``, ``.3``)."""
    if version == "v1":
        return PatchMerging2D(dim, out_dim, channel_first)
    if version not in DOWNSAMPLE_WINDOWS:
        raise NotImplementedError(f"mamba_captum: VMamba downsample_version {version!r}; supported: "
                                  f"{sorted(DOWNSAMPLE_WINDOWS)}.")
    kernel, stride, padding = DOWNSAMPLE_WINDOWS[version]
    return nn.Sequential(_to_first(channel_first), nn.Conv2d(dim, out_dim, kernel, stride=stride, padding=padding),
                         _to_last(channel_first), channel_norm(out_dim, channel_first))


def _conv_out(size: int, window) -> int:
    kernel, stride, padding = window
    return (size + 2 * padding - kernel) // stride + 1


class VSSM(nn.Module):
    """VMamba: a stem, four stages of VSS blocks with downsampling between them, a pooled linear head.

    Args (the official constructor's names): ``patch_size`` (4), ``in_chans``, ``num_classes``, ``depths``, ``dims``
    (an int: doubled per stage), ``ssm_d_state``, ``ssm_ratio``, ``ssm_dt_rank``, ``ssm_conv``, ``ssm_conv_bias``,
    ``forward_type``, ``mlp_ratio``, ``norm_layer`` ("ln": channel-last, "ln2d": channel-first), ``downsample_version``
    ("v1", "v2", "v3"), ``patchembed_version`` ("v1", "v2"); and ``img_size``, the input size (an int or
    (height, width): VMamba has no position embeddings, so the weights fit any size; this one fixes the token grids).

    ``forward(pixel_values)`` -> logits (B, num_classes). :meth:`token_layout` gives the stages' grids and
    :meth:`stage_blocks` the blocks in order (the multi-stage contract of :mod:`mamba_captum.layout`).
    """

    class_names = None  # set per model (load_vmamba, from training.json beside the checkpoint)
    crop_pct = 0.875  # the official evaluation transform's (timm's default); load_vmamba takes training.json's

    def __init__(self, patch_size=4, in_chans=3, num_classes=1000, depths=(2, 2, 9, 2), dims=96, ssm_d_state=16,
                 ssm_ratio=2.0, ssm_dt_rank="auto", ssm_conv=3, ssm_conv_bias=True, forward_type="v2",
                 mlp_ratio=4.0, norm_layer="ln", downsample_version="v2", patchembed_version="v1", img_size=224):
        super().__init__()
        if norm_layer.lower() not in ("ln", "ln2d"):
            raise NotImplementedError(f"mamba_captum: VMamba norm_layer {norm_layer!r}; supported: 'ln', 'ln2d'.")
        self.channel_first = norm_layer.lower() == "ln2d"
        if isinstance(dims, int):
            dims = [dims * 2 ** i for i in range(len(depths))]
        self.dims, self.depths = list(dims), list(depths)
        self.num_classes, self.num_features = num_classes, self.dims[-1]
        self.patch_size = patch_size
        self.downsample_version, self.patchembed_version = downsample_version, patchembed_version
        self._img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.patch_embed = make_patch_embed(patchembed_version, in_chans, self.dims[0], patch_size,
                                            self.channel_first)
        ssm = dict(d_state=ssm_d_state, ssm_ratio=ssm_ratio, dt_rank=ssm_dt_rank, d_conv=ssm_conv,
                   conv_bias=ssm_conv_bias, forward_type=forward_type)
        self.layers = nn.ModuleList()
        for index, (dim, depth) in enumerate(zip(self.dims, self.depths)):
            last = index == len(self.dims) - 1
            downsample = nn.Identity() if last else make_downsample(downsample_version, dim, self.dims[index + 1],
                                                                   self.channel_first)
            blocks = nn.Sequential(*[VSSBlock(dim, self.channel_first, mlp_ratio, **ssm) for _ in range(depth)])
            self.layers.append(nn.Sequential(OrderedDict(blocks=blocks, downsample=downsample)))
        self.classifier = nn.Sequential(OrderedDict(
            norm=channel_norm(self.num_features, self.channel_first),
            permute=_to_first(self.channel_first),
            avgpool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(1),
            head=nn.Linear(self.num_features, num_classes)))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        """The official initialisation: truncated-normal linear weights (std 0.02), zero biases, unit norms."""
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    @property
    def img_size(self) -> tuple[int, int]:
        """The input image size (height, width): what :func:`mamba_captum.vision.preprocess` takes as ``img_size``."""
        return self._img_size

    @img_size.setter
    def img_size(self, size):
        self._img_size = (size, size) if isinstance(size, int) else tuple(size)

    # -- where the tokens are -----------------------------------------------------------------------------------
    def grids(self) -> list[tuple[int, int]]:
        """The token grid (rows, columns) of each stage at :attr:`img_size`."""
        grid = list(self.img_size)
        for window in patch_embed_window(self.patchembed_version, self.patch_size):
            grid = [_conv_out(n, window) for n in grid]
        grids = [tuple(grid)]
        for _ in self.dims[1:]:
            if self.downsample_version == "v1":  # PatchMerging2D pads odd grids at the end
                grid = [(n + 1) // 2 for n in grid]
            else:
                grid = [_conv_out(n, DOWNSAMPLE_WINDOWS[self.downsample_version]) for n in grid]
            grids.append(tuple(grid))
        return grids

    def token_layout(self):
        """The :class:`mamba_captum.layout.StagedLayout`: each stage's grid, block count and downsampling window."""
        from ..layout import Stage, StagedLayout

        window = DOWNSAMPLE_WINDOWS[self.downsample_version]
        stages = tuple(Stage(grid=grid, blocks=depth, downsample=None if index == 0 else window)
                       for index, (grid, depth) in enumerate(zip(self.grids(), self.depths)))
        return StagedLayout(img_size=self.img_size, stages=stages,
                            stream="channels_first" if self.channel_first else "channels_last")

    def stage_blocks(self) -> nn.ModuleList:
        """Every VSS block of every stage in execution order (a new list, not registered on the model)."""
        return nn.ModuleList([block for layer in self.layers for block in layer.blocks])

    # -- forward --------------------------------------------------------------------------------------------------
    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the last stage's tokens, channel-first (B, C_last, rows, cols) or channel-last."""
        check_image_size(pixel_values, self.img_size, "resize it, e.g. with preprocess(image, img_size=model.img_size), "
                         "or set model.img_size: VMamba takes any size")
        x = self.patch_embed(pixel_values)
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, num_classes): ``classifier`` (norm, mean over the last stage's tokens, head)."""
        return self.classifier(self.forward_features(pixel_values))
