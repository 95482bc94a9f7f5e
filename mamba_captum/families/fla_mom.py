"""flash-linear-attention's mixture of memories: ``MomAttention`` (model type ``mom``, fla's MoM: each memory a gated
delta rule over the tokens routed to it, plus an optional shared memory over all tokens).

Forward (fla 0.6.0, ``fla/layers/mom.py``, in eval mode), h the layer input, M memories, top-k routing:

- routing: p = softmax(gate(h)) over the M memories (float32), the top k per token with weights w_{t,j} = p_{t,j} /
  Σ_top-k p (cast back to h's dtype); pads are routed nowhere.
- layout (``transform``): the k copies of every real token are sorted by (batch row, memory); memory m of row b gets
  the sub-sequence S_{b,m} = (t_1 < … < t_n) of the tokens that chose it, in token order. (fla sorts with an unstable
  ``argsort``, which on a CPU can reorder a memory's tokens and make the layer non-causal and batch-dependent;
  ``fla_on_cpu()`` runs the layout with a stable sort, :mod:`mamba_captum.fla_cpu.ops_mom`, and the rebuild follows
  it: a layout fla orders otherwise fails the reconstruction check.) Every sub-sequence is a sequence of its own
  (cu_seqlens): zero state, zero conv window.
- memory m over S_{b,m}: q = silu(conv_q(q_proj h)), k = silu(conv_k(k_proj[m] h)), v = silu(conv_v(v_proj[m] h)),
  the short convs running along the sub-sequence (the previous tokens routed to m, not the previous tokens);
  β = σ(b_proj[m] h), g = −exp(A_log)·softplus(a_proj[m] h + dt_bias); ``single_kv_proj``: shared_k / shared_v /
  shared_b / shared_a for every memory. The gated delta rule (q, k L2-normalised in the kernel)::

      S_i = (I − β_i k_i k_iᵀ) exp(g_i) S_{i−1} + β_i k_i v_iᵀ,      o^m_{t_i} = K^−½ S_iᵀ q_i

- combination (``reconstruct``): o_t = Σ_j w_{t,j} o^{m_j}_t over the k memories m_j token t chose (a memory a token
  did not choose adds nothing for it); ``shared_mem``: plus o^sh_t, the same gated delta rule over the whole
  sequence with shared_k / shared_v / shared_b / shared_a (q_proj and the convs shared), weight 1.
- out = o_proj(ν ⊙ swish(g_proj h) ⊙ o) per head (fla's gated RMS norm; without ``use_output_gate`` its RMS norm).

Every memory has its own values (its own v_proj over its own tokens, its own conv window), so the operator is a sum of
per-memory operators, one per memory and one for the shared memory, each acting on that memory's values
(:class:`RoutedMemoriesOperator`); α^m_h is the memory's delta-rule α over its sub-sequence, scattered back to the
token positions (zero where t or s did not choose m):

hidden:  H_h = Σ_m diag(w_{·,m}) · α^m_h  (+ α^sh_h)   over each memory's v after its conv; head h's map.
unified: H_c = Σ_m diag(ν_c · swish(g_c) · w_{·,m}) · α^m_h · diag(σ(pre^m_c)) · M^m_c  (+ the shared memory's, weight
         1), over each memory's v_proj output before its conv; pre^m the conv's output and M^m_c its taps, both along
         the memory's sub-sequence; ν the norm's per-token scale from the layer's own o.

Maps add up over the memories (the memories are parallel mixers, like :class:`~mamba_captum.operators.SumOperator`'s
parts): ``reduce=None`` gives the per-channel sums Σ_m H^m_c (B, C, R, L), "mean" their channel mean, "abs_mean" the
mean of |Σ_m H^m_c|; ``contributions`` are Σ_m Σ_c g_c[i] H^m_c[i, j] x^m_c[j]. q, k, β, g, the routing and its
weights come from the same tokens but, as B and C of the SSMs, enter α (detached), not the attribution.

Refused: training mode (fla then runs the routed short convs over all memories' packed tokens without cu_seqlens,
across memories and batch rows), packed sequences (cu_seqlens), a cached prefix (past_key_values), a routing weight
that underflows to 0 (fla's packing then disagrees with its routing), a conv activation other than SiLU and (unified)
a value conv with a bias. The load-balancing aux loss only enters fla's training loss, not the hidden states; the
``capacity`` option is unused by fla 0.6.0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.delta_rule import delta_rule_output_chunked
from ..operators import (HeadOperator, RoutedCore, RoutedMemoriesOperator, gate_norm_rows, gather_slots, masked_tokens,
                         scatter_slots)
from .common import linear_readout, run
from .fla_delta_net import output_gate
from .fla_heads import refuse_packed_or_cached, rms_scale, short_conv
from .gated_deltanet import delta_rule_inputs

MIXER_CLASSES = ("MomAttention",)
LRP_UNSUPPORTED = ("MambaLRP's rules are written for the transformers families; fla's MomAttention has none yet (its "
                   "routing, fla norms and gates need their own)")
INNER_MIXERS = {"MomAttention": ("q_conv1d", "k_conv1d", "v_conv1d")}  # the short convs: part of H


def _refuse(call, formulation: str):
    """Refuse what the rebuild does not follow (module docstring)."""
    mixer = call.located.module
    if mixer.training:
        raise NotImplementedError(
            "mamba_captum: fla's MomAttention in training mode runs its routed short convs over all memories' packed "
            "tokens without cu_seqlens (across memories and batch rows); explain the model in eval() mode.")
    refuse_packed_or_cached(call)
    if not mixer.use_short_conv:
        raise NotImplementedError("mamba_captum: fla's MomAttention without short convs (use_short_conv=False), "
                                  "whose fla 0.6.0 forward skips the SiLU of its routed q, k, v.")
    for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
        if conv.activation not in ("silu", "swish"):
            raise NotImplementedError(f"mamba_captum: fla's MomAttention with conv activation {conv.activation!r}.")
    if formulation == "unified" and mixer.v_conv1d.bias is not None:
        raise NotImplementedError("mamba_captum: the unified operator of fla's MomAttention whose value conv has a "
                                  "bias (conv_bias=True) is not linear in the values; use formulation='hidden'.")


def routing(mixer, hidden_states: torch.Tensor, mask: torch.Tensor | None):
    """fla's top-k routing and token layout (module docstring): (weights (B, L, k) in h's dtype, per memory m
    (positions (B, n_m) long, slots (B, n_m) long): the token of each slot of its sub-sequences in fla's order and which
    of the token's k choices it is, −1 for empty slots)."""
    batch, length = hidden_states.shape[:2]
    with torch.no_grad():
        scores = F.softmax(run(mixer.gate, hidden_states), dim=2, dtype=torch.float)
        weights, selected = torch.topk(scores, mixer.topk, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(hidden_states.dtype)
        topk = selected.shape[-1]
        real = torch.ones(batch, length, dtype=torch.bool, device=weights.device) if mask is None else mask == 1
        if bool((weights[real] == 0).any()):
            raise NotImplementedError("mamba_captum: fla's MomAttention with a routing weight that underflows to 0 "
                                      "(its packing then disagrees with its routing).")
        # transform's layout: the copies of the tokens sorted by (batch row, memory), pads last
        memories = selected.reshape(-1)
        rows = torch.arange(batch, device=weights.device)[:, None].repeat(1, length * topk).reshape(-1)
        rows[~real.repeat_interleave(topk, dim=1).flatten()] = batch
        order = (rows * (memories.max() + 1) + memories).argsort(stable=True)  # token order (fla_cpu.ops_mom)
        sorted_rows, sorted_memories = rows[order], memories[order]
        tokens, choices = (order % (length * topk)) // topk, order % topk
        layout = []
        for memory in range(mixer.num_memories):
            picked = [((sorted_rows == b) & (sorted_memories == memory)).nonzero().flatten() for b in range(batch)]
            width = max(len(p) for p in picked)
            positions = torch.full((batch, width), -1, dtype=torch.long, device=weights.device)
            slots = torch.full_like(positions, -1)
            for b, p in enumerate(picked):
                positions[b, :len(p)], slots[b, :len(p)] = tokens[p], choices[p]
            layout.append((positions, slots))
    return weights, layout


def _projections(mixer, memory):
    """(k, v, b, a) projections of a routed memory (``memory`` an index) or of the shared memory (None)."""
    if memory is None or mixer.single_kv_proj:
        return mixer.shared_k, mixer.shared_v, mixer.shared_b, mixer.shared_a
    return mixer.k_proj[memory], mixer.v_proj[memory], mixer.b_proj[memory], mixer.a_proj[memory]


def memory_pieces(mixer, h: torch.Tensor, slot_mask: torch.Tensor, memory, work_dtype: torch.dtype):
    """One memory over its sub-sequences: h (B, n, D) the routed tokens (zero at empty slots, which come last),
    slot_mask (B, n). Returns (core :class:`DeltaRuleCore`, v_proj's output (B, n, H·P), the value conv's output
    (B, n, H·P), v (B, n, H, P), o = α v (B, n, H, P) float64)."""
    batch, slots_count, _ = h.shape
    heads, key_dim, value_dim = mixer.num_heads, mixer.head_qk_dim, mixer.head_v_dim
    k_proj, v_proj, b_proj, a_proj = _projections(mixer, memory)
    with torch.no_grad():
        q = short_conv(mixer.q_conv1d, run(mixer.q_proj, h))[1]
        k = masked_tokens(short_conv(mixer.k_conv1d, run(k_proj, h))[1], slot_mask)
        beta = torch.sigmoid(run(b_proj, h)).double() * slot_mask[:, :, None]
        # fla: −A_log.float().exp() · softplus(a.float() + dt_bias), in the promoted dtype
        log_decay = -mixer.A_log.float().exp().double() * F.softplus((run(a_proj, h).float() + mixer.dt_bias).double())
        core = delta_rule_inputs(q, k, beta, log_decay, heads, key_dim, work_dtype)
    value_pre = run(v_proj, h)
    act_pre, v = short_conv(mixer.v_conv1d, value_pre)
    values = masked_tokens(v, slot_mask).reshape(batch, slots_count, heads, value_dim)
    output = delta_rule_output_chunked(core.q.double(), core.k.double(), core.beta.double(), core.log_decay,
                                       values.double())
    return core, value_pre, act_pre, values, output


def rebuild(call, formulation: str, components: frozenset, work_dtype: torch.dtype):
    """Rebuild the layer's operator from its recorded input (module docstring).

    Returns:
        (operator, rebuilt_output): the :class:`RoutedMemoriesOperator` and the mixer output recomputed from it,
        (B, L, D).
    """
    _refuse(call, formulation)
    mixer, mask = call.located.module, call.attention_mask
    hidden_states = call.hidden_states
    batch, length = hidden_states.shape[:2]
    heads, value_dim = mixer.num_heads, mixer.head_v_dim
    device = hidden_states.device
    h = masked_tokens(hidden_states, mask)
    weights, layout = routing(mixer, hidden_states, mask)

    everything = torch.arange(length, device=device).expand(batch, length)
    memories = []  # (positions, slot mask (B, n), routing weight per slot (B, n) float64 or None, pieces)
    for memory, (positions, slots) in enumerate(layout):
        if positions.shape[1] == 0:
            continue  # no token chose this memory
        slot_mask = (positions >= 0).to(h.dtype)
        slot_weight = torch.gather(gather_slots(weights, positions), 2, slots.clamp(min=0)[:, :, None])[:, :, 0].double()
        pieces = memory_pieces(mixer, gather_slots(h, positions), slot_mask, memory, work_dtype)
        memories.append((positions, slot_mask, slot_weight, pieces))
    if mixer.shared_mem:
        token_mask = torch.ones(batch, length, dtype=h.dtype, device=device) if mask is None else mask.to(h.dtype)
        memories.append((everything, token_mask, None, memory_pieces(mixer, h, token_mask, None, work_dtype)))

    o = torch.zeros(batch, length, heads, value_dim, dtype=torch.float64, device=device)
    for positions, _, slot_weight, pieces in memories:
        routed = pieces[4] if slot_weight is None else slot_weight[:, :, None, None] * pieces[4]
        o = o + scatter_slots(routed, positions, length)

    gate, norm = output_gate(mixer, h, mixer.use_output_gate, value_dim)
    nu = lambda out: rms_scale(norm, out)  # noqa: E731

    def scaled(out):  # ν(out) ⊙ gate ⊙ out, float64
        return nu(out) * (out if gate is None else gate * out)

    inner = scaled(o)
    rebuilt = run(mixer.o_proj, inner.reshape(batch, length, -1).to(hidden_states.dtype))
    if mask is not None:
        rebuilt = rebuilt * mask.to(rebuilt.dtype)[:, :, None]
    readout_proj = linear_readout(mixer.o_proj)
    w = lambda t: None if t is None else t.to(work_dtype)  # noqa: E731
    row_factor = None if formulation == "hidden" else gate_norm_rows(components, gate, nu(o))
    full_scale = nu(o) if gate is None else nu(o) * gate  # the real row factor: the parts' outputs add up to inner

    parts = []
    for positions, slot_mask, slot_weight, (core, value_pre, act_pre, values, output) in memories:
        slots_count = positions.shape[1]
        weight = torch.ones_like(slot_mask, dtype=torch.float64) if slot_weight is None else slot_weight
        per_slot = weight[:, :, None, None]
        common = dict(mask=w(slot_mask), heads=heads, head_dim=value_dim)
        if formulation == "hidden":
            part = HeadOperator(RoutedCore(core, w(weight)), **common, values=w(values), output=w(per_slot * output))
        else:
            row = per_slot.expand(batch, slots_count, heads, value_dim)
            if row_factor is not None:
                row = row * gather_slots(row_factor, positions)
            col = slot_mask.to(work_dtype)[:, :, None, None].expand(batch, slots_count, heads, value_dim)
            if "act" in components:
                col = col * torch.sigmoid(w(act_pre)).reshape(batch, slots_count, heads, value_dim)
            taps = mixer.v_conv1d.weight[:, 0, :]
            conv = w(taps).reshape(heads, value_dim, -1) if "conv" in components else None
            part = HeadOperator(core, **common, row_weight=w(row), col_weight=col, conv_weight=conv,
                                s6="s6" in components,
                                values=w(masked_tokens(value_pre, slot_mask)).reshape(batch, slots_count, heads,
                                                                                      value_dim),
                                output=w(per_slot * gather_slots(full_scale, positions) * output))
        parts.append((positions, part))
    if formulation == "hidden":
        output, readout = o, (lambda out: readout_proj(scaled(out).reshape(batch, length, -1)))
    else:
        output, readout = inner, (lambda out: readout_proj(out.reshape(batch, length, -1)))
    operator = RoutedMemoriesOperator(parts, None if mask is None else w(mask), heads, value_dim, w(output),
                                      readout=readout, out_dtype=work_dtype)
    return operator, rebuilt
