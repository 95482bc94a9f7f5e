"""fla models on CPU: forward + backward of a ~100M-parameter GLA and RWKV-7 at L = 1024 inside
``mamba_captum.fla_on_cpu()``, with the library's chunked torch ops (what the swaps run) against the same model with
the core op replaced by fla's own naive per-token references (``naive_recurrent_gla``, ``dplr_recurrence``), and
against the same model with a free core op (``o = v``): the rest of the model, which bounds any model-level
speed-up from the core op at (naive) / (free).

    python benchmarks/bench_fla_cpu.py [--threads 2] [--length 1024] [--layers 12] [--clock wall|cpu]

Prints seconds per forward + backward (best of ``--repeat``) and the speed-ups; not a test.
"""
from __future__ import annotations

import argparse
import contextlib
import time
import warnings

import torch

import mamba_captum as mc
from mamba_captum.fla_cpu import import_fla_models, ops


def gla_config(fla_models, layers):
    return fla_models.GLAConfig(hidden_size=768, num_hidden_layers=layers, num_heads=4, expand_k=0.5, expand_v=1.0,
                                vocab_size=32000, fuse_cross_entropy=False, use_cache=False)


def rwkv7_config(fla_models, layers):
    return fla_models.RWKV7Config(hidden_size=768, num_hidden_layers=layers, head_dim=64, vocab_size=32000,
                                  fuse_cross_entropy=False, use_cache=False)


def fla_naive_gla(q, k, v, log_decay=None, *, scale=None, bonus=None, initial_state=None, output_final_state=False):
    """fla's naive_recurrent_gla behind the kernel's signature (the GLA layers' default scale K^-1/2)."""
    from fla.ops.gla.naive import naive_recurrent_gla
    assert bonus is None and (scale is None or abs(scale - q.shape[-1] ** -0.5) < 1e-12)
    return naive_recurrent_gla(q, k, v, log_decay, initial_state, output_final_state)


def fla_naive_dplr(q, k, v, a, b, log_decay, *, scale=None, initial_state=None, output_final_state=False):
    """fla's dplr_recurrence behind the kernel's signature: it hard-codes the scale K^-1/2, so q is rescaled."""
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q * (scale / q.shape[-1] ** -0.5)
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v, a, b, log_decay)]  # its (B, H, T, ·) layout
    o, state = dplr_recurrence(*heads_first, initial_state, output_final_state)
    return o.transpose(1, 2), state


def free_gla(q, k, v, log_decay=None, *, scale=None, bonus=None, initial_state=None, output_final_state=False):
    """No token mixing at all, o = v (q, k, the decays kept in the graph at no cost): the rest of the model's time."""
    return v + 0 * (q.sum(-1, keepdim=True) + k.sum(-1, keepdim=True) + log_decay.sum(-1, keepdim=True)), None


def free_dplr(q, k, v, a, b, log_decay, *, scale=None, initial_state=None, output_final_state=False):
    """As :func:`free_gla` for the DPLR op."""
    return v + 0 * sum(t.sum(-1, keepdim=True) for t in (q, k, a, b, log_decay)), None


@contextlib.contextmanager
def core_ops(kind):
    """The library's chunked kernels (``"chunked"``), fla's naive references (``"naive"``) or no mixing (``"free"``)
    behind the op swaps."""
    saved = ops.gated_linear_chunked, ops.dplr_chunked
    if kind == "naive":
        ops.gated_linear_chunked, ops.dplr_chunked = fla_naive_gla, fla_naive_dplr
    elif kind == "free":
        ops.gated_linear_chunked, ops.dplr_chunked = free_gla, free_dplr
    try:
        yield
    finally:
        ops.gated_linear_chunked, ops.dplr_chunked = saved


def step_seconds(model, ids, repeat, clock=time.perf_counter):
    best = float("inf")
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        start = clock()
        with mc.fla_on_cpu():
            loss = model(ids, use_cache=False).logits.float().logsumexp(-1).mean()
            loss.backward()
        best = min(best, clock() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["gla", "rwkv7"])
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (with --threads 1, steadier on a shared machine)")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    fla_models = import_fla_models()
    from transformers import AutoModelForCausalLM
    for name in args.models:
        config = (gla_config if name == "gla" else rwkv7_config)(fla_models, args.layers)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).train()
        ids = torch.randint(0, config.vocab_size, (1, args.length))
        parameters = sum(p.numel() for p in model.parameters()) / 1e6
        with core_ops("chunked"):
            chunked = step_seconds(model, ids, args.repeat, clock)
        with core_ops("naive"):
            naive = step_seconds(model, ids, 1, clock)
        with core_ops("free"):
            free = step_seconds(model, ids, args.repeat, clock)
        print(f"{name}: {parameters:.0f}M parameters, L={args.length}, {args.threads} threads, {args.clock} clock: "
              f"forward+backward {chunked:.2f} s with the chunked torch ops, {naive:.2f} s with fla's naive "
              f"references ({naive / chunked:.1f}x); {free:.2f} s with no mixing at all, so at most "
              f"{naive / free:.1f}x is possible; the chunked ops cost {chunked - free:.2f} s against the naive "
              f"{naive - free:.2f} s ({(naive - free) / max(chunked - free, 1e-9):.1f}x)", flush=True)


if __name__ == "__main__":
    main()
