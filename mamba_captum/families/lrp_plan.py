"""MambaLRP's plan of a model: which module gets which rule, and the proof that nothing is left without one.

:func:`lrp_plan` walks the model's modules from the root. Each module is

- a token mixer with an adapter: its output is replaced by the adapter's ``lrp(call, work_dtype)`` (the family's
  rules, :mod:`mamba_captum.families`); its submodules are covered by it;
- a module with a rule here (:data:`RULES`: norms, gated MLPs, mixtures of experts): its output is replaced by the
  rule's expression, computed from its input; its submodules are covered by it;
- linear (``nn.Linear``, ``nn.Embedding``, ``nn.Conv1d`` / ``nn.Conv2d``, dropout, identity, module lists), or a
  container whose own forward is linear apart from the submodules it calls (:data:`LINEAR_CONTAINERS`,
  :data:`LINEAR_CONTAINER_PATHS`: decoder layers, models, heads, attention modules, whose softmax is handled at HF's
  attention interface): its submodules are planned in turn;
- upstream of the relevance leaf (:data:`VISION_LANGUAGE`: a vision-language model's vision tower and projector,
  whose image features enter the language model's ``inputs_embeds``, the leaf): run without a graph;
- anything else: refused (``NotImplementedError`` naming the class), since a non-linear step without a rule would
  make the relevance silently non-conservative.

A rule is ``rule(module, args, kwargs, output, work_dtype) -> tensor``: the module's (main) output under the rule,
a differentiable function of its inputs ``args`` / ``kwargs`` (which carry the graph), with the real output's
value (checked by the engine, :mod:`mamba_captum.lrp_forward`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import rules

# -- containers whose own forward is linear in what flows through it ------------------------------------------------
# A class is listed here only after its forward was read (transformers 5.23): residual additions, casts, scalings
# by constants, indexing and calls of submodules; every non-linear step sits in a submodule with a rule.
LINEAR_CONTAINERS = {
    # torch.compile's wrapper: the session runs its _orig_mod eagerly, under the rules of what it holds
    "OptimizedModule",
    # Mamba-1
    "MambaForCausalLM", "MambaModel", "MambaBlock",
    "FalconMambaForCausalLM", "FalconMambaModel", "FalconMambaBlock",
    # Mamba-2
    "Mamba2ForCausalLM", "Mamba2Model", "Mamba2Block",
    # Jamba (the router's outputs only feed the experts, whose rule detaches the routing weights)
    "JambaForCausalLM", "JambaForSequenceClassification", "JambaModel", "JambaAttentionDecoderLayer",
    "JambaMambaDecoderLayer", "JambaAttention", "JambaSparseMoeBlock",
    # Bamba (RoPE acts on queries and keys only)
    "BambaForCausalLM", "BambaModel", "BambaDecoderLayer", "BambaAttention",
    # NemotronH (its mixture of experts: the router's weights only feed the experts, whose rule detaches them; the
    # latent projections are nn.Linear or identities; the shared expert is added ungated)
    "NemotronHForCausalLM", "NemotronHModel", "NemotronHBlock", "NemotronHAttention", "NemotronHMoE",
    # FalconH1 (attention ∥ Mamba-2, scaled by constant multipliers)
    "FalconH1ForCausalLM", "FalconH1Model", "FalconH1DecoderLayer", "FalconH1Attention",
    # GraniteMoeHybrid (constant embedding / residual multipliers and logits scaling)
    "GraniteMoeHybridForCausalLM", "GraniteMoeHybridModel", "GraniteMoeHybridDecoderLayer",
    "GraniteMoeHybridAttention", "GraniteMoeHybridMoE",
    # Zamba2 (the shared block, run in several layers, sees the concatenation of the stream and the embeddings;
    # its low-rank adapters are linear)
    "Zamba2ForCausalLM", "Zamba2Model", "Zamba2HybridLayer", "Zamba2MambaDecoderLayer",
    "Zamba2AttentionDecoderLayer", "Zamba2Attention",
    # RWKV-4 (the LayerNorms have their rule; the residual stream is halved every rescale_every blocks)
    "RwkvForCausalLM", "RwkvModel", "RwkvBlock",
    # RecurrentGemma (embeddings × a constant; the logits' soft cap has its rule on the head, SOFT_CAPPED_HEADS)
    "RecurrentGemmaForCausalLM", "RecurrentGemmaModel", "RecurrentGemmaDecoderLayer", "RecurrentGemmaAttention",
    # the linear families' hybrids (the gated attentions' sigmoid gates: SIGNAL_GATE_INPUTS)
    "Qwen3_5ForCausalLM", "Qwen3_5TextModel", "Qwen3_5DecoderLayer", "Qwen3_5Attention",
    "OlmoHybridForCausalLM", "OlmoHybridModel", "OlmoHybridAttentionDecoderLayer",
    "OlmoHybridLinearAttentionDecoderLayer", "OlmoHybridAttention",
    "Lfm2ForCausalLM", "Lfm2Model", "Lfm2DecoderLayer", "Lfm2Attention",
    "Lfm3ForCausalLM", "Lfm3Model", "Lfm3DecoderLayer", "Lfm3Attention",
    "MiniMaxForCausalLM", "MiniMaxModel", "MiniMaxDecoderLayer", "MiniMaxAttention", "MiniMaxSparseMoeBlock",
    "xLSTMForCausalLM", "xLSTMModel", "xLSTMBlock",
    "Qwen3NextForCausalLM", "Qwen3NextModel", "Qwen3NextDecoderLayer", "Qwen3NextAttention",
    "Qwen3NextSparseMoeBlock",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel", "Qwen3_5MoeDecoderLayer", "Qwen3_5MoeAttention",
    "Qwen3_5MoeSparseMoeBlock",
    "Lfm2MoeForCausalLM", "Lfm2MoeModel", "Lfm2MoeDecoderLayer", "Lfm2MoeAttention", "Lfm2MoeSparseMoeBlock",
    # LaraMini (transformers 5.24): Qwen3 attention (q / k norms, RoPE only in the sliding layers); the mixture of
    # experts adds its shared expert ungated, so its own forward is a sum
    "LaraMiniForCausalLM", "LaraMiniModel", "LaraMiniDecoderLayer", "LaraMiniAttention", "LaraMiniSparseMoeBlock",
    # KDA hybrids (multi-head latent attention: the latent's RMS norm has its rule; keys are in P)
    "KimiLinearForCausalLM", "KimiLinearModel", "KimiLinearDecoderLayer", "KimiLinearAttention", "KimiLinearMoE",
    "BailingHybridForCausalLM", "BailingHybridModel", "BailingHybridDecoderLayer", "BailingHybridAttention",
    "BailingHybridMoE",
    # Zamba (v1): the shared attention block reads the stream concatenated with the embeddings
    "ZambaForCausalLM", "ZambaModel", "ZambaHybridLayer", "ZambaMambaDecoderLayer", "ZambaAttentionDecoderLayer",
    "ZambaAttention",
    # GLM-5-next (transformers 5.24): the decoder layer mixes its hyper-connection streams with the weights its
    # HyperConnection modules return (detached by their rule): post ⊗ out + combᵀ h, linear; the model expands the
    # embeddings to the streams and the head averages them (HyperHead); NoPE. Its indexed attention: the indexer
    # (NO_RELEVANCE_PATH) gives the keys each query sees, a mask of the softmax, whose P is detached anyway
    "Glm5NextForConditionalGeneration", "Glm5NextModel", "Glm5NextTextModel", "Glm5NextTextDecoderLayer",
    "Glm5NextTextAttention", "Glm5NextTextMoE", "Glm5NextTextHyperHead",
    # Qwen4-exp (transformers 5.24): the decoder layer adds the block's output, times the injection weights its
    # GatedResidual returns (detached by their rule), to the streams (h repeated hc_count times by the model); the
    # indexed attention's indexer (NO_RELEVANCE_PATH) only masks the softmax; the attention's σ output gate and the
    # shared expert's σ gate are signal gates (SIGNAL_GATE_INPUTS). Its per-layer embeddings (ple_layer_ids) are
    # not covered: Qwen4ExpTextPLELayer has no rule and is refused by name
    "Qwen4ExpForConditionalGeneration", "Qwen4ExpModel", "Qwen4ExpForCausalLM", "Qwen4ExpTextModel",
    "Qwen4ExpTextDecoderLayer", "Qwen4ExpTextAttention", "Qwen4ExpTextSparseMoeBlock",
    # ZAYA (transformers 5.24): the embeddings and each residual branch are (x + b) ⊙ s (ResidualScaling, linear,
    # b a constant); its attention has its adapter's rule (its own forward, P̄ v at the attention interface); the
    # mixture of experts returns (experts' output, the router's state), the state feeding the next router only
    "ZayaForCausalLM", "ZayaModel", "ZayaDecoderLayer", "ZayaResidualScaling", "ZayaSparseMoeBlock",
    # Inkling (transformers 5.24, the text model): the decoder layer's two branches, each a mixer of the adapter
    # (the attention, then attn_sconv; the MLP, then mlp_sconv) added to the residual; the mixture of experts adds
    # the shared experts, weighted by the router's γ (detached by their rule); the head divides by a constant
    "InklingForCausalLM", "InklingTextModel", "InklingDecoderLayer", "InklingMoE",
    # Inkling2 (transformers 5.24, the text model): Inkling's branches, the attention residuals over depth
    # (BlockAttentionResidual, a rule) choosing each branch's input, float32 residual sums; the head's soft cap has
    # its rule (SOFT_CAPPED_HEADS)
    "Inkling2ForCausalLM", "Inkling2TextModel", "Inkling2SlidingDecoderLayer", "Inkling2FullDecoderLayer",
    "Inkling2SparseMoeBlock",
    # Inkling2-Loop: the same, and its looped layers, whose later passes mix (per token) messages from the previous
    # pass into their inputs (MessageGate, MessageAttentionResidual: rules); the model restarts each pass from the
    # stream before the loop
    "Inkling2LoopForCausalLM", "Inkling2LoopTextModel", "Inkling2LoopSlidingDecoderLayer",
    "Inkling2LoopSlidingLoopDecoderLayer", "Inkling2LoopFullDecoderLayer", "Inkling2LoopFullLoopDecoderLayer",
    "Inkling2LoopSparseMoeBlock",
    # vision-language wrappers (transformers 5.24): the head's forward is the model's, then lm_head; the model's
    # embeds the tokens, merges the image features into the placeholder rows (masked_scatter, linear in both) and
    # runs the language model on the result (VISION_LANGUAGE: the relevance is read at that merged input)
    "Lfm2VlForConditionalGeneration", "Lfm2VlModel", "Lfm3VlForConditionalGeneration", "Lfm3VlModel",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5Model", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeModel",
    # flash-linear-attention 0.6.0 (FLAModel / FLAForCausalLM forwards, KDA's own head forward the same): embeddings,
    # blocks, the final norm and the head; each block is norm → mixer → fused-residual norm → GatedMLP → residual
    # (fla's RMSNorm and GatedMLP have rules; the blocks' attention residuals are refused, FLA_REFUSED). Read too:
    # the models of RetNet, HGRN-2 (its per-layer lower bounds a softmax of parameters: constants), LightNet and
    # LinearAttention, the heads of LinearAttention and PrecondKDA, and the precond blocks (a plain residual sum
    # without fuse_norm), all with forwards of their own and the same walk; a block holding fla's softmax
    # ``Attention`` (a hybrid's ``attn`` layers) is refused: that class has no rule
    *(f"{prefix}{suffix}" for prefix in ("GLA", "GatedDeltaNet", "DeltaNet", "KDA", "RetNet", "HGRN2", "LightNet",
                                         "LinearAttention", "Comba", "GatedDeltaProduct", "PrecondGatedDeltaNet",
                                         "PrecondKDA", "MesaNet")
      for suffix in ("ForCausalLM", "Model", "Block")),
}
# the same, for classes whose names are too common to be trusted alone: by module and qualified name
LINEAR_CONTAINER_PATHS = {
    # Vision Mamba (mamba_captum.vision.modeling_vim): the patch embedding (a Conv2d, linear), the CLS token and the
    # position embeddings added (constants: the guard reads their shares, ADDITIVE_CONSTANTS), the blocks
    # r + mixer(norm(r)), the final norm, the CLS row or the mean over tokens, the linear head
    *(f"mamba_captum.vision.modeling_vim.{name}" for name in ("VisionMamba", "PatchEmbed", "Block")),
}
# fla containers whose configuration adds a non-linear step to their own forward: attribute -> why it is refused
FLA_REFUSED = {"use_attnres": "attention residuals (attnres_block_size: a softmax over earlier blocks' outputs, "
                              "fused_attnres) have no MambaLRP rule"}

# Vision-language models: the model class -> (its language model's attribute, the attributes of the modules whose
# outputs only become the image features merged into the language model's ``inputs_embeds``). The merged
# embeddings are the relevance leaf (a placeholder token's relevance is its image features' gradient × input), so
# the vision tower and projector are upstream of it: they run without a graph and need no rules.
VISION_LANGUAGE = {"Lfm2VlModel": ("language_model", ("vision_tower", "multi_modal_projector")),
                   "Lfm3VlModel": ("language_model", ("vision_tower", "multi_modal_projector")),
                   "Qwen3_5Model": ("language_model", ("visual",)),
                   "Qwen3_5MoeModel": ("language_model", ("visual",)),
                   "Glm5NextModel": ("language_model", ("visual",)),
                   "Qwen4ExpModel": ("language_model", ("visual",))}

# Additive constants of a model's own forward that are not named ``*bias`` (module class -> parameter names): like
# the biases, they take a share of the explained score, which the guard reads from their gradients
ADDITIVE_CONSTANTS = {"VisionMamba": ("cls_token", "pos_embed")}

# Modules that compute no relevance path: rotary embeddings read their input's dtype and device only; routers give
# the routing weights (detached by the experts' rule) and the experts' indices.
NO_RELEVANCE_PATH_SUFFIXES = ("RotaryEmbedding",)
NO_RELEVANCE_PATH = {"JambaTopKRouter", "GraniteMoeHybridTopKRouter", "MiniMaxTopKRouter", "Qwen3NextTopKRouter",
                     "Qwen3_5MoeTopKRouter", "Lfm2MoeTopKRouter", "KimiLinearTopkRouter", "BailingHybridTopkRouter",
                     "LaraMiniTopKRouter", "NemotronHTopkRouter", "Glm5NextTextTopkRouter", "Glm5NextTextIndexer",
                     "Qwen4ExpTextTopKRouter", "Qwen4ExpTextQSAIndexer", "ZayaRouter",
                     # the router; and the normed embedding, upstream of the relevance leaf (its output)
                     "InklingTopkRouter", "InklingNormedEmbedding", "Inkling2TopKRouter", "Inkling2NormedEmbedding",
                     "Inkling2LoopTopKRouter", "Inkling2LoopNormedEmbedding"}

def _input(args, kwargs, name="hidden_states"):
    return args[0] if args else kwargs[name]


def rms_norm(module, args, kwargs, output, work_dtype):
    """An RMS norm: the normaliser detached (``x · (y / x)̄``, whatever the weight's form); a bias (xLSTM's, when
    configured) stays a constant: ``x · ((y − b) / x)̄ + b``."""
    x = _input(args, kwargs).to(work_dtype)
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias = bias.to(work_dtype)
        return rules.rms_norm_rule(x, output.to(work_dtype) - bias) + bias
    return rules.rms_norm_rule(x, output.to(work_dtype))


def layer_norm(module, args, kwargs, output, work_dtype):
    """``nn.LayerNorm``: σ detached, the centring linear, the bias a constant."""
    x = _input(args, kwargs, "input")
    return rules.layer_norm_rule(x.to(work_dtype), module.weight, module.bias, module.eps,
                                 dims=len(module.normalized_shape))


def fla_rms_norm(module, args, kwargs, output, work_dtype):
    """fla's ``RMSNorm(x, residual=None, prenorm=False, residual_in_fp32=False)``: the norm of ``s = x + residual``
    (the fused residual sum, linear) with the normaliser detached (:func:`rms_norm`); with ``prenorm`` the module
    returns ``(norm(s), s)`` and so does the rule."""
    names = ("x", "residual", "prenorm")
    x, residual, prenorm = (args[i] if len(args) > i else kwargs.get(name) for i, name in enumerate(names))
    summed = x.to(work_dtype) if residual is None else x.to(work_dtype) + residual.to(work_dtype)
    y = rms_norm(module, (summed,), {}, output, work_dtype)  # output: the main one, norm(s)
    # the sum passed on as a tensor of its own: the ledger reads the relevance that reaches it from downstream only
    return (y, summed.view_as(summed)) if prenorm else y


def fla_gated_mlp(module, args, kwargs, output, work_dtype):
    """fla's ``GatedMLP`` ``down(swish(gate(x)) ⊙ up(x))`` (fused or not): the identity and half rules, as
    :func:`glu_mlp`; its ``powlu`` activation has no rule here (refused by :func:`lrp_plan`)."""
    x = _input(args, kwargs, "x").to(work_dtype)
    gate = F.linear(x, module.gate_proj.weight.to(work_dtype), _bias(module.gate_proj, work_dtype))
    up = F.linear(x, module.up_proj.weight.to(work_dtype), _bias(module.up_proj, work_dtype))
    inner = rules.half_product(rules.silu_rule(gate), up)
    return F.linear(inner, module.down_proj.weight.to(work_dtype), _bias(module.down_proj, work_dtype))


def _activation_rule(act_fn, x):
    """An element-wise activation module (SiLU, GELU, ReLU, ...) by the identity rule."""
    with torch.no_grad():
        activated = act_fn(x)
    return rules.identity_rule(x, activated)


def glu_mlp(module, args, kwargs, output, work_dtype):
    """A gated MLP ``down(act(gate(x)) ⊙ up(x))``: the activation by the identity rule, the product by the half
    rule (both factors depend on x)."""
    x = _input(args, kwargs, "x").to(work_dtype)
    gate = F.linear(x, module.gate_proj.weight.to(work_dtype), _bias(module.gate_proj, work_dtype))
    up = F.linear(x, module.up_proj.weight.to(work_dtype), _bias(module.up_proj, work_dtype))
    inner = rules.half_product(_activation_rule(module.act_fn, gate), up)
    return F.linear(inner, module.down_proj.weight.to(work_dtype), _bias(module.down_proj, work_dtype))


def plain_mlp(module, args, kwargs, output, work_dtype):
    """An MLP ``down(act(up(x)))`` (NemotronH's ReLU²): the activation by the identity rule."""
    x = _input(args, kwargs, "x").to(work_dtype)
    up = F.linear(x, module.up_proj.weight.to(work_dtype), _bias(module.up_proj, work_dtype))
    return F.linear(_activation_rule(module.act_fn, up), module.down_proj.weight.to(work_dtype),
                    _bias(module.down_proj, work_dtype))


def falcon_h1_mlp(module, args, kwargs, output, work_dtype):
    """FalconH1's gated MLP ``down(up(x) ⊙ act(gate(x) · m_g)) · m_d``: identity and half rules."""
    x = _input(args, kwargs, "x").to(work_dtype)
    gate = F.linear(x, module.gate_proj.weight.to(work_dtype), _bias(module.gate_proj, work_dtype))
    gate = gate * module.gate_multiplier
    up = F.linear(x, module.up_proj.weight.to(work_dtype), _bias(module.up_proj, work_dtype))
    inner = rules.half_product(up, _activation_rule(module.act_fn, gate))
    down = F.linear(inner, module.down_proj.weight.to(work_dtype), _bias(module.down_proj, work_dtype))
    return down * module.down_multiplier


def chunked_glu_mlp(module, args, kwargs, output, work_dtype):
    """GraniteMoeHybrid's shared MLP ``output(act(a) ⊙ b)``, ``a, b = input(x).chunk(2)``: identity and half
    rules."""
    x = _input(args, kwargs).to(work_dtype)
    a, b = F.linear(x, module.input_linear.weight.to(work_dtype), _bias(module.input_linear, work_dtype)).chunk(2, -1)
    inner = rules.half_product(_activation_rule(module.activation, a), b)
    return F.linear(inner, module.output_linear.weight.to(work_dtype), _bias(module.output_linear, work_dtype))


def zamba2_mlp(module, args, kwargs, output, work_dtype):
    """Zamba2's shared gated MLP with its per-call low-rank adapter: ``down(act(a) ⊙ b)``, ``a, b =
    (gate_up(x) + adapter_ℓ(x)).chunk(2)`` (the adapter linear): identity and half rules."""
    x = _input(args, kwargs, "hidden_state")
    layer_idx = args[1] if len(args) > 1 else kwargs.get("layer_idx")
    adapter = module.gate_up_proj_adapter_list[module.layer_dic[layer_idx]]
    gate_up = F.linear(x.to(work_dtype), module.gate_up_proj.weight.to(work_dtype),
                       _bias(module.gate_up_proj, work_dtype)) + adapter(x).to(work_dtype)
    a, b = gate_up.chunk(2, dim=-1)
    inner = rules.half_product(_activation_rule(module.act_fn, a), b)
    return F.linear(inner, module.down_proj.weight.to(work_dtype), _bias(module.down_proj, work_dtype))


def rwkv_channel_mixing(module, args, kwargs, output, work_dtype):
    """RWKV-4's channel mixing ``σ(receptance(x_r)) ⊙ value(relu(key(x_k))²)``, x_k / x_r the token-shifted mixes
    (linear): ReLU² by the identity rule (the same as the half rule on relu · relu), the receptance gate by
    :func:`mamba_captum.rules.sigmoid_gate`."""
    hidden = _input(args, kwargs, "hidden")
    if kwargs.get("state") is not None or (len(args) > 1 and args[1] is not None):
        raise NotImplementedError("mamba_captum: MambaLRP explains whole sequences (no state).")
    shifted = F.pad(hidden, (0, 0, 1, -1))
    mix = lambda mu: hidden * mu + shifted * (1 - mu)  # noqa: E731
    w = lambda t: t.to(work_dtype)  # noqa: E731
    key = F.linear(w(mix(module.time_mix_key)), w(module.key.weight), _bias(module.key, work_dtype))
    key = rules.identity_rule(key, torch.relu(key.detach()).square())
    value = F.linear(key, w(module.value.weight), _bias(module.value, work_dtype))
    receptance = F.linear(w(mix(module.time_mix_receptance)), w(module.receptance.weight),
                          _bias(module.receptance, work_dtype))
    return rules.sigmoid_gate(receptance, value)


def lfm_mlp(module, args, kwargs, output, work_dtype):
    """LFM2 / LFM3's gated MLP ``w2(silu(w1 x) ⊙ w3 x)``: identity and half rules."""
    x = _input(args, kwargs, "x").to(work_dtype)
    gate = F.linear(x, module.w1.weight.to(work_dtype), _bias(module.w1, work_dtype))
    up = F.linear(x, module.w3.weight.to(work_dtype), _bias(module.w3, work_dtype))
    return F.linear(rules.half_product(rules.silu_rule(gate), up), module.w2.weight.to(work_dtype),
                    _bias(module.w2, work_dtype))


def xlstm_feed_forward(module, args, kwargs, output, work_dtype):
    """xLSTM's gated feed-forward ``down(silu(gate) ⊙ z)`` (single or fused up-projections): identity and half
    rules."""
    x = _input(args, kwargs, "x").to(work_dtype)
    lin = lambda layer, t: F.linear(t, layer.weight.to(work_dtype), _bias(layer, work_dtype))  # noqa: E731
    if module.config.weight_mode == "single":
        gate, z = lin(module.proj_up_gate, x), lin(module.proj_up, x)
    else:
        gate, z = torch.tensor_split(lin(module.proj_up_gate_z, x), (module.up_proj_dim,), dim=-1)
    return lin(module.proj_down, rules.half_product(_activation_rule(module.act_fn, gate), z))


def signal_gate_input(module, args, kwargs, output, work_dtype):
    """The input of a sigmoid gate written inside another module's forward (Qwen3.5's and LFM3's gated attention:
    ``attn ⊙ σ(g)``), detached: the gate takes no relevance (``sigmoid_gates="signal"``; the half rule cannot be
    applied to an op no hook reaches)."""
    if rules.sigmoid_gate_rule() != "signal":
        raise NotImplementedError(f"mamba_captum: the sigmoid output gate of this attention ({type(module).__name__} "
                                  "feeds it) sits inside the attention's forward, where only sigmoid_gates='signal' "
                                  "can be applied.")
    return output.detach().to(work_dtype)


def _bias(linear, dtype):
    return None if linear.bias is None else linear.bias.to(dtype)


def experts(module, args, kwargs, output, work_dtype):
    """Stacked experts ``Σ_k w_k · down_e(act(gate_e(x)) ⊙ up_e(x))`` over the top-k experts e of each token
    (transformers 5's expert modules: ``gate_up_proj`` (E, 2I, D), ``down_proj`` (E, D, I)): the routing weights
    w_k detached (the router takes no relevance, like a softmax), each expert a gated MLP (identity and half
    rules)."""
    def inner(x, expert):
        gate, up = F.linear(x, module.gate_up_proj[expert].to(work_dtype)).chunk(2, dim=-1)
        return rules.half_product(_activation_rule(module.act_fn, gate), up)

    return _stacked_experts(module, args, kwargs, work_dtype, inner)


def _stacked_experts(module, args, kwargs, work_dtype, inner):
    """``Σ_k w_k · down_e(inner(x, e))`` over the top-k experts e of each token, the routing weights w_k detached: the
    stacked-expert layout of transformers 5 (``down_proj`` (E, D, I)). ``inner(x, e)``: expert e's rule up to its
    down projection, (T_e, D) -> (T_e, I). (T, D)."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[n] for n in names[len(args):]]
    hidden, index, weights = values[:3]
    x = hidden.to(work_dtype)
    out = torch.zeros_like(x)
    for expert in range(module.num_experts):
        tokens, slot = torch.where(index == expert)
        if tokens.numel() == 0:
            continue
        y = F.linear(inner(x[tokens], expert), module.down_proj[expert].to(work_dtype))
        out = out.index_add(0, tokens, y * weights[tokens, slot, None].detach().to(work_dtype))
    return out


def ungated_experts(module, args, kwargs, output, work_dtype):
    """Stacked ungated experts ``Σ_k w_k · down_e(act(up_e(x)))`` (NemotronH's: ``up_proj`` (E, I, D), ``down_proj``
    (E, D, I), ReLU²): the routing weights w_k detached, the activation by the identity rule. (T, D)."""
    return _stacked_experts(module, args, kwargs, work_dtype, lambda x, expert: _activation_rule(
        module.act_fn, F.linear(x, module.up_proj[expert].to(work_dtype))))


def _check_ungated_experts(module) -> str | None:
    """Why the ungated-experts rule does not fit ``module`` (None when it does)."""
    up, down = getattr(module, "up_proj", None), getattr(module, "down_proj", None)
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in (up, down)):
        return "no 3-D up_proj / down_proj weights"
    if any(getattr(module, name, None) is not None for name in ("up_proj_bias", "down_proj_bias")):
        return "expert biases"
    if getattr(module, "is_transposed", False) or up.shape[1] != down.shape[2] or up.shape[2] != down.shape[1]:
        return "an unexpected expert layout"
    return None


def _clamp_rule(x, low, high):
    """``clamp(x, low, high)`` by the identity rule (``x · (clamp(x) / x)̄``): all of the output's relevance to x."""
    with torch.no_grad():
        clamped = x.clamp(min=low, max=high)
    return rules.identity_rule(x, clamped)


def _clamped_swiglu(gate, up, limit):
    """GLM-5-next's ``silu(clamp(gate, max=c)) ⊙ clamp(up, −c, c)``: the clamps and SiLU by the identity rule, the
    product by the half rule."""
    gate = rules.silu_rule(_clamp_rule(gate, None, limit))
    return rules.half_product(gate, _clamp_rule(up, -limit, limit))


def clamped_glu_mlp(module, args, kwargs, output, work_dtype):
    """GLM-5-next's gated MLP ``down(silu(clamp(gate x, max=c)) ⊙ clamp(up x, −c, c))`` (c = ``swiglu_limit``): the
    clamps by the identity rule (a clamp is an activation: where it cuts, its ratio c / x carries the value), SiLU by
    the identity rule, the product by the half rule."""
    x = _input(args, kwargs, "x").to(work_dtype)
    gate = F.linear(x, module.gate_proj.weight.to(work_dtype), _bias(module.gate_proj, work_dtype))
    up = F.linear(x, module.up_proj.weight.to(work_dtype), _bias(module.up_proj, work_dtype))
    inner = _clamped_swiglu(gate, up, module.swiglu_limit)
    return F.linear(inner, module.down_proj.weight.to(work_dtype), _bias(module.down_proj, work_dtype))


def clamped_experts(module, args, kwargs, output, work_dtype):
    """GLM-5-next's stacked experts ``Σ_k w_k · down_e(silu(clamp(g)) ⊙ clamp(u))``, ``g, u = gate_up_e(x)``: the
    routing weights detached, each expert as :func:`clamped_glu_mlp`. (T, D)."""
    def inner(x, expert):
        gate, up = F.linear(x, module.gate_up_proj[expert].to(work_dtype)).chunk(2, dim=-1)
        return _clamped_swiglu(gate, up, module.swiglu_limit)

    return _stacked_experts(module, args, kwargs, work_dtype, inner)


def hyper_connection(module, args, kwargs, output, work_dtype):
    """A manifold-constrained hyper-connection (GLM-5-next) ``(post, comb, Σ_n pre_n h_n)`` of the streams h
    (B, L, N, D): its mixing weights pre, post and comb (sigmoids and a Sinkhorn-normalised softmax of a projection
    of the normalised streams) are a data-dependent linear map, detached like a scan's selection: the collapse is
    linear in h, post and comb (returned detached) make the decoder layer's ``post ⊗ out + combᵀ h`` linear in the
    block's output and the streams."""
    streams = _input(args, kwargs, "hidden_streams")
    with torch.no_grad():
        # post and comb as the module gives them (its forward without the hooks: the rule replaces its outputs), pre
        # as it computes it inside
        post, comb, _ = type(module).forward(module, streams.detach())
        hc = module.hc_mult
        flat = module.input_norm(streams.detach().reshape(*streams.shape[:2], -1).float())
        pre_w = F.linear(flat, module.fn.float())[..., :hc]
        pre = torch.sigmoid(pre_w * module.scale[0] + module.base[:hc]) + module.hc_eps
    collapsed = (pre.to(work_dtype).unsqueeze(-1) * streams.to(work_dtype)).sum(dim=2)
    return post.to(work_dtype), comb.to(work_dtype), collapsed


def gated_residual(module, args, kwargs, output, work_dtype):
    """Qwen4-exp's gated residual over its hyper-connection streams h (B, L, N·D): ``mixed = mean_n(w_n ⊙ ĥ_n)``,
    ĥ the grouped RMS norm of h and w = σ(up(silu(down(ĥ) / N))) a data-dependent gate, and (with a block after it)
    ``(mixed, h, 2σ(inject(ĥ) / N))``. The gate w and the injection weights are a data-dependent linear map, detached
    like a scan's selection (the decoder layer's ``h + out ⊗ inject`` is then linear); the norm's normaliser
    detached; h passed on as it is."""
    streams = _input(args, kwargs, "hyper_input")
    x = streams.to(work_dtype)
    count, width = module.hc_count, module.hidden_size
    with torch.no_grad():  # the normalised streams, the gate and the injection weights, as the module computes them
        normed = module.hc_norm(streams.detach())
        gate = torch.sigmoid(module.input_mix_weight_up(F.silu(module.input_mix_weight_down(normed) / count)))
        inject = None if module.block_inject_weight is None else \
            2 * torch.sigmoid(module.block_inject_weight(normed) / count)
    normed_rule = rules.rms_norm_rule(x, normed.to(work_dtype))  # x · (ĥ / x)̄, per element
    mixed = (gate.to(work_dtype).unflatten(-1, (count, width)) * normed_rule.unflatten(-1, (count, width))).mean(-2)
    if inject is None:
        return mixed
    # h as a tensor of its own: the ledger reads the relevance that reaches it from downstream only
    return mixed, x.view_as(x), inject.to(work_dtype)


def inkling_mlp(module, args, kwargs, output, work_dtype):
    """Inkling's gated MLP ``down(act(gate x) ⊙ up x) · s`` (s a learned scalar): :func:`glu_mlp`, times s."""
    return glu_mlp(module, args, kwargs, output, work_dtype) * module.global_scale.to(work_dtype)


def inkling_shared_experts(module, args, kwargs, output, work_dtype):
    """Inkling's shared experts ``Σ_s γ_s · down_s(act(gate_s x) ⊙ up_s x)`` (stacked weights (S, I, D) / (S, D, I),
    γ the router's per-token weights): γ detached (the router takes no relevance), each expert a gated MLP (identity
    and half rules)."""
    hidden = _input(args, kwargs)
    gammas = args[1] if len(args) > 1 else kwargs["gammas"]
    x = hidden.reshape(-1, hidden.shape[-1]).to(work_dtype)
    weights = gammas.reshape(-1, module.n_shared_experts).detach().to(work_dtype)
    out = torch.zeros_like(x)
    for shared in range(module.n_shared_experts):
        gate = F.linear(x, module.gate_proj[shared].to(work_dtype))
        up = F.linear(x, module.up_proj[shared].to(work_dtype))
        inner = rules.half_product(_activation_rule(module.act_fn, gate), up) * weights[:, shared, None]
        out = out + F.linear(inner, module.down_proj[shared].to(work_dtype))
    return out.view(hidden.shape)


def block_attention_residual(module, args, kwargs, output, work_dtype):
    """Inkling2's attention residual over depth: at each token, ``Σ_n P_{q,n} · ĥ_n`` over the earlier blocks' states
    and the current one h_n (stacked, (B, L, N, D)), ĥ their unweighted RMS norm and P a softmax of a learned query
    against ĥ (over the layers, not the tokens): P detached (a softmax, as in every attention layer) and the norm's
    normaliser detached, so linear in the states. One output per query (a tuple when there are several)."""
    names = ("block_states", "partial_block_states")
    blocks, partial = (args[i] if len(args) > i else kwargs[name] for i, name in enumerate(names))
    stacked = torch.cat([blocks.to(work_dtype), partial.to(work_dtype).unsqueeze(-2)], dim=-2)
    with torch.no_grad():  # ĥ and P as the module computes them (float32)
        normed = module.norm(stacked.detach().float())
        width = normed.shape[-1]
        query = module.query.float().view(-1, width)
        probs = torch.softmax(torch.einsum("qd,blnd->blqn", query, normed) * width ** -0.5, dim=-1)
    normed_rule = rules.rms_norm_rule(stacked, normed.to(work_dtype))
    mixed = torch.einsum("blqn,blnd->blqd", probs.to(work_dtype), normed_rule)
    # one tensor per query, each its own view (not unbind's: a multi-output node hands None to the hooks of the
    # outputs no gradient reaches, such as a full layer's query and key inputs)
    outs = tuple(mixed.select(-2, index) for index in range(mixed.shape[-2]))
    return outs if len(outs) > 1 else outs[0]


def message_attention_residual(module, args, kwargs, output, work_dtype):
    """Inkling2-Loop's message retrieval: at each token, ``Σ_n P_{q,n} · ĥ_n`` over the previous pass's block states
    (a softmax over layers of the loop layer's four learned queries, P detached; ĥ their unweighted RMS norm, its
    normaliser detached): linear in the states. (B, L, 4, D)."""
    names = ("block_states", "partial_block_states", "loop_layer_idx")
    blocks, partial, layer = (args[i] if len(args) > i else kwargs[name] for i, name in enumerate(names))
    stacked = torch.cat([blocks.to(work_dtype), partial.to(work_dtype).unsqueeze(-2)], dim=-2)
    with torch.no_grad():
        normed = module.norm(stacked.detach().float())
        width = normed.shape[-1]
        probs = torch.softmax(torch.einsum("qd,blnd->blqn", module.query[layer].float(), normed) * width ** -0.5, -1)
    return torch.einsum("blqn,blnd->blqd", probs.to(work_dtype), rules.rms_norm_rule(stacked, normed.to(work_dtype)))


def message_gate(module, args, kwargs, output, work_dtype):
    """Inkling2-Loop's message gate ``(1 − f) ⊙ h + g ⊙ message``, f and g tanh gates of a projection of both
    (normalised): a data-dependent mix, its gates detached (like a scan's selection): linear in h and the message."""
    names = ("hidden_states", "message")
    hidden, message = (args[i] if len(args) > i else kwargs[name] for i, name in enumerate(names))
    with torch.no_grad():
        h, m = hidden.detach().float(), message.detach().float()
        low = module.down_proj(torch.cat([module.norm(h), module.norm(m)], dim=-1).to(module.down_proj.weight.dtype))
        forget = torch.tanh(module.forget_gate_proj(low.float())).to(work_dtype)
        gate = torch.tanh(module.message_gate_proj(low.float())).to(work_dtype)
    return (1 - forget) * hidden.to(work_dtype) + gate * message.to(work_dtype)


def softcapped_experts(module, args, kwargs, output, work_dtype):
    """Inkling2's experts ``Σ_k w_k · down_e(a(g) ⊙ c_u(u))``, ``g, u = gate_up_e(x)``, a(g) = c_g(g)·σ(g) and c the
    soft caps ``c·tanh(·/c)``: the routing weights detached, a and c_u each by the identity rule (an activation of
    one input), their product by the half rule."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs[n] for n in names[len(args):]]
    hidden, index, weights = values[:3]
    act = module.act_fn
    x = hidden.to(work_dtype)
    out = torch.zeros_like(x)
    for expert in range(module.num_experts):
        tokens, slot = torch.where(index == expert)
        if tokens.numel() == 0:
            continue
        gate, up = F.linear(x[tokens], module.gate_up_proj[expert].to(work_dtype)).chunk(2, dim=-1)
        with torch.no_grad():
            gated = act.gate_softcap(gate) * torch.sigmoid(gate)
            capped = act.up_softcap(up)
        inner = rules.half_product(rules.identity_rule(gate, gated), rules.identity_rule(up, capped))
        y = F.linear(inner, module.down_proj[expert].to(work_dtype))
        out = out.index_add(0, tokens, y * weights[tokens, slot, None].detach().to(work_dtype))
    return out


def _check_experts(module) -> str | None:
    """Why the stacked-experts rule does not fit ``module`` (None when it does)."""
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(module, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            return f"no 3-D {name} weight"
    if any(getattr(module, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")):
        return "expert biases"
    if getattr(module, "is_transposed", False) or not getattr(module, "has_gate", True):
        return "a transposed or ungated expert layout"
    if module.gate_up_proj.shape[-1] != module.down_proj.shape[-2]:
        return "an unexpected expert layout"
    return None


# model classes whose forward soft-caps the head's logits (PlannedRule.soft_cap): the config attribute of the cap
SOFT_CAPPED_HEADS = {"RecurrentGemmaForCausalLM": "logits_soft_cap", "xLSTMForCausalLM": "output_logit_soft_cap",
                     "Inkling2ForCausalLM": "final_logit_softcapping",
                     "Inkling2LoopForCausalLM": "final_logit_softcapping"}
# the module that computes such a cap, where the model has one (its output is the one PlannedRule.soft_cap replaces)
SOFT_CAP_MODULES = {"Inkling2ForCausalLM": "logit_softcap", "Inkling2LoopForCausalLM": "logit_softcap"}

RULES = {
    "JambaMLP": glu_mlp, "JambaExperts": experts,
    "BambaMLP": glu_mlp,
    "NemotronHMLP": plain_mlp, "NemotronHExperts": ungated_experts,
    "FalconH1MLP": falcon_h1_mlp,
    "GraniteMoeHybridMLP": chunked_glu_mlp, "GraniteMoeHybridExperts": experts,
    "Zamba2MLP": zamba2_mlp,
    "RwkvFeedForward": rwkv_channel_mixing,
    "RecurrentGemmaMlp": glu_mlp,
    "Qwen3_5MLP": glu_mlp, "OlmoHybridMLP": glu_mlp,
    "Lfm2MLP": lfm_mlp, "Lfm3MLP": lfm_mlp,
    "MiniMaxExperts": experts,
    "xLSTMFeedForward": xlstm_feed_forward,
    "Qwen3NextMLP": glu_mlp, "Qwen3NextExperts": experts,
    "Qwen3_5MoeMLP": glu_mlp, "Qwen3_5MoeExperts": experts,
    "Lfm2MoeMLP": lfm_mlp, "Lfm2MoeExperts": experts,
    "LaraMiniMLP": glu_mlp, "LaraMiniExperts": experts,
    "KimiLinearMLP": glu_mlp, "KimiLinearExperts": experts,
    "BailingHybridMLP": glu_mlp, "BailingHybridExperts": experts,
    "ZambaMLP": glu_mlp,
    "Glm5NextTextMLP": clamped_glu_mlp, "Glm5NextTextExperts": clamped_experts,
    "Glm5NextTextHyperConnection": hyper_connection,
    "Qwen4ExpTextMLP": glu_mlp, "Qwen4ExpTextExperts": experts, "Qwen4ExpTextGatedResidual": gated_residual,
    "ZayaExperts": experts,
    "InklingMLP": inkling_mlp, "InklingExperts": experts, "InklingSharedExperts": inkling_shared_experts,
    **{f"{prefix}BlockAttentionResidual": block_attention_residual for prefix in ("Inkling2", "Inkling2Loop")},
    **{f"{prefix}Experts": softcapped_experts for prefix in ("Inkling2", "Inkling2Loop")},
    "Inkling2LoopMessageAttentionResidual": message_attention_residual, "Inkling2LoopMessageGate": message_gate,
}

# flash-linear-attention's modules (by class name, defined in fla.*)
FLA_RULES = {"RMSNorm": fla_rms_norm, "GatedMLP": fla_gated_mlp}

# (container class, child attribute): a child whose output only feeds a sigmoid gate (and the softmax's detached
# queries) inside the container's own forward; planned with :func:`signal_gate_input`
SIGNAL_GATE_INPUTS = {("Qwen3_5Attention", "q_proj"), ("Lfm3Attention", "g_proj"), ("Qwen3NextAttention", "q_proj"),
                      ("Qwen3NextSparseMoeBlock", "shared_expert_gate"), ("Qwen3_5MoeAttention", "q_proj"),
                      ("Qwen3_5MoeSparseMoeBlock", "shared_expert_gate"), ("BailingHybridAttention", "g_proj"),
                      ("Qwen4ExpTextAttention", "q_proj"), ("Qwen4ExpTextSparseMoeBlock", "shared_expert_gate")}


def rule_for(module: nn.Module):
    """The rule of a module, or None."""
    name = type(module).__name__
    if type(module).__module__.startswith("fla.") and name in FLA_RULES:  # fla's own RMSNorm, not torch's
        return FLA_RULES[name]
    if name in RULES:
        return RULES[name]
    if type(module).forward is nn.LayerNorm.forward:
        return layer_norm
    if name.endswith("RMSNorm") and "Gated" not in name and _single_input(module):
        return rms_norm
    return None


def _single_input(module) -> bool:
    import inspect

    parameters = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(parameters) == 1


def _is_linear(module) -> bool:
    if type(module) in (nn.Linear, nn.Embedding, nn.Identity, nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.Conv1d,
                        nn.Conv2d):
        return True
    return isinstance(module, nn.modules.dropout._DropoutNd)


@dataclass(eq=False)
class PlannedRule:
    """One module whose output is replaced: ``rule`` (None for a token mixer, whose adapter gives it) at ``path``."""

    module: nn.Module
    path: str
    rule: object = None
    located: object = None  # the LocatedMixer of a token mixer
    # a model whose forward soft-caps its head's logits z, s = c · tanh(z / c), an op no hook reaches: its output's
    # logits are replaced by the identity rule z · (s / z)̄ (same value), z recorded at ``head`` during the call
    soft_cap: float | None = None
    head: nn.Module | None = None
    # a module upstream of the relevance leaf (a vision-language model's vision tower): its output reaches the
    # explained score only through ``feeds``'s ``inputs_embeds``, which become the leaf; it runs without a graph
    feeds: nn.Module | None = None


def lrp_plan(model: nn.Module, mixers) -> list[PlannedRule]:
    """The modules whose outputs MambaLRP replaces, in module order.

    Raises:
        NotImplementedError: a module without a rule whose forward is not known to be linear (named, with the model
            type), or a token mixer whose family has no LRP rules yet.
    """
    by_module = {id(m.module): m for m in mixers}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for located in mixers:  # a token mixer without rules is the most telling refusal: name its family's reason
        if located.adapter.lrp is None:
            raise NotImplementedError(
                f"mamba_captum: MambaLRP has no rules for the token mixer {type(located.module).__name__} "
                f"({located.name}{f', model type {model_type!r}' if model_type else ''}) yet: "
                f"{located.adapter.LRP_UNSUPPORTED}.")
        refusal = located.adapter.lrp_refusal(located.module) if located.adapter.lrp_refusal else None
        if refusal:
            raise NotImplementedError(f"mamba_captum: {refusal}")
    planned: list[PlannedRule] = []
    seen: set[int] = set()  # a module shared by several layers (Zamba2's shared block) is planned once

    def visit(module, path):
        if id(module) in seen:
            return
        seen.add(id(module))
        located = by_module.get(id(module))
        if located is not None:
            planned.append(PlannedRule(module, path, located=located))
            return
        rule = rule_for(module)
        if rule is experts and _check_experts(module) is not None:
            raise NotImplementedError(f"mamba_captum: MambaLRP's experts rule does not fit {type(module).__name__} "
                                      f"({path}): {_check_experts(module)}.")
        if rule is ungated_experts and _check_ungated_experts(module) is not None:
            raise NotImplementedError(f"mamba_captum: MambaLRP's ungated-experts rule does not fit "
                                      f"{type(module).__name__} ({path}): {_check_ungated_experts(module)}.")
        if rule is fla_gated_mlp and module.hidden_act != "swish":
            raise NotImplementedError(f"mamba_captum: MambaLRP has no rule for fla's GatedMLP ({path}) with "
                                      f"hidden_act {module.hidden_act!r}.")
        if rule is not None:
            planned.append(PlannedRule(module, path, rule))
            return
        name = type(module).__name__
        if name.endswith(NO_RELEVANCE_PATH_SUFFIXES) or name in NO_RELEVANCE_PATH:
            return
        qualified = f"{type(module).__module__}.{type(module).__qualname__}"
        if not (_is_linear(module) or name in LINEAR_CONTAINERS or qualified in LINEAR_CONTAINER_PATHS):
            raise NotImplementedError(
                f"mamba_captum: MambaLRP has no rule for {name} ({path or 'the model'}"
                f"{f', model type {model_type!r}' if model_type else ''}): its forward is not known to be linear, so "
                "the relevance would not be conserved through it. The covered models are listed in "
                "docs/methods/lrp.md.")
        for attribute, why in FLA_REFUSED.items():
            if getattr(module, attribute, False) is True:
                raise NotImplementedError(
                    f"mamba_captum: MambaLRP cannot explain {name} ({path or 'the model'}"
                    f"{f', model type {model_type!r}' if model_type else ''}): {why}.")
        cap_name = SOFT_CAPPED_HEADS.get(name)
        if cap_name and getattr(module.config, cap_name, None):
            planned.append(PlannedRule(module, path, soft_cap=float(getattr(module.config, cap_name)),
                                       head=module.get_output_embeddings()))
        language, upstream = VISION_LANGUAGE.get(name, (None, ()))
        for child_name, child in module.named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            if SOFT_CAP_MODULES.get(name) == child_name:  # the head's cap: replaced at the model's output
                seen.add(id(child))
                continue
            if child_name in upstream and id(child) not in seen:
                seen.add(id(child))
                planned.append(PlannedRule(child, child_path, feeds=getattr(module, language)))
                continue
            if (name, child_name) in SIGNAL_GATE_INPUTS and id(child) not in seen:
                seen.add(id(child))
                planned.append(PlannedRule(child, child_path, signal_gate_input))
                continue
            visit(child, child_path)

    visit(model, "")
    return planned
