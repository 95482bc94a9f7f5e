"""Tiny random transformers models of every supported family (fixed seed), for the tests and the examples."""
from __future__ import annotations

import torch
import transformers as tf

VOCAB = 64


def _common(**kw):
    return dict(vocab_size=VOCAB, hidden_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)


def _mamba2_hybrid(**kw):
    return dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                mamba_expand=2, mamba_chunk_size=8, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, **kw)


CONFIGS = {
    "mamba": lambda: tf.MambaConfig(**_common(num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
                                              time_step_rank=4)),
    "falcon_mamba": lambda: tf.FalconMambaConfig(**_common(num_hidden_layers=2, state_size=8, expand=2,
                                                           conv_kernel=4, time_step_rank=4)),
    "jamba": lambda: tf.JambaConfig(**_common(num_hidden_layers=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                              mamba_dt_rank=4, num_attention_heads=4, num_key_value_heads=2,
                                              intermediate_size=64, attn_layer_period=4, attn_layer_offset=2,
                                              expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                              num_experts_per_tok=1)),
    "mamba2": lambda: tf.Mamba2Config(**_common(num_hidden_layers=2, num_heads=4, head_dim=16, n_groups=2,
                                                state_size=8, expand=2, conv_kernel=4, chunk_size=8)),
    "bamba": lambda: tf.BambaConfig(**_common(num_hidden_layers=3, attn_layer_indices=[1], **_mamba2_hybrid())),
    "zamba2": lambda: tf.Zamba2Config(**_common(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
                                                mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2,
                                                mamba_headdim=16, n_mamba_heads=4, num_attention_heads=4,
                                                num_key_value_heads=4, attention_head_dim=16, intermediate_size=64,
                                                num_mem_blocks=1, chunk_size=8, use_mem_rope=True)),
    "nemotron_h": lambda: tf.NemotronHConfig(**_common(layers_block_type=["mamba", "mlp", "attention", "mamba"],
                                                       mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                                                       ssm_state_size=8, conv_kernel=4, expand=2, chunk_size=8,
                                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                       intermediate_size=64)),
    "falcon_h1": lambda: tf.FalconH1Config(**_common(num_hidden_layers=2, **_mamba2_hybrid(),
                                                     ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.05],
                                                     ssm_in_multiplier=1.3, ssm_out_multiplier=0.7, mamba_d_ssm=64,
                                                     attention_in_multiplier=1.1, attention_out_multiplier=0.6)),
    "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(**_common(
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=2,
        num_experts_per_tok=1, shared_intermediate_size=64, **_mamba2_hybrid())),
}
# Families whose mixers ignore attention_mask (right padding only): kept apart from CONFIGS, whose tests pad left.
RECURRENT_CONFIGS = {
    "rwkv": lambda: tf.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, attention_hidden_size=32,
                                  intermediate_size=64, context_length=64, rescale_every=2, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2),
    "recurrent_gemma": lambda: tf.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, lru_width=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, attention_window_size=6, conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2),
}


def _linear_hybrid(**kw):
    base = dict(intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    return {**base, **kw}


def _kda(**kw):
    kw.setdefault("layer_types", ["linear_attention", "full_attention"])
    kw.setdefault("num_experts", 2)
    return dict(intermediate_size=64, moe_intermediate_size=16, num_attention_heads=2, num_key_value_heads=2,
                linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4, mlp_layer_types=["dense", "sparse"],
                **kw)


def _text_config(model_type, name, **kw):
    module = __import__(f"transformers.models.{model_type}.configuration_{model_type}", fromlist=[name])
    return getattr(module, name)(**kw)


def _short_conv(**kw):
    kw.setdefault("layer_types", ["conv", "full_attention", "conv"])
    return dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3,
                block_auto_adjust_ff_dim=False, **kw)


# Linear token mixers (delta rule, KDA, short convs, lightning attention, mLSTM, conv-V attention): kept apart
# from CONFIGS, whose tests are written for the selective SSMs (tests/test_linear_families.py covers these).
LINEAR_CONFIGS = {
    "qwen3_next": lambda: tf.Qwen3NextConfig(**_common(num_hidden_layers=2, **_linear_hybrid(
        decoder_sparse_step=1, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
        num_experts_per_tok=1))),
    "qwen3_5": lambda: _text_config("qwen3_5", "Qwen3_5TextConfig", **_common(num_hidden_layers=2, **_linear_hybrid())),
    "qwen3_5_moe": lambda: _text_config("qwen3_5_moe", "Qwen3_5MoeTextConfig", **_common(
        num_hidden_layers=2, **_linear_hybrid(moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                              num_experts=2, num_experts_per_tok=1))),
    "qwen4_exp": lambda: _text_config("qwen4_exp", "Qwen4ExpTextConfig", **_common(num_hidden_layers=2, **_linear_hybrid(
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
        hc_count=2, hc_lowrank=8, ple_layer_ids=[], output_gate_type="sigmoid", indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
        layer_types=["linear_attention", "indexed_attention"]))),
    "olmo_hybrid": lambda: tf.OlmoHybridConfig(**_common(num_hidden_layers=2, **_linear_hybrid(
        num_key_value_heads=2, linear_allow_neg_eigval=True))),
    "kimi_linear": lambda: tf.KimiLinearConfig(**_common(num_hidden_layers=2, **_kda(
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
        num_shared_experts=1, num_expert_group=1, topk_group=1, num_experts_per_token=1))),
    "bailing_hybrid": lambda: tf.BailingHybridConfig(**_common(num_hidden_layers=2, **_kda(
        kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8, num_shared_experts=1,
        num_expert_group=1, topk_group=1, num_experts_per_token=1, first_k_dense_replace=1, head_dim=8,
        kda_safe_gate=True, kda_lower_bound=-5.0))),
    "glm5_next": lambda: _text_config("glm5_next", "Glm5NextTextConfig", **_common(num_hidden_layers=2, **_kda(
        n_shared_experts=1, n_routed_experts=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0,
        v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=1, index_topk=8,
        index_head_dim=8, index_n_heads=2, index_kpool=4, linear_lower_bound=-5.0, hc_mult=2,
        layer_types=["linear_attention", "indexed_attention"], indexer_types=["full", "full"]))),
    "minimax": lambda: tf.MiniMaxConfig(**_common(
        num_hidden_layers=3, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_local_experts=2, num_experts_per_tok=1, block_size=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"])),
    # use_cache=False: xLSTM's cache rounds its head sizes up to 64 and fails for a 32-wide model
    "xlstm": lambda: tf.xLSTMConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, chunk_size=8,
                                    use_cache=False, norm_reduction_force_float32=False, pad_token_id=0,
                                    bos_token_id=1, eos_token_id=2),
    "lfm2": lambda: tf.Lfm2Config(**_common(num_hidden_layers=3, **_short_conv())),
    "lfm2_moe": lambda: tf.Lfm2MoeConfig(**_common(num_hidden_layers=3, moe_intermediate_size=16, num_dense_layers=1,
                                                    num_experts=2, num_experts_per_tok=1, **_short_conv())),
    "lfm3": lambda: tf.Lfm3Config(**_common(num_hidden_layers=3, **_short_conv(
        head_dim=8, sliding_window=4, layer_types=["conv", "sliding_attention", "conv"]))),
}
if "lara_mini" in tf.models.auto.configuration_auto.CONFIG_MAPPING:  # transformers >= 5.24
    # the released layer pattern in small: the delta rule, a sliding-window layer with RoPE (a window shorter than the
    # tests' 12 tokens) and a global layer without positions; top-2 of 3 experts plus the ungated shared expert (the
    # config has no dense intermediate_size)
    LINEAR_CONFIGS["lara_mini"] = lambda: _text_config("lara_mini", "LaraMiniConfig", **_common(
        num_hidden_layers=3, **{key: value for key, value in _linear_hybrid(
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=3, num_experts_per_tok=2,
            sliding_window=4, layer_types=["linear_attention", "sliding_attention", "full_attention"]).items()
            if key != "intermediate_size"}))
# Zamba (v1): Mamba-1 heads with their own B, C, Δ (tests/test_zamba.py); kept apart from CONFIGS, whose tests are
# written for one B, C per layer. Two hybrid layers at least: HF's weight tying refuses exactly one.
ZAMBA_CONFIGS = {
    "zamba": lambda: tf.ZambaConfig(**_common(num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
                                              num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=8,
                                              mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
                                              layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])),
}
MAMBA1 = ("mamba", "falcon_mamba", "jamba")
MAMBA2 = ("mamba2", "bamba", "zamba2", "nemotron_h", "falcon_h1", "granitemoehybrid")


def make_model(family: str, dtype=torch.float32, seed: int = 0, attn_implementation: str = "eager", **overrides):
    """A tiny random causal LM of ``family`` in eval mode. Overrides are set on the config."""
    config = {**CONFIGS, **RECURRENT_CONFIGS, **LINEAR_CONFIGS, **ZAMBA_CONFIGS}[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = attn_implementation
    config._experts_implementation = "eager"  # grouped_mm has no float64
    torch.manual_seed(seed)
    try:
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError:  # a text model without a causal-LM class (glm5_next): the base model
        model = tf.AutoModel.from_config(config, dtype=dtype)
    return model.eval()


# A tiny Vision Mamba (mamba_captum.vision): 32×32 images, 8-pixel patches (a 4×4 grid + the CLS token: L = 17).
VIM = dict(depth=2, embed_dim=12, d_state=4, img_size=32, patch_size=8, num_classes=5)


def make_vim(seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random Vim in eval mode, its Δ, D and conv biases spread so that every factor of the operator matters
    (a random init leaves the gates and decays nearly uniform)."""
    from mamba_captum.vision import vim_tiny

    torch.manual_seed(seed)
    model = vim_tiny(**{**VIM, **overrides})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.layers:
            mixer = block.mixer
            mixer.in_proj.weight.mul_(4.0)
            for name in ("dt_proj", "dt_proj_b"):
                getattr(mixer, name).bias.uniform_(-2.0, 1.0, generator=generator)
            for parameter in (mixer.D, mixer.D_b, mixer.conv1d.bias, mixer.conv1d_b.bias):
                parameter.uniform_(-1.0, 1.0, generator=generator)
            block.norm.weight.uniform_(0.5, 1.5, generator=generator)
    return model.to(dtype).eval()
