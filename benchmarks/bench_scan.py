"""Benchmark: HF's Mamba-1 torch scan vs mamba_captum's fast scan (forward + backward), per layer and per model.

Per layer: one MambaMixer-sized scan (D = 1536, N = 16, batch 1) through ``mamba_selective_scan`` (HF) and
``selective_scan_chunked``, forward then backward of a sum. Per model: a random mamba-130m config (24 layers),
forward + backward of one logit, HF's path (only at the lengths given to --hf-lengths) and inside
``mc.fast_scans(model)``; then ``MambaAttribution`` end to end (its forward runs on the fast scan), and Captum's
``LayerIntegratedGradients`` (embeddings, 50 steps, internal batch --ig-batch) inside ``mc.fast_scans(model)`` at the
lengths given to --ig-lengths.

Run:  python benchmarks/bench_scan.py [--lengths 128 512 1024] [--hf-lengths 128] [--ig-lengths 128 512]
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import transformers as tf
import transformers.models.mamba.modeling_mamba as hf_mamba
from captum.attr import LayerIntegratedGradients

import mamba_captum as mc
from mamba_captum.kernels.selective_scan import selective_scan_chunked


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 1024])
    parser.add_argument("--hf-lengths", nargs="*", type=int, default=[128])
    parser.add_argument("--hf-layer-lengths", nargs="*", type=int, default=[128, 512])
    parser.add_argument("--ig-lengths", nargs="*", type=int, default=[128, 512])
    parser.add_argument("--ig-batch", type=int, default=2, help="IG's internal_batch_size (10 at L = 512: > 24 GB)")
    args = parser.parse_args()
    tf.logging.set_verbosity_error()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, batch 1, fp32")
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
