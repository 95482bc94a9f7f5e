"""RWKV-4: RwkvSelfAttention (the time-mixing block).

Forward (transformers 5.23, ``RwkvSelfAttention.forward``): token shift ``s_t = h_{t−1}`` (0 at t = 0); ``k = key(h·μ_k
+ s·(1−μ_k))``, likewise v and r; ``r = σ(r)``; ``wkv = WKV(w = exp(time_decay), u = time_first, k, v)``;
``out = output(r · wkv)``. Only the mixer input is taken from hooks; k, v, r and the WKV weights are recomputed.

hidden:  α_c[t, j] = exp(k_j − (t−1−j) w) / Z_t (j < t),  exp(u + k_t) / Z_t (j = t); rows sum to 1.   over v.
unified: H_c = diag(σ(r_c)) · α_c (Zimerman et al., Eq. 21)                                        over v.

Z_t is formed in log space (a log-cumulative-sum-exp, float64), so keys of any magnitude are safe. The token shift
is not folded into the operator: v_t mixes h_t and h_{t−1} with per-input-channel weights μ_v before the dense
``value`` projection, so v_c is not a per-channel filter of any single per-token input (docs/families/rwkv.md).

HF ignores ``attention_mask`` for RWKV: left padding changes what the real tokens see, so it is refused
(``IGNORES_ATTENTION_MASK``); with right padding the real tokens are exact and pad rows and columns are zeroed.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..kernels.wkv_scan import wkv_scan_chunked
from ..operators import DecayOperator
from ..rules import sigmoid_gate
from .common import linear_readout, run

MIXER_CLASSES = ("RwkvSelfAttention",)
IGNORES_ATTENTION_MASK = True


def log_normaliser(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log Z_t = log(Σ_{j<t} exp(k_j − (t−1−j) w) + exp(u + k_t)), float64, by a log-cumulative-sum-exp.

    Args:
        k: (B, L, C) keys.  w: (C,) decay rates exp(time_decay).  u: (C,) time_first.
    Returns:
        (B, L, C) float64.
    """
    k, w, u = k.double(), w.double(), u.double()
    steps = torch.arange(k.shape[1], dtype=torch.float64, device=k.device)[None, :, None]
    through = torch.logcumsumexp(k + (steps + 1) * w, dim=1)  # log Σ_{j≤t} exp(k_j + (j+1) w)
    earlier = torch.cat([torch.full_like(through[:, :1], float("-inf")), through[:, :-1]], dim=1) - steps * w
    return torch.logaddexp(earlier, u + k)


def token_shifted(mixer, hidden):
    """k, v (model dtype) and r = σ(receptance) as RwkvSelfAttention.extract_key_value computes them, no state."""
    shifted = F.pad(hidden, (0, 0, 1, -1))  # = mixer.time_shift(hidden): h_{t−1}, zero at t = 0
    mix = lambda mu: hidden * mu + shifted * (1 - mu)  # noqa: E731
    key = run(mixer.key, mix(mixer.time_mix_key))
    value = run(mixer.value, mix(mixer.time_mix_value))
    receptance = torch.sigmoid(run(mixer.receptance, mix(mixer.time_mix_receptance)))
    return key, value, receptance


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`DecayOperator` and the mixer output recomputed from it, (B, L, D_model).
    """
    mixer = call.located.module
    hidden = call.hidden_states
    key, value, receptance = token_shifted(mixer, hidden)
    w = lambda t: t.to(work_dtype)  # noqa: E731
    k, v, r = w(key), w(value), w(receptance)
    decay = torch.exp(w(mixer.time_decay))  # (C,)
    first = w(mixer.time_first)
    log_z = log_normaliser(k, decay, first)
    log_decay = decay.expand_as(k)
    log_q, log_k, log_diag = -log_z, k + decay, first + k - log_z
    wkv = wkv_scan_chunked(w(mixer.time_decay).double(), first.double(), k.double(), v.double())[0]
    rebuilt = run(mixer.output, (r * wkv).to(hidden.dtype))

    mask = None if call.attention_mask is None else w(call.attention_mask)
    output = linear_readout(mixer.output)
    common = dict(log_decay=log_decay, log_q=log_q, log_k=log_k, log_diag=log_diag, segments=None, mask=mask,
                  values=v, s6="s6" in components, decay_source="time_decay (the decay rate is exp(time_decay))")
    if formulation == "hidden":  # the operator's output is the WKV; the receptance gate comes after it
        r64 = r.double()
        return DecayOperator(**common, output=wkv, readout=lambda y: output(r64 * y)), rebuilt
    row = r if "gate" in components else None
    operator = DecayOperator(**common, row_weight=row, output=r * wkv,
                             readout=output)
    return operator, rebuilt


@contextlib.contextmanager
def preserved_rescaling(model):
    """Leave RWKV's weights as they were, whatever forward passes run inside.

    ``RwkvModel.forward`` divides ``attention.output`` and ``feed_forward.value`` weights of block i in place by
    2^(i // rescale_every) on the first eval forward (and multiplies them back on a train forward) and flips
    ``layers_are_rescaled``. Inside this context the real forward still runs as HF runs it (the explained output is
    the one the user gets); on exit the weights a flip changed are copied back from a snapshot taken before (an
    inverse scaling would not be exact where the division rounded into float16 subnormals), so the user's next
    forward rescales once, as it would have without the library.
    """
    models = [m for m in model.modules() if hasattr(m, "layers_are_rescaled") and hasattr(m, "blocks")]
    for module in models:
        _refuse_offloaded_rescaling(module)
    before = [m.layers_are_rescaled for m in models]
    # HF flips when training == layers_are_rescaled: snapshot the weights it will scale (factor > 1 only)
    snapshots = [_snapshot(m) if m.training == m.layers_are_rescaled else None for m in models]
    try:
        yield
    finally:
        for module, was_rescaled, snapshot in zip(models, before, snapshots):
            if module.layers_are_rescaled != was_rescaled:
                _restore(module, was_rescaled, snapshot)


def _refuse_offloaded_rescaling(module):
    """An offloaded RWKV (accelerate ``device_map`` with CPU / disk offload) in eval mode computes something else
    than the model: its forward halves the residual stream every ``rescale_every`` blocks, assuming the in-place
    division of the weights, which offloaded weights (reloaded unscaled from the offload at every forward) never
    keep. Its outputs differ from the undispatched model's; explaining them would explain that error."""
    if module.training or not any(linear.weight.device.type == "meta" for linear in _rescaled_linears(module)):
        return
    raise ValueError(
        "mamba_captum: this RWKV model has offloaded weights (accelerate device_map with 'cpu' / 'disk' offload) "
        f"and rescale_every={module.config.rescale_every}: transformers' RWKV rescales its weights in place on "
        "the first eval forward, which offloaded weights do not keep, so this model's outputs are not the "
        "checkpoint's. Load it with rescale_every=0 (from_pretrained(..., rescale_every=0): the same function "
        "without the float16 overflow guard, up to LayerNorm's eps), or without offloading.")


def _rescaled_linears(module):
    every = module.config.rescale_every
    if every <= 0:
        return []
    return [linear for index, block in enumerate(module.blocks) if index // every > 0
            for linear in (block.attention.output, block.feed_forward.value)]


def _snapshot(module) -> list | None:
    """Copies of the weights a rescaling changes; None for quantized weights (which cannot be copied back)."""
    linears = _rescaled_linears(module)
    if any(hasattr(linear.weight, "SCB") or hasattr(linear.weight, "quant_state") for linear in linears):
        return None
    return [(linear.weight, linear.weight.detach().clone()) for linear in linears]


def _restore(module, was_rescaled: bool, snapshot):
    if snapshot is None and _rescaled_linears(module):
        raise NotImplementedError(
            "mamba_captum: this RWKV model is quantized and was rescaled by its own forward; the library cannot undo "
            "that exactly. Run one forward pass in eval mode before explaining.")
    with torch.no_grad():
        for weight, saved in snapshot or ():
            weight.copy_(saved)
    module.layers_are_rescaled = was_rescaled


def lrp(call, work_dtype: torch.dtype) -> torch.Tensor:
    """The time-mixing block's output under MambaLRP-style rules, a differentiable function of
    ``call.hidden_states``: the token shift and the projections (linear); the WKV weights ``exp(k_j − (t−1−j) w) /
    Z_t`` detached (keys, decays and the normaliser are the selection of this layer, like Mamba's Δ, B, C), so the
    WKV is linear in the values; the receptance gate ``σ(r) ⊙ wkv`` by :func:`mamba_captum.rules.sigmoid_gate`.
    Linear in the block input; the projections' biases (if any) are its constant terms. (B, L, D_model), float64."""
    mixer = call.located.module
    hidden = call.hidden_states
    shifted = F.pad(hidden, (0, 0, 1, -1))  # h_{t−1}, zero at t = 0
    mix = lambda mu: hidden * mu + shifted * (1 - mu)  # noqa: E731
    value = run(mixer.value, mix(mixer.time_mix_value)).double()
    receptance = run(mixer.receptance, mix(mixer.time_mix_receptance)).double()
    with torch.no_grad():
        k = run(mixer.key, mix(mixer.time_mix_key)).double()
    # decay and bonus detached like the keys: the WKV weights are this layer's selection, the WKV linear in value
    wkv = wkv_scan_chunked(mixer.time_decay.detach().double(), mixer.time_first.detach().double(), k, value)[0]
    return linear_readout(mixer.output)(sigmoid_gate(receptance, wkv))


preserved_state = preserved_rescaling  # the adapter contract's name (mamba_captum.families.registry.Adapter)
