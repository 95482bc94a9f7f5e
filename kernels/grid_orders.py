"""Token orders and neighbourhoods on an image grid whose tokens are numbered row-major (token ``r · cols + c``): the
four scan orders of 2-D selective scans (VMamba's SS2D) and the taps of a 'same' 2-D conv as token indices."""
from __future__ import annotations

import torch


def cross_scan_orders(rows: int, cols: int, device=None) -> torch.Tensor:
    """The four scan orders of a (rows × cols) grid whose tokens are numbered row-major (token ``r · cols + c``):
    row-major, column-major, row-major reversed, column-major reversed. (4, L) long; ``orders[k, t]`` is the token at
    position t of scan k."""
    tokens = torch.arange(rows * cols, device=device)
    row_major = tokens
    column_major = tokens.reshape(rows, cols).t().reshape(-1)
    return torch.stack([row_major, column_major, row_major.flip(0), column_major.flip(0)])


def grid_neighbours(rows: int, cols: int, kernel, device=None) -> torch.Tensor:
    """(kh·kw, L) long: for a 'same' zero-padded 2-D conv (padding k // 2, stride 1) over a (rows × cols) grid of
    row-major tokens, the token each tap (a, b) reads for each output token — ``(r + a − kh//2, c + b − kw//2)`` — in
    ``Conv2d.weight[c, 0]``'s row-major tap order, −1 outside the grid (the band that
    :class:`mamba_captum.operators.permuted.PermutedSumOperator` and :func:`mamba_captum.operators.banded_maps`
    take)."""
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else tuple(kernel)
    grid = torch.arange(rows * cols).reshape(rows, cols)
    padded = torch.nn.functional.pad(grid, (kw // 2, kw // 2, kh // 2, kh // 2), value=-1)
    taps = [padded[a:a + rows, b:b + cols].reshape(-1) for a in range(kh) for b in range(kw)]
    return torch.stack(taps).to(device)
