"""Benchmark: RWKV-4 and Griffin on CPU — the model's own forward, the maps, and the Captum classes.

RWKV "430m": the RWKV-4-Pile-430M shape (hidden 1024, 24 layers, vocab 50277), random weights, fp32, batch 1.
Griffin "small": a RecurrentGemma of hidden 1024, 12 layers (recurrent, recurrent, attention), random weights.
One process, one model load, each measurement once after a warm-up forward (the machine is noisy: ±30 %). The last
column divides each step by one forward + backward run through the library's fast scans (``mc.fast_scans``), the
yardstick, timed best of 3.

Run:  python benchmarks/bench_recurrent.py [--models rwkv430m griffin] [--length 512]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import transformers as tf

import mamba_captum as mc

MODELS = {
    "rwkv430m": lambda: tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=50277, hidden_size=1024, num_hidden_layers=24,
                                                         attention_hidden_size=1024, intermediate_size=4096,
                                                         context_length=1024)),
    "griffin": lambda: tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        vocab_size=32000, hidden_size=1024, lru_width=1024, num_hidden_layers=12, num_attention_heads=8,
        num_key_value_heads=1, head_dim=128, intermediate_size=3072, attention_window_size=2048)),
}


def timed(label, fn, rows, repeats=1):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    rows.append((label, min(times)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args()
    tf.logging.set_verbosity_error()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, L = {args.length}, batch 1, fp32")
    print("| model | params | step | seconds | / fast fwd + bwd |")
    print("|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        model = MODELS[name]().eval()
        params = sum(p.numel() for p in model.parameters())
        ids = torch.randint(3, model.config.vocab_size, (1, args.length))
        rows = []
        with torch.no_grad():
            model(ids, use_cache=False)  # warm-up (and RWKV's own first-forward rescaling)
            timed("HF forward (no grad)", lambda: model(ids, use_cache=False), rows)
        timed("HF forward + backward of one logit",
              lambda: model(ids, use_cache=False).logits[0, -1, 7].backward(), rows)

        def fast_forward_backward():
            with mc.fast_scans(model):
                model(ids, use_cache=False).logits[0, -1, 7].backward()

        timed("forward + backward of one logit, mc.fast_scans", fast_forward_backward, rows, repeats=3)
        model.zero_grad(set_to_none=True)
        timed("implicit_attention (all layers, mean maps)", lambda: mc.implicit_attention(model, ids), rows)
        timed("MambaRawAttention", lambda: mc.MambaRawAttention(model).attribute(ids), rows)
        timed("MambaRollout", lambda: mc.MambaRollout(model).attribute(ids), rows)
        attribution = mc.RWKVAttribution if name.startswith("rwkv") else mc.MambaAttribution
        label = attribution.__name__
        timed(f"{label} (grad_x_operator)", lambda: attribution(model).attribute(ids, target=7), rows)
        timed(f"{label} (residual)", lambda: attribution(model).attribute(ids, target=7, gradient_rule="residual"),
              rows)
        timed(f"{label} (official recipe)", lambda: attribution(model).attribute(ids, target=7, recipe="official"),
              rows)
        fast = dict(rows)["forward + backward of one logit, mc.fast_scans"]
        for label, seconds in rows:
            print(f"| {name} | {params / 1e6:.0f}M | {label} | {seconds:.1f} | {seconds / fast:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
