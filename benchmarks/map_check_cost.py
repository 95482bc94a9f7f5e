"""What the run-time map check (mamba_captum.verification.check_maps) costs: its share of one implicit_attention
call at the 130m shape (d_model 768, d_inner 1536, state 16; issue 32's target: <= 5 % at L = 1024).

    python benchmarks/map_check_cost.py [--length 1024] [--layers 4] [--family mamba|mamba2] [--repeats 2]

The model is random (no hub): the cost depends on the shapes, not the weights. Fewer layers than 130m's 24 give the
same share (each layer's maps and check scale alike). Prints the whole call, the time inside check_maps, and the share.
"""
import argparse
import time

import torch
import transformers as tf

import mamba_captum as mc
from mamba_captum import rebuild, verification


def model_130m(family: str, layers: int):
    if family == "mamba":
        config = tf.MambaConfig(vocab_size=1000, hidden_size=768, state_size=16, num_hidden_layers=layers,
                                intermediate_size=1536, time_step_rank=48)
    else:
        config = tf.Mamba2Config(vocab_size=1000, hidden_size=768, state_size=128, num_hidden_layers=layers,
                                 expand=2, head_dim=64, num_heads=24, n_groups=1)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--family", choices=["mamba", "mamba2"], default="mamba")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = model_130m(args.family, args.layers)
    ids = torch.randint(3, 1000, (1, args.length), generator=torch.Generator().manual_seed(0))
    spent = []
    checked = verification.check_maps

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return checked(*a, **k)
        finally:
            spent.append(time.perf_counter() - start)

    rebuild.check_maps = timed
    mc.implicit_attention(model, ids[:, :64])  # warm-up
    for _ in range(args.repeats):
        spent.clear()
        start = time.perf_counter()
        mc.implicit_attention(model, ids)
        total = time.perf_counter() - start
        print(f"{args.family} 130m shape, {args.layers} layers, L={args.length}, {torch.get_num_threads()} threads: "
              f"implicit_attention {total:.2f} s, check_maps {sum(spent):.3f} s ({len(spent)} layers), "
              f"share {100 * sum(spent) / total:.2f} %")


if __name__ == "__main__":
    main()
