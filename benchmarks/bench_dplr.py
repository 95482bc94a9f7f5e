"""Benchmark: RWKV-7's DPLR delta rule on CPU, forward + backward, against flash-linear-attention's torch references.

For B = 1, L tokens, H heads, K = V = 64 (RWKV-7's head size; H = 12 is the hidden size 768 of a ~100M-parameter
model), float32, RWKV-7's parametrisation (a = −kk, b = kk ⊙ gate with kk unit-norm per head and gate in (0, 1),
log decay −e^{−1/2} σ(·)) and a random initial state, it times one forward and one backward (of ⟨o, P⟩ + ⟨S_L, P_S⟩,
gradients of q, k, v, a, b, the log decays and the initial state) of
  chunked C=…   kernels.dplr.dplr_chunked for each chunk size C (sub_chunk 16)
  recurrent     kernels.dplr.dplr_recurrent (token by token)
  fla naive     fla/ops/generalized_delta_rule/dplr/naive.py dplr_recurrence (fla's reference: token by token)
  fla chunk     the same file's dplr_chunkwise (fla's torch chunked form, chunk 32, L a multiple of 32)
Each figure is the best of ``--repeats`` runs (the token-by-token ones: one run), in ms; the ratio column is
fla naive / the row. The largest difference of each output from the chunked one (at the first chunk size) is
printed as a check. The machine's load average is printed: other processes on the cores slow every row (with
2 threads, far more than twice: a thread that waits for a descheduled one spins).

Run:  python benchmarks/bench_dplr.py [--heads 4 12] [--length 1024] [--threads 2] [--chunk-sizes 16 32 64]
          [--repeats 5] [--no-fla-chunk]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from mamba_captum.kernels.dplr import dplr_chunked, dplr_recurrent

DIM = 64


def make_inputs(length, heads, seed=0):
    """float32 (q, k, v, a, b, log_decay, initial_state) as RWKV-7 forms them, and the projections of o and of the
    final state."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, length, heads, DIM)
    q, k, v = (torch.randn(*shape, generator=gen) for _ in range(3))
    kk = F.normalize(torch.randn(*shape, generator=gen), dim=-1)
    gate = torch.rand(*shape, generator=gen)
    log_decay = -0.6065306597126334 * torch.sigmoid(torch.randn(*shape, generator=gen))
    state = torch.randn(1, heads, DIM, DIM, generator=gen)
    projections = (torch.randn(*shape, generator=gen), torch.randn(1, heads, DIM, DIM, generator=gen))
    return (q, 0.3 * k, v, -kk, kk * gate, log_decay, state), projections


def time_forward_backward(run, inputs, projections, repeats):
    """(best forward ms, best forward + backward ms, the output of the last run) of ``run(q, k, v, a, b, g, s0)``."""
    best_forward = best_total = float("inf")
    for _ in range(repeats):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        start = time.perf_counter()
        output, final = run(*leaves)
        middle = time.perf_counter()
        ((output * projections[0]).sum() + (final * projections[1]).sum()).backward()
        end = time.perf_counter()
        best_forward, best_total = min(best_forward, middle - start), min(best_total, end - start)
    return best_forward * 1e3, best_total * 1e3, output.detach()


def head_first(fla_function, **kw):
    """fla's references take (B, H, L, ·) and return o the same way."""
    def run(q, k, v, a, b, g, s):
        o, final = fla_function(*(x.transpose(1, 2) for x in (q, k, v, a, b, g)), initial_state=s,
                                output_final_state=True, **kw)
        return o.transpose(1, 2), final
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 12])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-fla-chunk", action="store_true", help="leave out fla's torch chunked form")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_chunkwise, dplr_recurrence

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, B=1 L={args.length} K=V={DIM}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'H':>2} {'method':14} {'fwd ms':>9} {'fwd+bwd ms':>11} {'vs fla naive':>13} {'max |Δo|':>9}")
    for heads in args.heads:
        inputs, projections = make_inputs(args.length, heads)
        rows = []
        for size in args.chunk_sizes:
            rows.append((f"chunked C={size}", time_forward_backward(
                lambda q, k, v, a, b, g, s, size=size: dplr_chunked(
                    q, k, v, a, b, g, initial_state=s, output_final_state=True, chunk_size=size),
                inputs, projections, args.repeats)))
        rows.append(("recurrent", time_forward_backward(
            lambda q, k, v, a, b, g, s: dplr_recurrent(q, k, v, a, b, g, initial_state=s, output_final_state=True),
            inputs, projections, 1)))
        rows.append(("fla naive", time_forward_backward(head_first(dplr_recurrence), inputs, projections, 1)))
        if not args.no_fla_chunk and args.length % 32 == 0:
            rows.append(("fla chunk", time_forward_backward(head_first(dplr_chunkwise, chunk_size=32), inputs,
                                                            projections, 1)))
        reference_total = dict(rows)["fla naive"][1]
        first_output = rows[0][1][2]
        for name, (forward, total, output) in rows:
            print(f"{heads:2} {name:14} {forward:9.1f} {total:11.1f} {reference_total / total:12.1f}x "
                  f"{(output - first_output).abs().max().item():9.1e}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
