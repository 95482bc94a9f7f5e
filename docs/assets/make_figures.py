"""Regenerate the figures of docs/methods: a visualize_text page and a plot_token_attr PNG.

The model is the tests' recall task (tests/test_trained_marker.py): a tiny Mamba trained here in seconds to answer,
at the final "?", the token that followed the KEY marker. Run from the repository root:
    python docs/assets/make_figures.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402
import transformers as tf  # noqa: E402
from captum.attr import visualization  # noqa: E402

import mamba_captum as mc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_trained_marker import sequences, train_recall_model  # noqa: E402

NAMES = {0: "<pad>", 1: "?", 2: "KEY", **{i: "abcdefg"[i - 3] for i in range(3, 10)},
         **{i: "WXYZ"[i - 12] for i in range(12, 16)}, 10: "_", 11: "_"}


class Names:
    def convert_ids_to_tokens(self, ids):
        return [NAMES[int(i)] for i in ids]


def main():
    tf.logging.set_verbosity_error()
    model = train_recall_model()
    ids, answer, _ = sequences(4, torch.Generator().manual_seed(1))
    probs = model(ids).logits[:, -1].softmax(-1).detach()
    relevance = mc.MambaAttribution(model).attribute(ids, target=answer)
    # The query's own entry holds the residual path's share (rollout's identity) and dwarfs the rest; leave it out
    # of the colour scale, as the official notebooks drop the query column.
    relevance[:, -1] = 0
    records = mc.to_visualization_record(
        relevance, [Names().convert_ids_to_tokens(row) for row in ids],
        pred_prob=[float(probs[i, answer[i]]) for i in range(4)],
        pred_class=Names().convert_ids_to_tokens(probs.argmax(-1)), true_class=Names().convert_ids_to_tokens(answer),
        attr_class=Names().convert_ids_to_tokens(answer))
    html = visualization.visualize_text(records).data
    (ROOT / "docs/assets/visualize_text.html").write_text(html)

    # Generation view: each next-token prediction of the second half of a sequence, explained over the first half.
    full = torch.cat([ids[0], answer[:1]])
    prompt, generated = full[None, :7], full[7:]  # the KEY pair is in the prompt
    result = mc.MambaAttribution(model).attribute_generation(prompt, target=generated, tokenizer=Names())
    figure, _ = result.plot_token_attr(show=False)
    figure.set_size_inches(6, 3.5)
    figure.tight_layout()
    figure.savefig(ROOT / "docs/assets/token_attr.png", dpi=110)
    print("wrote docs/assets/visualize_text.html and docs/assets/token_attr.png;",
          "top token of each example:", relevance.argmax(-1).tolist())


if __name__ == "__main__":
    main()
