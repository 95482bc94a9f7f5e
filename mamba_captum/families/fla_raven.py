"""flash-linear-attention's Raven: ``Raven`` (model type ``raven``), gated slot attention with routed slots.

Forward (fla 0.6.0, ``fla/layers/raven.py``; no short convs): q, k, v = the projections of h; a router
``r = r_proj h`` (one linear, or linear-GELU-linear with ``router_type='mlp'``), M = ``num_slots`` per key head; the
log decay f = −e^{A_log} · softplus(a_proj h + dt_bias) (``decay_type='Mamba2'``, float32, one per key head, every
slot) or logsigmoid(f_proj h) / ``gate_logit_normalizer`` (``'GLA'``, one per slot); q, k through the feature map
(swish, relu or t2r), then ``q_norm`` / ``k_norm`` (RMS norms per head) and, with ``use_rope``, rotary embeddings
(positions restarting at each sequence's first real token); v ← act(v) (``gate_fn``, the config's ``hidden_act``);
routing: scores σ(r) (``router_score='sigmoid'``, the top-k weights renormalised to sum 1) or softmax(r), the top-k
slots by the scores (plus ``r_bias`` with ``bias_rmm``), and their weights w (0 off the top k); f ← f · w, the slot
writes s = 1 − e^f (a slot off the top k neither decays nor is written); keys, values, f and s repeated for
``num_kv_heads``; then fla's gated slot attention (:mod:`mamba_captum.fla_cpu.ops_gsa`, as GSA):
o_t = Hv_tᵀ p_t with p_t = softmax(scale · Hk_tᵀ q_t). Then act(o), and either ``o_proj(rms_norm(act(o)))`` with one
RMS norm over the token's width (fused: fla's ``rms_norm_linear`` at ``g_norm.eps``; else ``nn.RMSNorm``), or with
``use_output_gate`` ``o_proj(rms_norm_head(act(o)) · act_g(o_gate_proj h))`` (per head; fused: fla's gated RMS norm
with its activation act_g, else act_g = act).

hidden:  α_h[t, s] = Σ_m p_t,m s_s,m e^{F_t,m − F_s,m}  (s ≤ t; F the cumulative routed f), over act(v): the GSA core
         (:func:`.fla_gsa.slot_attention`); p and the routing come from q, k, r, f alone, never from the values.
unified: H_c = diag(ν_c · γ(o_c) [· gate_c]) · α_h · diag(γ(v_c) · m)  over ``v_proj``'s output, γ the activation's
         gain act(x) = γ(x)·x (σ for swish / silu, the step x > 0 for relu), ν the norm's scale from the real
         activations; a ``gate_fn`` without such a gain (sigmoid, gelu, ...) is refused for unified. ``components``:
         ``act`` the gains, ``norm`` ν, ``gate`` the output gate, ``s6`` α.
Training with ``add_gumbel_noise`` routes through random noise that no rebuild can reproduce: refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..operators import masked_tokens
from .common import run
from .fla_gsa import slot_attention, slot_operator
from .fla_heads import rms_scale
from .fla_hgrn2 import refuse_norm_bias, refuse_packed
from .fla_retnet import rotary, sequence_positions

MIXER_CLASSES = ("Raven",)
INNER_MIXERS: dict = {}
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's Raven has none yet (its "
                   "routing and softmax over the slots need their own)")


def _step(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


# fla's activations (``fla.modules.activations.ACT2FN``) by the name of their function or autograd Function: the
# float64 function, and its gain γ with act(x) = γ(x)·x (None: not homogeneous, no unified factor)
_ACTIVATIONS = {"SwishFunction": (F.silu, torch.sigmoid), "silu": (F.silu, torch.sigmoid),
                "relu": (F.relu, _step), "SigmoidFunction": (torch.sigmoid, None), "sigmoid": (torch.sigmoid, None)}
_GATED_NORM_ACTIVATIONS = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}


def activation(function, formulation: str):
    """(act, gain) of Raven's ``gate_fn`` (float64 functions), refusing one the rebuild does not know, or one without
    a gain for unified."""
    function = getattr(function, "__mamba_captum_original__", function)  # a layer built while fla_on_cpu() held it
    name = getattr(getattr(function, "__self__", None), "__name__", None) or getattr(function, "__name__", "")
    found = _ACTIVATIONS.get(name)
    if found is None:
        raise NotImplementedError(f"mamba_captum: fla's Raven with gate_fn {name or function!r} has no rebuild yet.")
    if found[1] is None and formulation == "unified":
        raise NotImplementedError(f"mamba_captum: the unified operator of a Raven layer with gate_fn {name!r}: the "
                                  "activation is no gain times its input; use formulation='hidden'.")
    return found


def routed_gates(mixer, h, dtype: torch.dtype):
    """(f, s) (B, L, H_kv, M) of the routed slots, as fla computes them (the router in the model's dtype, so that
    the same top k are chosen; the Mamba-2 decay in float32), cast to ``dtype`` (the queries' dtype in fla)."""
    batch, length, _ = h.shape
    slots = mixer.num_slots
    router = run(mixer.r_proj, h).reshape(batch, length, -1, slots)
    if mixer.decay_type == "Mamba2":
        f = (-mixer.A_log.float().exp() * F.softplus(run(mixer.a_proj, h).float() + mixer.dt_bias)).unsqueeze(-1)
    else:
        f = F.logsigmoid(run(mixer.f_proj, h).reshape(batch, length, -1, slots)) / mixer.gate_logit_normalizer
    scores = torch.sigmoid(router) if mixer.router_score == "sigmoid" else torch.softmax(router, dim=-1)
    ranked = scores + mixer.r_bias.float() if mixer.bias_rmm else scores
    chosen = ranked.topk(mixer.topk, dim=-1).indices
    weights = torch.gather(scores, dim=-1, index=chosen)
    if mixer.router_score == "sigmoid":
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-9)
    routing = torch.zeros_like(router).scatter_(-1, chosen, weights.to(router.dtype))
    f = (f * routing).to(dtype)
    return f, (1 - f.exp()).to(dtype)


def _norm_eps(norm, dtype: torch.dtype) -> float:
    """The epsilon a norm uses: its own, or torch's ``nn.RMSNorm`` default (the input dtype's machine epsilon)."""
    return torch.finfo(dtype).eps if norm.eps is None else norm.eps


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input.

    Returns:
        (operator, rebuilt_output): the :class:`HeadOperator` and the mixer output recomputed from it, (B, L, D).
    """
    mixer = call.located.module
    refuse_packed(call, "Raven")
    if mixer.training and mixer.add_gumbel_noise:
        raise NotImplementedError("mamba_captum: a Raven layer in training mode with add_gumbel_noise routes through "
                                  "random noise that no rebuild reproduces; call model.eval().")
    act, gain = activation(mixer.gate_fn, formulation)
    mask = call.attention_mask
    h = masked_tokens(call.hidden_states, mask)
    dtype = h.dtype
    batch, length, _ = h.shape
    heads, key_dim, value_dim, groups = mixer.num_heads, mixer.head_k_dim, mixer.head_v_dim, mixer.num_kv_groups
    q = run(mixer.q_proj, h).reshape(batch, length, -1, key_dim)
    k = run(mixer.k_proj, h).reshape(batch, length, -1, key_dim)
    value_pre = run(mixer.v_proj, h)
    q, k = mixer.feature_map(q), mixer.feature_map(k)
    q, k = mixer.q_norm(q), mixer.k_norm(k)
    if mixer.use_rope:
        positions = sequence_positions(mask, batch, length, h.device)
        q, k = rotary(mixer.rotary, q, positions).to(dtype), rotary(mixer.rotary, k, positions).to(dtype)
    values = act(value_pre.double())
    if mask is not None:  # fla drops the pads: they write nothing into either state
        keep = mask.to(dtype)[:, :, None]
        k, values = k * keep[..., None], values * keep
    f, s = routed_gates(mixer, h, q.dtype)
    per_head = lambda t: t.reshape(batch, length, -1, value_dim).repeat_interleave(groups, dim=2)  # noqa: E731
    k, f, s = (t.repeat_interleave(groups, dim=2) for t in (k, f, s))
    scale = key_dim ** -0.5 if mixer.scale is None else mixer.scale
    core, values, output = slot_attention(q, k, per_head(values), s, f, scale, work_dtype)

    if mixer.use_output_gate:
        norm, width = mixer.o_norm, False
        refuse_norm_bias(norm, "Raven")
        gate_pre = run(mixer.o_gate_proj, h).double().reshape(batch, length, heads, value_dim)
        gate_act = _GATED_NORM_ACTIVATIONS.get(norm.activation) if mixer.fuse_norm_and_gate else act
        if gate_act is None:
            raise NotImplementedError(f"mamba_captum: fla's gated norm with activation {norm.activation!r}.")
        gate = gate_act(gate_pre)
    else:
        norm, width, gate = mixer.g_norm, True, None
        refuse_norm_bias(norm, "Raven")
    eps = _norm_eps(norm, dtype)

    def after_core(out):  # ν(act(out)) ⊙ act(out) [⊙ gate], float64
        activated = act(out)
        scaled = rms_scale(norm, activated, over_width=width, eps=eps) * activated
        return scaled if gate is None else scaled * gate

    rows = [("act", None if gain is None else gain(output)),
            ("norm", rms_scale(norm, act(output), over_width=width, eps=eps)), ("gate", gate)]
    cols = [("act", None if gain is None else per_head(gain(value_pre.double())))]
    return slot_operator(call, formulation, components, work_dtype, core=core, values=values, output=output,
                         after_core=after_core, rows=rows, cols=cols, value_pre=per_head(value_pre), conv=None,
                         heads=heads, head_dim=value_dim, out_proj=mixer.o_proj)
