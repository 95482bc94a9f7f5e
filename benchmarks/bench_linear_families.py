"""Benchmark: all layers' mean maps of the linear token mixers at 130M scale, next to one HF forward.

Configs (random weights, fp32, batch 1, CPU): a Qwen3-Next-style gated delta-net hybrid (d_model 768, 12 layers,
3 delta-rule layers per softmax layer, 16 value heads × 64, 8 key heads × 64, 8 experts top-2), an LFM2-style
short-conv hybrid (d_model 768, 16 layers, 10 conv + 6 attention) and an xLSTM (d_model 768, 12 blocks, 4 heads).
The maps come from the one forward the library runs (``implicit_attention(..., reduce="mean")``: every layer's
(B, L, L) map); "forward" is a plain ``model(ids)`` under no_grad. Each is the best of ``--repeats`` runs.

Run:  python benchmarks/bench_linear_families.py [--length 1024] [--repeats 2] [--families qwen3_next lfm2 xlstm]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import transformers as tf

import mamba_captum as mc

VOCAB = 8192


def qwen3_next():
    return tf.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        head_dim=64, intermediate_size=2048, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3)


def lfm2():
    return tf.Lfm2Config(
        vocab_size=VOCAB, hidden_size=768, num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=3072, conv_L_cache=3, block_auto_adjust_ff_dim=False,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                     "full_attention", "conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv"])


def xlstm():
    return tf.xLSTMConfig(vocab_size=VOCAB, hidden_size=768, num_hidden_layers=12, num_heads=4, chunk_size=64,
                          use_cache=False)


FAMILIES = {"qwen3_next": qwen3_next, "lfm2": lfm2, "xlstm": xlstm}


def best_of(repeats, fn):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, transformers {tf.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; L = {args.length}, batch 1, fp32")
    print(f"{'family':<12} {'params':>8} {'mixers':>7} {'forward s':>10} {'all maps s':>11} {'ratio':>6}")
    for family in args.families:
        config = FAMILIES[family]()
        config._experts_implementation = "eager"
        attention = "eager" if family == "xlstm" else "sdpa"
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        ids = torch.randint(3, VOCAB, (1, args.length))
        with torch.no_grad():
            forward = best_of(args.repeats, lambda: model(ids))
        maps = {}
        seconds = best_of(args.repeats, lambda: maps.update(mc.implicit_attention(model, ids, reduce="mean")))
        linear = sum(1 for op in mc.build_operators(model, ids[:, :8])[0].values()
                     if isinstance(op, mc.operators.HeadOperator))
        print(f"{family:<12} {params:>7.0f}M {linear:>7} {forward:>10.2f} {seconds:>11.2f} {seconds / forward:>6.1f}")


if __name__ == "__main__":
    main()
