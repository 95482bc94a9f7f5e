"""Benchmark: wall time of MambaRawAttention, MambaRollout, MambaAttribution (its default, recipe="auto": the
magnitude of MambaLRP's relevance here; and the product recipe with both gradient rules), MambaLRP,
MambaSelectionAttribution, one forward + backward on the fast scans (the reference cost, "fwd_bwd") and Captum's
LayerIntegratedGradients (embeddings, n_steps=50) on the same random Mamba model, batch 1, fp32, CPU.

Configs: "130m" (the mamba-130m shape: d_model 768, 24 layers, vocab 50280), "10m" (d_model 256, 12 layers,
vocab 16384: ~9.7M parameters) and "mamba2-130m" (a Mamba-2 of the mamba2-130m shape). Each (config, L, method) runs in a fresh subprocess with a time budget; a run that
exceeds it is reported as "> budget" (HF's torch Mamba-1 scan is a Python loop over tokens whose backward grows
faster than L², so gradient methods on long inputs take minutes).

Run:  python benchmarks/bench_attribution.py [--configs 10m 130m] [--lengths 128 512 1024] [--budget 300]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

METHODS = ("raw", "rollout", "attribution", "attribution_product", "attribution_residual", "lrp", "selection",
           "fwd_bwd", "lig")
CONFIGS = {
    "130m": dict(hidden_size=768, num_hidden_layers=24, vocab_size=50280, state_size=16, expand=2, conv_kernel=4),
    "10m": dict(hidden_size=256, num_hidden_layers=12, vocab_size=16384, state_size=16, expand=2, conv_kernel=4),
    # a Mamba2ForCausalLM of the mamba2-130m shape (as bench_implicit_attention.py's)
    "mamba2-130m": dict(hidden_size=768, num_hidden_layers=24, vocab_size=50280, state_size=128, expand=2,
                        head_dim=64, num_heads=24, n_groups=1, conv_kernel=4, chunk_size=256),
}


def measure(config_name: str, length: int, method: str) -> dict:
    import torch
    import transformers as tf

    import mamba_captum as mc

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if config_name.startswith("mamba2"):
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(**CONFIGS[config_name])).eval()
    else:
        model = tf.MambaForCausalLM(tf.MambaConfig(**CONFIGS[config_name])).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, length))
    target = 7
    start = time.perf_counter()
    if method == "raw":
        mc.MambaRawAttention(model).attribute(ids)
    elif method == "rollout":
        mc.MambaRollout(model).attribute(ids)
    elif method == "attribution":
        mc.MambaAttribution(model).attribute(ids, target=target)
    elif method == "attribution_product":
        mc.MambaAttribution(model).attribute(ids, target=target, recipe="product")
    elif method == "lrp":
        mc.MambaLRP(model).attribute(ids, target=target)
    elif method == "attribution_residual":
        mc.MambaAttribution(model).attribute(ids, target=target, gradient_rule="residual")
    elif method == "selection":
        mc.MambaSelectionAttribution(model).attribute(ids, target=target)
    elif method == "fwd_bwd":  # the reference cost: one forward + backward of the target logit on the fast scans
        with mc.fast_scans(model):
            model(ids, use_cache=False).logits[0, -1, target].backward()
    elif method == "lig":
        from captum.attr import LayerIntegratedGradients

        lig = LayerIntegratedGradients(lambda x: model(x, use_cache=False).logits[:, -1], model.backbone.embeddings)
        lig.attribute(ids, target=target, n_steps=50, internal_batch_size=10)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    return {"config": config_name, "length": length, "method": method, "seconds": seconds, "params": params}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["10m", "130m"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 1024])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--budget", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.child[2])))
        return
    import torch

    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, budget {args.budget:.0f} s per run")
    print("| config | L | method | seconds |")
    print("|---|---|---|---|")
    for config in args.configs:
        for length in args.lengths:
            for method in args.methods:
                command = [sys.executable, __file__, "--child", config, str(length), method]
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=args.budget, check=True)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    print(f"| {config} | {length} | {method} | {result['seconds']:.1f} |", flush=True)
                except subprocess.TimeoutExpired:
                    print(f"| {config} | {length} | {method} | > {args.budget:.0f} (budget) |", flush=True)


if __name__ == "__main__":
    main()
