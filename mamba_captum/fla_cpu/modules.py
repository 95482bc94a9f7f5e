"""Plain-torch versions of flash-linear-attention's fused modules (``fla.modules``): norms (with a residual and the
pre-norm output), gated norms, L2 norm, token shift, the short causal convolution, rotary embeddings, fused
activations and the fused cross-entropy.

Each function has the signature of the fla function it stands for (same names, same defaults; what it cannot do it
refuses, see :mod:`.swaps`) and computes what fla's Triton kernel computes, in float32 for half-precision inputs (as
the kernels accumulate) and in float64 for float64 inputs, differentiable through autograd. fla 0.6.0's sources are
the specification; each docstring says what was followed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _work(x: torch.Tensor) -> torch.dtype:
    """The dtype fla's kernels compute in: float32, or float64 for float64 inputs (exact references)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _with_residual(x, residual, residual_in_fp32):
    """(x + residual, the pre-norm output in its dtype): fla adds the residual before normalising and returns the sum
    in the residual's dtype (float32 with ``residual_in_fp32``), else in x's."""
    summed = x.to(_work(x)) if residual is None else x.to(_work(x)) + residual.to(_work(x))
    out_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    if x.dtype == torch.float64:
        out_dtype = torch.float64
    return summed, summed.to(out_dtype)


def _normalise(x, weight, bias, eps, is_rms_norm, num_groups=1):
    """(LayerNorm or RMSNorm of the last dim in ``num_groups`` groups) · weight + bias, in x's dtype (already the work
    dtype)."""
    shape = x.shape
    grouped = x.reshape(*shape[:-1], num_groups, shape[-1] // num_groups)
    if not is_rms_norm:
        grouped = grouped - grouped.mean(-1, keepdim=True)
    grouped = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    y = grouped.reshape(shape)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def layer_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    """fla.modules.norm.layernorm.layer_norm: LayerNorm (or RMSNorm) of ``x + residual`` over the last dim, output in
    x's dtype; with ``prenorm`` also the sum (the next block's residual). x: (..., D)."""
    return group_norm(x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm, 1)


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    """fla.modules.norm.layernorm.rms_norm: :func:`layer_norm` with ``is_rms_norm``."""
    return group_norm(x, weight, bias, residual, eps, prenorm, residual_in_fp32, True, 1)


def group_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, is_rms_norm=False,
               num_groups=1):
    """fla.modules.norm.layernorm.group_norm: the norm taken over each of ``num_groups`` equal slices of the last dim
    (the weight spans the whole dim)."""
    if x.shape[-1] % num_groups:
        raise ValueError("num_channels must be divisible by num_groups")
    summed, res_out = _with_residual(x, residual, residual_in_fp32)
    y = _normalise(summed, weight, bias, eps, is_rms_norm, num_groups).to(x.dtype)
    return (y, res_out) if prenorm else y


def _then_linear(normed, prenorm, weight, bias):
    """A fused norm's output (and with ``prenorm`` its residual sum) -> ``F.linear`` of it in the weight's dtype."""
    y, res_out = normed if prenorm else (normed, None)
    out = F.linear(y.to(weight.dtype), weight, bias)
    return (out, res_out) if prenorm else out


def layer_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5, prenorm=False,
                      residual_in_fp32=False, is_rms_norm=False, num_groups=1):
    """fla.modules.norm.layernorm.layer_norm_linear: the norm, then ``F.linear`` in the norm's output dtype."""
    normed = group_norm(x, norm_weight, norm_bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm, num_groups)
    return _then_linear(normed, prenorm, linear_weight, linear_bias)


def rms_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5, prenorm=False,
                    residual_in_fp32=False):
    """fla.modules.norm.layernorm.rms_norm_linear."""
    return layer_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm,
                             residual_in_fp32, True, 1)


def group_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5, prenorm=False,
                      residual_in_fp32=False, is_rms_norm=False, num_groups=1):
    """fla.modules.norm.layernorm.group_norm_linear."""
    return layer_norm_linear(x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm,
                             residual_in_fp32, is_rms_norm, num_groups)


def _gate(g, activation):
    if activation in ("swish", "silu"):
        return F.silu(g)
    if activation == "sigmoid":
        return torch.sigmoid(g)
    raise NotImplementedError(f"mamba_captum: the fla gated norm's activation {activation!r} has no torch version.")


def _norm_gated(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps, is_rms_norm):
    """fla.modules.norm.fused_norm_gate: ``norm(x + residual) · act(g)`` (norm first, then the gate), x's dtype."""
    summed, res_out = _with_residual(x, residual, residual_in_fp32)
    y = _normalise(summed, weight, bias, eps, is_rms_norm) * _gate(g.to(summed.dtype), activation)
    y = y.to(x.dtype)
    return (y, res_out) if prenorm else y


def layer_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                     eps=1e-6):
    """fla.modules.norm.fused_norm_gate.layer_norm_gated. x, g: (..., D)."""
    return _norm_gated(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps, False)


def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):
    """fla.modules.norm.fused_norm_gate.rms_norm_gated."""
    return _norm_gated(x, g, weight, bias, activation, residual, prenorm, residual_in_fp32, eps, True)


def layer_norm_swish_gate_linear(x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None,
                                 prenorm=False, residual_in_fp32=False, eps=1e-6):
    """fla.modules.norm.fused_norm_gate.layer_norm_swish_gate_linear: the swish-gated LayerNorm, then the linear."""
    normed = layer_norm_gated(x, g, norm_weight, norm_bias, "swish", residual, prenorm, residual_in_fp32, eps)
    return _then_linear(normed, prenorm, linear_weight, linear_bias)


def rms_norm_swish_gate_linear(x, g, norm_weight, norm_bias, linear_weight, linear_bias, residual=None,
                               prenorm=False, residual_in_fp32=False, eps=1e-6):
    """fla.modules.norm.fused_norm_gate.rms_norm_swish_gate_linear."""
    normed = rms_norm_gated(x, g, norm_weight, norm_bias, "swish", residual, prenorm, residual_in_fp32, eps)
    return _then_linear(normed, prenorm, linear_weight, linear_bias)


def l2norm(x, eps=1e-6, output_dtype=None):
    """fla.modules.norm.l2norm.l2norm: ``x / sqrt(Σ x² + eps)`` over the last dim (eps inside the root, unlike
    ``F.normalize``), in ``output_dtype`` (default x's)."""
    work = x.to(_work(x))
    y = work * torch.rsqrt(work.square().sum(-1, keepdim=True) + eps)
    return y.to(x.dtype if output_dtype is None else output_dtype)


def token_shift(x, cu_seqlens=None, cache=None, output_cache=False, chunk_indices=None):
    """fla.modules.token_shift.token_shift: ``x_{t−1} − x_t`` per sequence (the previous token of the first one is
    the cache's, (N, D), or zero), and with ``output_cache`` the last token of each sequence (N, D).
    x: (B, T, D), or (1, T_total, D) with ``cu_seqlens`` (N + 1)."""
    if cu_seqlens is None:
        first = torch.zeros_like(x[:, :1]) if cache is None else cache.to(x.dtype).reshape(x.shape[0], 1, -1)
        previous = torch.cat([first, x[:, :-1]], dim=1)
        out = previous - x
        last = x[:, -1]
    else:
        bounds = cu_seqlens.tolist()
        pieces, lasts = [], []
        for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            seq = x[:, start:end]
            first = torch.zeros_like(x[:, :1]) if cache is None else cache[n:n + 1].to(x.dtype)[:, None]
            pieces.append(torch.cat([first, seq[:, :-1]], dim=1) - seq)
            lasts.append(seq[0, -1] if end > start else first[0, 0])
        out = torch.cat(pieces, dim=1)
        last = torch.stack(lasts)
    return (out, last) if output_cache else out


def _sequences(cu_seqlens, x):
    """[(start, end)] of each packed sequence of x (1, T, D), or None for a plain batch."""
    if cu_seqlens is None:
        return None
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _conv_one(x, weight, bias, state):
    """The causal depthwise conv of x (B, T, D) with taps weight (D, W), after ``state`` (B, D, W) (its last W − 1
    columns are the inputs before x, fla's cache layout [N, D, W]); returns (y before activation, new state)."""
    width = weight.shape[-1]
    history = x.transpose(1, 2)  # (B, D, T)
    if state is not None:
        history = torch.cat([state[..., 1:].to(history.dtype), history], dim=-1)
        pad = 0
    else:
        pad = width - 1
    y = F.conv1d(F.pad(history, (pad, 0)), weight.to(history.dtype)[:, None], None if bias is None else
                 bias.to(history.dtype), groups=weight.shape[0])
    full = F.pad(history, (max(0, width - history.shape[-1]), 0))
    return y.transpose(1, 2), full[..., -width:]


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                  cp_context=None, **kwargs):
    """fla.modules.causal_conv1d.causal_conv1d: the depthwise causal conv (taps weight (D, W)), its activation
    (silu or none), plus ``residual``; the cache (N, D, W) holds the last W inputs of each sequence.
    x: (B, T, D), or (1, T_total, D) with ``cu_seqlens``. Returns (y (B, T, D), final state or None)."""
    if weight is None:
        raise ValueError("mamba_captum: causal_conv1d without a weight has no torch version.")
    work = _work(x)
    pieces = _sequences(cu_seqlens, x)
    if pieces is None:
        y, state = _conv_one(x.to(work), weight, bias, initial_state)
    else:
        outs, states = [], []
        for n, (start, end) in enumerate(pieces):
            part, st = _conv_one(x[:, start:end].to(work), weight, bias,
                                 None if initial_state is None else initial_state[n:n + 1])
            outs.append(part)
            states.append(st)
        y, state = torch.cat(outs, dim=1), torch.cat(states)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise NotImplementedError(f"mamba_captum: causal_conv1d's activation {activation!r} has no torch version.")
    if residual is not None:
        y = y + residual.to(work)
    return y.to(x.dtype), (state.to(x.dtype) if output_final_state else None)


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """fla.modules.causal_conv1d.causal_conv1d_update: one decoding step; x (B, 1, D) (or (1, N, D) packed), cache
    (N, D, W) shifted by one and updated IN PLACE, as fla's kernel does. Returns (y, cache)."""
    tokens = x.reshape(-1, x.shape[-1])  # (N, D)
    cache.copy_(torch.cat([cache[..., 1:], tokens.to(cache.dtype)[..., None]], dim=-1))
    work = _work(x)
    y = (cache.to(work) * weight.to(work)).sum(-1)
    if bias is not None:
        y = y + bias.to(work)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise NotImplementedError(f"mamba_captum: causal_conv1d_update's activation {activation!r} has no torch "
                                  "version.")
    y = y.reshape(x.shape)
    if residual is not None:
        y = y + residual.to(work)
    return y.to(x.dtype), cache


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     chunk_indices=None):
    """fla.modules.rotary.rotary_embedding: rotate the first 2·R channels of each head of x (B, T, H, D) by the
    angles of cos, sin (T_max, R) from position ``seqlen_offsets`` (an int, or one per sequence (B,)); packed
    sequences (``cu_seqlens``) restart at their offsets. Not in place (autograd needs the input)."""
    rotary = cos.shape[-1] * 2
    work = _work(x)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        positions = torch.cat([torch.arange(e - s, device=x.device) for s, e in zip(bounds[:-1], bounds[1:])])
        offsets = seqlen_offsets if isinstance(seqlen_offsets, int) else None
        if offsets is None:
            offsets_per = torch.cat([torch.full((e - s,), int(o), device=x.device)
                                     for (s, e), o in zip(zip(bounds[:-1], bounds[1:]), seqlen_offsets.tolist())])
            positions = positions + offsets_per
        else:
            positions = positions + offsets
        positions = positions[None]  # (1, T)
    else:
        positions = torch.arange(x.shape[1], device=x.device)[None]
        positions = positions + (seqlen_offsets if isinstance(seqlen_offsets, int)
                                 else seqlen_offsets.to(x.device)[:, None])
    c = cos.to(work)[positions][:, :, None]  # (B or 1, T, 1, R)
    s = sin.to(work)[positions][:, :, None]
    head, rest = x[..., :rotary].to(work), x[..., rotary:]
    if interleaved:
        even, odd = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)
    else:
        first, second = head.chunk(2, dim=-1)
        rotated = torch.cat([first * c - second * s, first * s + second * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), rest], dim=-1)


def sigmoid(x):
    """fla.modules.activations.sigmoid."""
    return torch.sigmoid(x.to(_work(x))).to(x.dtype)


def logsigmoid(x, temperature=1.0):
    """fla.modules.activations.logsigmoid: ``logσ(x) / temperature``."""
    return (F.logsigmoid(x.to(_work(x))) / temperature).to(x.dtype)


def swish(x):
    """fla.modules.activations.swish (SiLU)."""
    return F.silu(x.to(_work(x))).to(x.dtype)


def elu_p1(x):
    """fla.modules.activations.elu_p1: ``elu(x) + 1``."""
    return (F.elu(x.to(_work(x))) + 1.0).to(x.dtype)


def swiglu(x, y):
    """fla.modules.activations.swiglu: ``silu(x) · y``."""
    return (F.silu(x.to(_work(x))) * y.to(_work(x))).to(x.dtype)


def swiglu_linear(x, y, weight, bias):
    """fla.modules.activations.swiglu_linear: ``linear(silu(x) · y)``."""
    return F.linear(swiglu(x, y).to(weight.dtype), weight, bias)


def sigmoidglu(x, y):
    """fla.modules.activations.sigmoidglu: ``σ(x) · y``."""
    return (torch.sigmoid(x.to(_work(x))) * y.to(_work(x))).to(x.dtype)


def cross_entropy_loss(logits, target, label_smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                       logit_softcapping=None, ignore_index=-100, inplace_backward=False, process_group=None):
    """fla.modules.fused_cross_entropy.cross_entropy_loss: per-row (loss, z_loss) of logits (N, C) scaled by
    ``logit_scale`` (then soft-capped), with label smoothing and the z-loss ``lse_square_scale · lse²`` added to the
    loss; 0 at ``ignore_index`` rows."""
    if process_group is not None:
        raise NotImplementedError("mamba_captum: the fused cross-entropy over a process group has no torch version.")
    z = logits.to(_work(logits)) * logit_scale
    if logit_softcapping is not None:
        z = logit_softcapping * torch.tanh(z / logit_softcapping)
    lse = torch.logsumexp(z, dim=-1)
    ignored = target == ignore_index
    safe = target.masked_fill(ignored, 0)
    picked = z.gather(-1, safe[:, None])[:, 0]
    if label_smoothing > 0:
        loss = lse - (1 - label_smoothing) * picked - label_smoothing * z.mean(-1)
    else:
        loss = lse - picked
    z_loss = lse_square_scale * lse.square()
    loss = (loss + z_loss).masked_fill(ignored, 0.0)
    return loss.to(torch.float32 if logits.dtype != torch.float64 else torch.float64), \
        z_loss.masked_fill(ignored, 0.0)


def layernorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """fla.modules.norm.layernorm_gated.layernorm_fn (Mamba-2's gated norm): the norm over groups of
    ``group_size`` channels (default all), times ``silu(z)`` after the norm (``norm_before_gate``) or on x before
    it. x, z: (..., D)."""
    work = _work(x)
    h = x.to(work)
    gate = None if z is None else F.silu(z.to(work))
    if gate is not None and not norm_before_gate:
        h = h * gate
    groups = 1 if group_size is None else h.shape[-1] // group_size
    y = _normalise(h, weight, bias, eps, is_rms_norm, groups)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """fla.modules.norm.layernorm_gated.rmsnorm_fn: :func:`layernorm_fn` with the RMS norm."""
    return layernorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate, True)
