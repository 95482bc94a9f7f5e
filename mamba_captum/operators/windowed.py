"""An operator that acts within non-overlapping windows of a grid (:class:`WindowedOperator`): block-diagonal over
the windows, each block the window's own operator, scattered into the grid's row-major token order.

With ``order`` the window order of the grid's L tokens (``order[p]`` = the grid token at position p when the windows
are laid one after another, :func:`mamba_captum.kernels.windows.window_order`) and P its permutation matrix, the
operator is ``H_c = Pᵀ blockdiag(H_c^(1), …, H_c^(nW)) P``: ``H_c[order[w·T + s], order[w·T + s']] =
H_c^(w)[s, s']`` for tokens of the same window w (T = window²), zero across windows. The windows are the inner
operator's batch: its batch is B · nW, window w of image b at index ``b · nW + w`` (what ``grid_to_windows`` gives).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch


@dataclass
class WindowedOperator:
    """``H = Pᵀ blockdiag(H^(w)) P`` over the grid's L tokens (module docstring).

    ``inner``: an operator over (B · nW) windows of T tokens (``maps``, ``contributions``, ``channels``,
    ``value_channels``). ``order`` (L,) long: the window order. ``output``: H x in the grid's token order,
    (B, L, ...) shaped like the inner output with its windows put back; ``readout`` maps it (float64) to the mixer
    output. Maps and contributions of any reduction are block-diagonal: zero between tokens of different windows.
    """

    inner: object
    order: torch.Tensor  # (L,) long
    output: torch.Tensor | None = None  # (B, L, ...) grid order
    readout: Callable | None = field(default=None, repr=False)

    def to(self, dtype: torch.dtype):
        return replace(self, inner=self.inner.to(dtype),
                       output=None if self.output is None else self.output.detach().to(dtype))

    @property
    def mask(self):
        return None

    @property
    def channels(self) -> int:
        return self.inner.channels

    @property
    def value_channels(self) -> int:
        return self.inner.value_channels

    @property
    def length(self) -> int:
        return self.order.numel()

    @property
    def window_tokens(self) -> int:
        """T, the tokens of one window."""
        return self._window_shape()[1]

    def _window_shape(self):
        """(nW, T, B)."""
        inner_batch = self.inner.output.shape[0]
        tokens = self.inner.output.shape[1]
        windows = self.length // tokens
        return windows, tokens, inner_batch // windows

    def to_windows(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) in grid order -> (B · nW, T, ...) in window order (the inner operator's layout)."""
        windows, tokens, batch = self._window_shape()
        picked = tensor[:, self.order.to(tensor.device)]
        return picked.reshape(batch * windows, tokens, *tensor.shape[2:])

    def from_windows(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B · nW, T, ...) in window order -> (B, L, ...) in grid order."""
        windows, tokens, batch = self._window_shape()
        flat = tensor.reshape(batch, windows * tokens, *tensor.shape[2:])
        out = torch.empty_like(flat)
        out[:, self.order.to(tensor.device)] = flat
        return out

    # -- rows of the grid -> rows of the windows --------------------------------------------------------------------
    def _scatter(self, per_window: Callable, rows) -> torch.Tensor:
        """Grid rows ``rows`` (None: all L) of a block-diagonal result, from ``per_window(inner_rows)``
        (B · nW, [C,] R', T) for the window rows ``inner_rows`` (None: all T): (B, [C,] R, L), zero across windows."""
        windows, tokens, batch = self._window_shape()
        device = self.order.device
        order = self.order
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=device)
        grid_rows = torch.arange(order.numel(), device=device) if rows is None \
            else torch.as_tensor(rows, dtype=torch.long, device=device)
        window_of, inside = position[grid_rows] // tokens, position[grid_rows] % tokens
        needed, slot = torch.unique(inside, sorted=True, return_inverse=True)
        whole = needed.numel() == tokens
        result = per_window(None if whole else needed)  # (B · nW, *mid, R', T)
        mid = result.shape[1:-2]
        result = result.reshape(batch, windows, *mid, result.shape[-2], tokens).movedim(1, -3)  # (B, *mid, nW, R', T)
        picked = result[..., window_of.to(result.device), (inside if whole else slot).to(result.device), :]
        columns = order.view(windows, tokens)[window_of].to(result.device)  # (R, T): the grid token of each column
        out = picked.new_zeros(batch, *mid, grid_rows.numel(), order.numel())
        return out.scatter_(-1, columns.expand_as(picked), picked)

    def maps(self, reduce="mean", rows=None):
        """(B, [C,] R, L): the windows' maps in the grid's token order, zero across windows."""
        return self._scatter(lambda inner_rows: self.inner.maps(reduce, inner_rows), rows)

    def contributions(self, grad: torch.Tensor, rows=None) -> torch.Tensor:
        """Σ_c grad_c[i] · H_c[i, j] · x_c[j]: (B, L, L) or (B, R, L). ``grad``: shaped like :attr:`output`
        (grid order)."""
        window_grad = self.to_windows(grad)
        return self._scatter(lambda inner_rows: self.inner.contributions(window_grad, inner_rows), rows)
