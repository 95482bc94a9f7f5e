"""MambaOut's gated CNN block: ``GatedConvBlock`` (timm's ``timm.models.mambaout`` and
:class:`mamba_captum.vision.MambaOut`, found by class name; only timm's attribute names are read: ``norm``, ``fc1``,
``act``, ``split_indices``, ``conv``, ``fc2``, ``ls``, ``drop_path``).

Forward on channel-last tokens x (B, H, W, C), token ``r·W + s`` of the grid, with its own residual::

    u = fc1(norm(x));  g, i, c = split(u, (n, n − k, k))
    out = x + ls(fc2(act(g) ⊙ cat(i, conv(c) + b)))

``conv`` is a depthwise K × K conv with 'same' zero padding (b its bias). Over the n channels of v = cat(i, c) the
token operator is, per channel d, an L × L matrix M_d: the identity for the n − k channels of i, and for the k
channels of c the conv's 2-D band::

    M_d[t, t'] = w_d[a, b]   where token t' is token t moved by (a − K//2, b − K//2) on the grid, else 0

(:meth:`mamba_captum.layout.PackedPatches.neighbours` of one H × W frame; the identity is the band whose only tap is
the centre one).

- hidden: ``M_d`` over v (the band alone; the gate and the bias act after it, in the readout).
- unified: ``H_d = diag(act(g_d)) · M_d`` over v, the gate fixed at its real value. Components: "gate" (off: no row
  weight), "conv" (off: the identity on every channel).

The conv bias comes from no token: the readout adds it. The readout is ``x + ls(fc2(·))`` of the mixed channels, so
that it gives the block's real output (the shortcut, the block's input, is a constant of the readout).
"""
from __future__ import annotations

import torch
from torch import nn

from ..layout import PackedPatches
from ..operators import HeadOperator, sparse_conv
from .common import linear_readout, run, same_conv_kernel

MIXER_CLASSES = ("GatedConvBlock",)
# why MambaLRP has no rules for this family (mamba_captum.families.lrp_plan.lrp_plan names it)
LRP_UNSUPPORTED = ("MambaLRP explains token models; MambaOut's gated conv blocks (an image model without an SSM) are "
                   "not covered")
NONCAUSAL = True  # the 2-D conv reads both sides of each token on the grid


def _check_deterministic(block) -> None:
    drop = getattr(block, "drop_path", None)
    rate = getattr(drop, "drop_prob", 0.0) or 0.0
    if block.training and rate > 0:
        raise ValueError(f"mamba_captum: GatedConvBlock drops its branch at random in train() mode (drop_path "
                         f"{rate}): the output cannot be rebuilt. Explain the model in eval() mode.")


def _float64(module: nn.Module):
    """``module`` as a float64 function: LayerScale (a ``gamma``) and the identity exactly; anything else through its
    own forward in its own dtype."""
    if isinstance(module, nn.Identity) or module is None:
        return lambda y: y
    gamma = getattr(module, "gamma", None)
    if isinstance(gamma, torch.Tensor) and not list(module.children()):
        scale = gamma.detach().to(torch.float64)
        return lambda y: y * scale
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return lambda y: run(module, y.to(dtype)).to(torch.float64)


_ATTRIBUTES = ("norm", "fc1", "act", "split_indices", "conv", "fc2", "ls", "drop_path")


def _check_block(block) -> None:
    """timm's GatedConvBlock: the attributes the rebuild reads, and a conv of the split's width.

    Raises:
        TypeError: naming what is missing (another library's class of the same name)."""
    missing = [name for name in _ATTRIBUTES if not hasattr(block, name)]
    if missing or not isinstance(block.conv, nn.Conv2d) or len(block.split_indices) != 3 \
            or block.conv.in_channels != block.split_indices[2]:
        raise TypeError(f"mamba_captum: this GatedConvBlock ({type(block).__module__}) is not timm's MambaOut block "
                        f"(missing {missing or 'nothing'}; conv {type(getattr(block, 'conv', None)).__name__}); only "
                        "timm's GatedConvBlock and mamba_captum.vision's are supported.")


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the block's operator from its recorded input.

    ``call.hidden_states``: the block's input x (B, H, W, C), channel-last as timm runs it.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` (n one-channel heads, no core, a 2-D band over the
        L = H·W tokens) and the block's output recomputed, (B, H, W, C) like the block's.
    """
    block = call.located.module
    hidden = call.hidden_states
    if hidden.dim() != 4:
        raise TypeError(f"mamba_captum: GatedConvBlock takes channel-last tokens (B, H, W, C); it received shape "
                        f"{tuple(hidden.shape)}.")
    _check_block(block)
    _check_deterministic(block)
    kernel, _ = same_conv_kernel(block.conv, "GatedConvBlock's conv", square=True)
    batch, rows, cols, _ = hidden.shape
    length = rows * cols
    _, plain, conv_channels = (int(n) for n in block.split_indices)
    width = plain + conv_channels  # n: the channels of cat(i, c)
    neighbours = PackedPatches.from_grid([[1, rows, cols]], 1).neighbours(kernel, hidden.device)  # (K², L)
    centre = (kernel // 2) * kernel + kernel // 2  # the tap that reads the token itself
    taps = torch.zeros(width, kernel * kernel, dtype=work_dtype, device=hidden.device)
    taps[:plain, centre] = 1  # the identity channels: the centre tap alone
    taps[plain:] = block.conv.weight[:, 0].reshape(conv_channels, -1).to(work_dtype)  # (k, K²) in the taps' order
    bias = torch.zeros(width, dtype=work_dtype, device=hidden.device)
    if block.conv.bias is not None:
        bias[plain:] = block.conv.bias.to(work_dtype)

    mixed_in = run(block.fc1, run(block.norm, hidden))  # (B, H, W, 2n) as the block computes it
    gate, values = mixed_in.split((int(block.split_indices[0]), width), dim=-1)
    gate = run(block.act, gate).to(work_dtype).reshape(batch, length, width)
    values = values.to(work_dtype).reshape(batch, length, width)  # v = cat(i, c)
    banded = sparse_conv(values, taps, neighbours)  # M v: the identity on i, the conv without its bias on c
    output = gate * banded  # unified: H v
    branch = run(block.fc2, (output + gate * bias).reshape(batch, rows, cols, width).to(hidden.dtype))
    rebuilt = hidden + run(block.drop_path, run(block.ls, branch))

    fc2, scale = linear_readout(block.fc2), _float64(block.ls)
    shortcut, gate64, bias64 = hidden.detach().double(), gate.double(), bias.double()
    shape = (batch, rows, cols, width)

    per_channel = lambda t: None if t is None else t[..., None]  # noqa: E731  (B, L, n, 1): n one-channel heads
    if formulation == "hidden":  # the band alone over v; the gate and the bias act after it
        row, conv, result = None, taps[:, None, :], banded

        def readout(out):
            return shortcut + scale(fc2((gate64 * (out.reshape(batch, length, width) + bias64)).reshape(shape)))
    else:
        row = gate if "gate" in components else None
        conv = taps[:, None, :] if "conv" in components else None  # None: the identity on every channel
        result = output

        def readout(out):
            return shortcut + scale(fc2((out.reshape(batch, length, width) + gate64 * bias64).reshape(shape)))
    operator = HeadOperator(None, mask=None, heads=width, head_dim=1, row_weight=per_channel(row),
                            conv_weight=conv, neighbours=neighbours, values=per_channel(values),
                            output=per_channel(result), readout=readout)
    return operator, rebuilt
