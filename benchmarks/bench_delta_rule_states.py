"""Benchmark: the delta rule with states on CPU, forward + backward, against flash-linear-attention's torch references.

For B = 1, L tokens, H heads, K = V (float32, keys l2-normalised, beta in (0, 1)) it times one forward and one
backward (of ⟨o, P⟩ + ⟨S_L, P_S⟩, gradients of q, k, v, beta, the log decays and the initial state) of
  chunked C=…   kernels.delta_rule.delta_rule_chunked_states for each chunk size C
  recurrent     kernels.delta_rule.delta_rule_recurrent (token by token)
  fla naive     fla/ops/gated_delta_rule/naive.py naive_recurrent_gated_delta_rule (fla's reference: token by token)
  fla chunk     fla/ops/gated_delta_rule/naive.py naive_chunk_gated_delta_rule (fla's torch chunked form)
for one decay per head (the gated delta rule: Qwen3-Next / Qwen3.5 GatedDeltaNet; H = 8, K = V = 128 is the core of
a ~100M-parameter layer), and with ``--kda`` also one decay per key channel (KDA: chunked only and fla's
naive_recurrent_kda). Each figure is the best of ``--repeats`` runs (the token-by-token ones: one run), in ms; the
ratio column is fla naive / the row. The largest difference of each output from the chunked one (at the first chunk
size) is printed as a check. The machine's load average is printed: other processes on the cores slow every row
(``--clock cpu`` counts this process's CPU time instead of wall time: steadier on a busy machine, with ``--threads 1``).

Run:  python benchmarks/bench_delta_rule_states.py [--heads 4 8] [--length 1024] [--dim 128] [--threads 2]
          [--chunk-sizes 16 32 64 128] [--repeats 5] [--kda [--kda-chunk-sizes 4 8 16 32]] [--skip-recurrent]
          [--clock wall|cpu]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from mamba_captum.kernels.delta_rule import delta_rule_chunked_states, delta_rule_recurrent


def make_inputs(length, heads, dim, per_channel, seed=0):
    """float32 (q, k, v, beta, log_decay, initial_state) and the projections of o and of the final state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads, dim, generator=gen)
    k = F.normalize(torch.randn(1, length, heads, dim, generator=gen), dim=-1)
    v = torch.randn(1, length, heads, dim, generator=gen)
    beta = torch.rand(1, length, heads, generator=gen)
    log_decay = -0.5 * torch.rand(1, length, heads, *((dim,) if per_channel else ()), generator=gen)
    state = torch.randn(1, heads, dim, dim, generator=gen)
    projections = (torch.randn(1, length, heads, dim, generator=gen), torch.randn(1, heads, dim, dim, generator=gen))
    return (q, k, v, beta, log_decay, state), projections


def time_forward_backward(run, inputs, projections, repeats, clock):
    """(best forward ms, best forward + backward ms, the output of the last run) of ``run(q, k, v, beta, g, s0)``."""
    best_forward = best_total = float("inf")
    for _ in range(repeats):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        start = clock()
        output, final = run(*leaves)
        middle = clock()
        ((output * projections[0]).sum() + (final * projections[1]).sum()).backward()
        end = clock()
        best_forward, best_total = min(best_forward, middle - start), min(best_total, end - start)
    return best_forward * 1e3, best_total * 1e3, output.detach()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--kda-chunk-sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kda", action="store_true", help="also one decay per key channel")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time (all threads), steadier than wall time on a busy machine")
    parser.add_argument("--skip-recurrent", action="store_true", help="leave out delta_rule_recurrent (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
    from fla.ops.kda.naive import naive_recurrent_kda

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, float32, B=1 "
          f"L={args.length} K=V={args.dim}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'decay':8} {'H':>2} {'method':14} {'fwd ms':>9} {'fwd+bwd ms':>11} {'vs fla naive':>13} {'max |Δo|':>9}")
    for per_channel in ([False, True] if args.kda else [False]):
        for heads in args.heads:
            inputs, projections = make_inputs(args.length, heads, args.dim, per_channel)
            rows = []
            for size in (args.kda_chunk_sizes if per_channel else args.chunk_sizes):
                rows.append((f"chunked C={size}", time_forward_backward(
                    lambda q, k, v, b, g, s, size=size: delta_rule_chunked_states(
                        q, k, v, b, g, initial_state=s, output_final_state=True, chunk_size=size),
                    inputs, projections, args.repeats, clock)))
            if not args.skip_recurrent:
                rows.append(("recurrent", time_forward_backward(
                    lambda q, k, v, b, g, s: delta_rule_recurrent(q, k, v, b, g, initial_state=s,
                                                                  output_final_state=True),
                    inputs, projections, 1, clock)))
            if per_channel:
                rows.append(("fla naive", time_forward_backward(
                    lambda q, k, v, b, g, s: naive_recurrent_kda(q, k, v, g, b, initial_state=s,
                                                                 output_final_state=True),
                    inputs, projections, 1, clock)))
            else:
                rows.append(("fla naive", time_forward_backward(
                    lambda q, k, v, b, g, s: naive_recurrent_gated_delta_rule(q, k, v, b, g, initial_state=s,
                                                                              output_final_state=True),
                    inputs, projections, 1, clock)))
                rows.append(("fla chunk", time_forward_backward(
                    lambda q, k, v, b, g, s: naive_chunk_gated_delta_rule(q, k, v, g, b, initial_state=s,
                                                                          output_final_state=True),
                    inputs, projections, args.repeats, clock)))
            reference_total = dict(rows)["fla naive"][1]
            first_output = rows[0][1][2]
            for name, (forward, total, output) in rows:
                print(f"{'channel' if per_channel else 'head':8} {heads:2} {name:14} {forward:9.1f} {total:11.1f} "
                      f"{reference_total / total:12.1f}x {(output - first_output).abs().max().item():9.1e}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
