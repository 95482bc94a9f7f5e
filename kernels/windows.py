"""Non-overlapping square windows of an image grid whose tokens are numbered row-major (token ``r · cols + c``): the
windows in row-major order of windows, each window's tokens row-major within it (Swin's and MambaVision's
``window_partition``). The model cuts its grid this way and the adapters scatter each window's operator back into
the grid's token order with the same order, so the two cannot disagree."""
from __future__ import annotations

import torch


def check_whole_windows(rows: int, cols: int, window: int) -> None:
    """Raise ValueError unless a (rows × cols) grid is a whole number of ``window × window`` windows."""
    if rows % window or cols % window:
        raise ValueError(f"mamba_captum: a {rows}×{cols} grid is not a whole number of {window}×{window} windows.")


def window_order(rows: int, cols: int, window: int, device=None) -> torch.Tensor:
    """(L,) long, L = rows · cols: ``order[p]`` is the grid token (row-major) at position p of the windows laid one
    after another (window ``w`` holds positions ``w · window² … (w + 1) · window² − 1``). The inverse permutation
    ``argsort(order)`` gives each grid token's window position."""
    check_whole_windows(rows, cols, window)
    grid = torch.arange(rows * cols, device=device).reshape(rows // window, window, cols // window, window)
    return grid.transpose(1, 2).reshape(-1)


def grid_to_windows(grid: torch.Tensor, window: int) -> torch.Tensor:
    """(B, H, W, C) channel-last grid -> (B · nW, window², C): the windows in row-major order of windows, each
    window's tokens row-major within it (:func:`window_order`). H and W must be multiples of ``window``."""
    batch, height, width, channels = grid.shape
    check_whole_windows(height, width, window)
    rows, cols = height // window, width // window
    tiles = grid.reshape(batch, rows, window, cols, window, channels).transpose(2, 3)  # (B, rows, cols, wh, ww, C)
    return tiles.reshape(batch * rows * cols, window * window, channels)


def windows_to_grid(windows: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """The inverse of :func:`grid_to_windows`: (B · nW, window², C) -> (B, H, W, C)."""
    rows, cols, channels = height // window, width // window, windows.shape[-1]
    batch = windows.shape[0] // (rows * cols)
    tiles = windows.reshape(batch, rows, cols, window, window, channels).transpose(2, 3)  # (B, rows, wh, cols, ww, C)
    return tiles.reshape(batch, height, width, channels)
