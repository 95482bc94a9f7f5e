"""Benchmark: HF's torch scans vs mamba_captum's fast scans (forward + backward), per layer and per model.

Mamba-1 — per layer: one MambaMixer-sized scan (D = 1536, N = 16, batch 1) through ``mamba_selective_scan`` (HF)
and ``selective_scan_chunked``, forward then backward of a sum. Per model: a random mamba-130m config (24 layers),
forward + backward of one logit, HF's path (only at the lengths given to --hf-lengths) and inside
``mc.fast_scans(model)``; then ``MambaAttribution`` end to end (its forward runs on the fast scan), and Captum's
``LayerIntegratedGradients`` (embeddings, 50 steps, internal batch --ig-batch) inside ``mc.fast_scans(model)`` at the
lengths given to --ig-lengths.

RWKV-4 and Griffin, at --recurrent-length (512) — per layer: one WKV (C = 768) through HF's
``rwkv_linear_attention_cpu`` and ``wkv_scan_chunked``, one RG-LRU scan (C = 1024) through HF's
``RecurrentGemmaRglru._rnn_scan`` and ``rglru_scan_chunked``, forward then backward of a sum. Per model: random
RWKV-4-169M-shaped (hidden 768, 12 layers) and Griffin-130m-scale (hidden 768, LRU width 1024, 15 layers: 10
recurrent, 5 local attention; 136M) configs, forward + backward of one logit, HF's path and inside
``mc.fast_scans(model)``. Each the fastest of --repeats runs (the machine is shared and noisy), with the ratio.

Run:  python benchmarks/bench_scan.py [--families mamba rwkv griffin] [--lengths 128 512 1024] [--hf-lengths 128]
      [--ig-lengths 128 512] [--recurrent-length 512] [--repeats 3] [--threads N]
"""
from __future__ import annotations

import argparse
import contextlib
import platform
import time

import torch
import transformers as tf
import transformers.models.mamba.modeling_mamba as hf_mamba
import transformers.models.recurrent_gemma.modeling_recurrent_gemma as hf_griffin
import transformers.models.rwkv.modeling_rwkv as hf_rwkv
from captum.attr import LayerIntegratedGradients

import mamba_captum as mc
from mamba_captum.kernels.rglru_scan import rglru_scan_chunked
from mamba_captum.kernels.selective_scan import selective_scan_chunked
from mamba_captum.kernels.wkv_scan import wkv_scan_chunked
from bench_linear_families import best_of  # (this folder is on sys.path when a script of it runs)

RECURRENT_MODELS = {
    "rwkv": lambda: tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=50277, hidden_size=768, num_hidden_layers=12,
                                                     attention_hidden_size=768, intermediate_size=3072,
                                                     context_length=1024)),
    "griffin": lambda: tf.RecurrentGemmaForCausalLM(tf.RecurrentGemmaConfig(
        vocab_size=32000, hidden_size=768, lru_width=1024, num_hidden_layers=15, num_attention_heads=8,
        num_key_value_heads=1, head_dim=96, intermediate_size=4608, attention_window_size=2048)),
}


def layer_time(fn, length):
    g = torch.Generator().manual_seed(0)
    d, n = 1536, 16
    inputs = [torch.randn(1, d, length, generator=g).requires_grad_(), torch.randn(1, d, length, generator=g)
              .requires_grad_(), (-torch.rand(d, n, generator=g) * 3).requires_grad_(),
              torch.randn(1, n, length, generator=g).requires_grad_(), torch.randn(1, n, length, generator=g)
              .requires_grad_()]
    start = time.perf_counter()
    fn(*inputs, delta_softplus=True).sum().backward()
    return time.perf_counter() - start


def model_time(model, ids, fast):
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if fast:
        with mc.fast_scans(model):
            model(ids, use_cache=False).logits[0, -1, 7].backward()
    else:
        model(ids, use_cache=False).logits[0, -1, 7].backward()
    return time.perf_counter() - start


def fastest(fn, repeats):
    """The shortest of ``repeats`` timings of ``fn()``, in seconds."""
    return best_of(repeats, fn)


def one_recurrent_layer(family, length, fast):
    """Forward + backward of a sum through one layer-sized scan: RWKV's WKV (C = 768) or Griffin's RG-LRU (1024)."""
    g = torch.Generator().manual_seed(0)
    if family == "rwkv":
        inputs = [torch.randn(768, generator=g), torch.randn(768, generator=g),
                  torch.randn(1, length, 768, generator=g), torch.randn(1, length, 768, generator=g)]
        scan = wkv_scan_chunked if fast else hf_rwkv.rwkv_linear_attention_cpu
    else:
        inputs = [torch.randn(1, length, 1024, generator=g), torch.rand(1, length, 1024, generator=g)]
        reset = torch.zeros(1, length, 1, dtype=torch.bool)
        scan = rglru_scan_chunked if fast else \
            lambda x, a: hf_griffin.RecurrentGemmaRglru._rnn_scan(None, x, a, reset, None)
    inputs = [t.requires_grad_() for t in inputs]
    return lambda: scan(*inputs)[0].sum().backward()


def recurrent_rows(family, length, repeats):
    label = {"rwkv": "RWKV-4 169M config", "griffin": "Griffin 136M config"}[family]
    scan = {"rwkv": "one WKV (C = 768)", "griffin": "one RG-LRU scan (C = 1024)"}[family]
    rows = [(f"{scan}, fwd + bwd", *(fastest(one_recurrent_layer(family, length, fast), repeats)
                                    for fast in (False, True)))]
    torch.manual_seed(0)
    model = RECURRENT_MODELS[family]().eval()
    ids = torch.randint(3, model.config.vocab_size, (1, length))
    with torch.no_grad():
        model(ids, use_cache=False)  # warm-up (and RWKV's own first-forward rescaling)
    rows.append(("model fwd + bwd of one logit", *(fastest(lambda: model_time(model, ids, fast), repeats)
                                                   for fast in (False, True))))
    rows.append(("model forward, no grad (for scale)", *(fastest(lambda: forward_time(model, ids, fast), repeats)
                                                         for fast in (False, True))))
    for what, hf, fast in rows:
        print(f"| {label} | {length} | {what} | {hf:.3g} | {fast:.3g} | {hf / fast:.1f}x |", flush=True)


def forward_time(model, ids, fast):
    with torch.no_grad(), (mc.fast_scans(model) if fast else contextlib.nullcontext()):
        model(ids, use_cache=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="+", default=["mamba", "rwkv", "griffin"],
                        choices=["mamba", "rwkv", "griffin"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 1024])
    parser.add_argument("--hf-lengths", nargs="*", type=int, default=[128])
    parser.add_argument("--hf-layer-lengths", nargs="*", type=int, default=[128, 512])
    parser.add_argument("--ig-lengths", nargs="*", type=int, default=[128, 512])
    parser.add_argument("--ig-batch", type=int, default=2, help="IG's internal_batch_size (10 at L = 512: > 24 GB)")
    parser.add_argument("--recurrent-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="RWKV / Griffin rows: the fastest of this many runs")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    tf.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, batch 1, fp32")
    if "mamba" in args.families:
        mamba_rows(args)
    recurrent = [family for family in args.families if family != "mamba"]
    if recurrent:
        print("\n| model | L | what | HF path (s) | fast scans (s) | HF / fast |")
        print("|---|---|---|---|---|---|")
        for family in recurrent:
            recurrent_rows(family, args.recurrent_length, args.repeats)


def mamba_rows(args):
    print("| what | L | HF torch path (s) | fast scan (s) |")
    print("|---|---|---|---|")
    for length in args.lengths:
        hf = f"{layer_time(hf_mamba.mamba_selective_scan, length):.2f}" if length in args.hf_layer_lengths else "—"
        print(f"| one 130m-sized scan, fwd + bwd | {length} | {hf} | {layer_time(selective_scan_chunked, length):.2f} |",
              flush=True)
    torch.manual_seed(0)
    model = tf.MambaForCausalLM(tf.MambaConfig(hidden_size=768, num_hidden_layers=24, vocab_size=50280,
                                               state_size=16, expand=2, conv_kernel=4)).eval()
    for length in args.lengths:
        ids = torch.randint(3, 50280, (1, length))
        hf = f"{model_time(model, ids, False):.1f}" if length in args.hf_lengths else "—"
        print(f"| mamba-130m config, fwd + bwd of one logit | {length} | {hf} | {model_time(model, ids, True):.1f} |",
              flush=True)
        start = time.perf_counter()
        mc.MambaAttribution(model).attribute(ids, target=7)
        print(f"| MambaAttribution (default rule), end to end | {length} | — | {time.perf_counter() - start:.1f} |",
              flush=True)
        if length in args.ig_lengths:
            lig = LayerIntegratedGradients(lambda x: model(x, use_cache=False).logits[:, -1],
                                           model.backbone.embeddings)
            start = time.perf_counter()
            with mc.fast_scans(model):
                lig.attribute(ids, target=7, n_steps=50, internal_batch_size=args.ig_batch)
            print(f"| Captum LayerIntegratedGradients, 50 steps | {length} | — | {time.perf_counter() - start:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
