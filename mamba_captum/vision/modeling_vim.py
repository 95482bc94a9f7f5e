"""Vision Mamba (Vim, Zhu et al. 2024) in plain PyTorch, with the official module and parameter names.

The official code (hustvl/Vim, ``vim/models_mamba.py`` and its fork of mamba-ssm 1.1.1) needs mamba-ssm's CUDA
kernels to run at all. This module computes the same function anywhere: on CPU with the library's chunked
selective scan, on CUDA with mamba-ssm's kernel when it is installed (else Triton). Its ``state_dict`` has the
official keys and shapes, so ``model.load_state_dict(torch.load(path)["model"])`` takes an official checkpoint as
it is (:func:`mamba_captum.vision.load_vim` detects the variant first).

Forward, as the released ``*_bimambav2_final_pool_mean_abs_pos_embed_with_midclstok_div2`` models:

1. ``patch_embed.proj`` (Conv2d, kernel = patch size, stride 16 or 8), flattened row-major to (B, M, D);
2. the CLS token inserted at ``M // 2`` (``cls_position="middle"``), then ``+ pos_embed``;
3. 24 blocks ``r ← r + mixer(norm(r))`` (the official "Add → RMSNorm → Mixer" with the residual carried
   separately is the same function; the residual stream is kept in float32, as ``residual_in_fp32``);
4. ``norm_f`` (RMSNorm), the CLS row (or the mean over tokens without a CLS token), ``head``.

The bimamba v2 mixer (:class:`VimMixer`): ``x, z = in_proj(h)``; a forward scan (conv1d, x_proj, dt_proj, A_log, D)
on ``(x, z)`` and a backward scan (the ``_b`` parameters) on the time-reversed ``(x, z)``, reversed back; each is
``(S6(u) + D·u) · silu(z)`` with ``u = silu(conv(x) + b)``; ``out = out_proj((y_fwd + y_bwd) / 2)``.

Not built: drop path and dropout (training regularisers, identities in eval mode), RoPE and the double CLS token
(no released model uses them), ``init_layer_scale`` (None in every released model).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.selective_scan import selective_scan
from ..layout import check_image_size

CLS_POSITIONS = ("middle", "first", "last", None)


class RMSNorm(nn.Module):
    """mamba-ssm's RMSNorm: ``x / sqrt(mean(x²) + eps) · weight``, computed in float32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(acc)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(acc)
        return y.to(x.dtype)


class PatchEmbed(nn.Module):
    """Image to patch tokens: ``proj`` (Conv2d, kernel ``patch_size``, ``stride``), flattened row-major.

    Attributes: ``img_size``, ``patch_size`` (pairs), ``grid_size`` (rows, columns of patches), ``num_patches``.
    """

    def __init__(self, img_size=224, patch_size=16, stride=16, in_chans=3, embed_dim=192):
        super().__init__()
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        self.patch_size = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
        self.stride = stride
        self.grid_size = tuple((size - patch) // stride + 1 for size, patch in zip(self.img_size, self.patch_size))
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=stride)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, M, D)."""
        check_image_size(pixel_values, self.img_size, "resize it, e.g. with preprocess(image, img_size=model.img_size)")
        return self.proj(pixel_values).flatten(2).transpose(1, 2)


class VimMixer(nn.Module):
    """The bimamba v2 token mixer of Vim (official names: ``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``,
    ``D`` and the backward direction's ``conv1d_b``, ``x_proj_b``, ``dt_proj_b``, ``A_b_log``, ``D_b``; ``out_proj``).

    Args as mamba-ssm's ``Mamba``: ``d_model``, ``d_state`` (16), ``d_conv`` (4), ``expand`` (2), ``dt_rank``
    ("auto": ceil(d_model / 16)), ``conv_bias`` (True), ``bias`` (False, the projections), ``if_divide_out`` (True:
    the two directions are averaged, not summed).
    """

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2, dt_rank="auto",
                 conv_bias: bool = True, bias: bool = False, if_divide_out: bool = True, dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4):
        super().__init__()
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.bimamba_type = "v2"
        self.if_divide_out = if_divide_out
        self.activation = "silu"
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias)
        for suffix in ("", "_b"):
            setattr(self, "conv1d" + suffix, nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner,
                                                      padding=d_conv - 1, bias=conv_bias))
            setattr(self, "x_proj" + suffix, nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False))
            dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
            self._init_dt(dt_proj, dt_min, dt_max, dt_init_floor)
            setattr(self, "dt_proj" + suffix, dt_proj)
        # S4D-real initialisation, as mamba-ssm: A = -(1..N) per channel
        a_log = torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(a_log.clone())
        self.A_b_log = nn.Parameter(a_log.clone())
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.D_b = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias)

    def _init_dt(self, dt_proj, dt_min, dt_max, floor):
        """mamba-ssm's initialisation: softplus(bias) log-uniform in [dt_min, dt_max]."""
        std = self.dt_rank ** -0.5
        nn.init.uniform_(dt_proj.weight, -std, std)
        dt = torch.exp(torch.rand(self.d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=floor)
        with torch.no_grad():
            dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _direction(self, x, z, suffix: str) -> torch.Tensor:
        """One scan direction: (B, D_in, L) conv input and gate -> (S6(u) + D·u) · silu(z), (B, D_in, L)."""
        conv1d, x_proj, dt_proj = (getattr(self, name + suffix) for name in ("conv1d", "x_proj", "dt_proj"))
        A_log, D = (self.A_log, self.D) if suffix == "" else (self.A_b_log, self.D_b)
        length = x.shape[-1]
        u = F.silu(conv1d(x)[..., :length])
        dt, B, C = torch.split(x_proj(u.transpose(1, 2)), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = (dt @ dt_proj.weight.t()).transpose(1, 2)  # the bias is added inside the scan
        keep = torch.float64 if A_log.dtype == torch.float64 else torch.float32  # A, D, Δ bias in float32 (as mamba-ssm)
        A = -torch.exp(A_log.to(keep))
        y = selective_scan(u, delta, A, B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous(),
                           D=D.to(keep), z=z, delta_bias=dt_proj.bias.to(keep), delta_softplus=True)
        return y.to(x.dtype)  # as mamba-ssm: the scan's output in its input's dtype (the float32 D promotes it)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, L, D_model) -> (B, L, D_model)."""
        x, z = self.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)  # (B, D_in, L) each
        forward = self._direction(x, z, "")
        backward = self._direction(x.flip(-1), z.flip(-1), "_b").flip(-1)
        y = forward + backward
        if self.if_divide_out:
            y = y / 2
        return self.out_proj(y.transpose(1, 2))


class Block(nn.Module):
    """``r + mixer(norm(r))`` on the residual stream r (official names ``mixer``, ``norm``)."""

    def __init__(self, dim: int, mixer: VimMixer, eps: float = 1e-5, residual_in_fp32: bool = True):
        super().__init__()
        self.mixer = mixer
        self.norm = RMSNorm(dim, eps)
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        hidden = self.mixer(self.norm(residual.to(self.norm.weight.dtype)))
        return residual + hidden.to(residual.dtype)


class VisionMamba(nn.Module):
    """Vim: patch tokens (+ a CLS token), bidirectional Mamba blocks, RMSNorm, a linear head.

    Args (the official constructor's names where they exist):
        img_size, patch_size, stride, channels: the image and its patches (grid ``(img - patch) // stride + 1``).
        depth, embed_dim, d_state, d_conv, expand, dt_rank: the blocks.
        num_classes: the head's classes (0: no head, the features are returned).
        cls_position: where the CLS token sits: ``"middle"`` (the released models: index ``M // 2``),
            ``"first"``, ``"last"``, or None (no CLS token; the head reads the mean over tokens).
        norm_epsilon, residual_in_fp32, if_divide_out: as the official model.

    ``forward(pixel_values)`` -> logits (B, num_classes). :meth:`token_layout` says where the tokens are.

    Attributes: ``img_size`` (height, width), the input size; ``crop_pct``, the share of the resized image the
    evaluation transform keeps (0.875, the official models'; 1 for a model trained on whole images);
    ``preprocess(path, model=model)`` uses both. ``class_names``: the classes' names in class order, or None.
    ``load_vim`` reads ``crop_pct`` and ``class_names`` from the training.json beside a checkpoint.
    """

    class_names = None  # set per model (load_vim, from training.json beside the checkpoint)
    crop_pct = 0.875  # the official evaluation transform's; load_vim takes training.json's

    def __init__(self, img_size=224, patch_size=16, stride=16, depth=24, embed_dim=192, d_state=16, d_conv=4,
                 expand=2, dt_rank="auto", channels=3, num_classes=1000, cls_position="middle",
                 norm_epsilon=1e-5, residual_in_fp32=True, if_divide_out=True):
        super().__init__()
        if cls_position not in CLS_POSITIONS:
            raise ValueError(f"mamba_captum: cls_position={cls_position!r}; choose one of {CLS_POSITIONS}.")
        self.num_classes = num_classes
        self.d_model = self.num_features = self.embed_dim = embed_dim
        self.cls_position = cls_position
        self.if_cls_token = cls_position is not None
        self.use_middle_cls_token = cls_position == "middle"
        self.final_pool_type = "mean"
        self.patch_embed = PatchEmbed(img_size, patch_size, stride, channels, embed_dim)
        tokens = self.patch_embed.num_patches + (1 if self.if_cls_token else 0)
        if self.if_cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, embed_dim))
        self.layers = nn.ModuleList([
            Block(embed_dim, VimMixer(embed_dim, d_state, d_conv, expand, dt_rank, if_divide_out=if_divide_out),
                  norm_epsilon, residual_in_fp32) for _ in range(depth)])
        self.norm_f = RMSNorm(embed_dim, norm_epsilon)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights(depth)

    def _init_weights(self, depth: int):
        """The official initialisation (truncated normal embeddings, zero linear biases, rescaled out_proj)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.if_cls_token:
            nn.init.trunc_normal_(self.cls_token, std=0.02)
        if isinstance(self.head, nn.Linear):
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
        fan_in = self.patch_embed.proj.in_channels * math.prod(self.patch_embed.patch_size)
        nn.init.trunc_normal_(self.patch_embed.proj.weight, std=math.sqrt(1.0 / fan_in))  # lecun normal
        nn.init.zeros_(self.patch_embed.proj.bias)
        for block in self.layers:
            mixer = block.mixer
            for linear in (mixer.in_proj, mixer.out_proj):
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
            nn.init.kaiming_uniform_(mixer.out_proj.weight, a=math.sqrt(5))
            with torch.no_grad():
                mixer.out_proj.weight /= math.sqrt(depth)

    @property
    def img_size(self) -> tuple[int, int]:
        """The input image size (height, width): what :func:`mamba_captum.vision.preprocess` takes as ``img_size``."""
        return self.patch_embed.img_size

    # -- where the tokens are -----------------------------------------------------------------------------------
    def cls_index(self) -> int | None:
        """The CLS token's position in the sequence (None without one)."""
        patches = self.patch_embed.num_patches
        return {"middle": patches // 2, "first": 0, "last": patches, None: None}[self.cls_position]

    def token_layout(self):
        """The :class:`mamba_captum.vision.TokenLayout`: sequence length, patch grid, CLS position, pooling."""
        from ..layout import TokenLayout

        embed = self.patch_embed
        return TokenLayout(grid=embed.grid_size, cls_index=self.cls_index(), img_size=embed.img_size,
                           patch_size=embed.patch_size, stride=embed.stride)

    # -- forward --------------------------------------------------------------------------------------------------
    def tokens(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The block input: patch embeddings with the CLS token inserted, plus the position embeddings (B, L, D)."""
        x = self.patch_embed(pixel_values)
        index = self.cls_index()
        if index is not None:
            cls = self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype)
            x = torch.cat([x[:, :index], cls, x[:, index:]], dim=1)
        return x + self.pos_embed.to(x.dtype)

    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> the pooled features (B, D): the CLS row of the final norm, or the mean over tokens."""
        residual = self.tokens(pixel_values)
        if self.layers and self.layers[0].residual_in_fp32 and residual.dtype != torch.float64:
            residual = residual.float()
        for block in self.layers:
            residual = block(residual)
        hidden = self.norm_f(residual.to(self.norm_f.weight.dtype))
        index = self.cls_index()
        return hidden[:, index] if index is not None else hidden.mean(dim=1)

    def forward(self, pixel_values: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, num_classes) (the pooled features with ``return_features=True``)."""
        features = self.forward_features(pixel_values)
        return features if return_features else self.head(features)
