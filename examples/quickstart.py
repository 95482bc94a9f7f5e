"""Quickstart: the implicit attention of a tiny random Mamba, how exactly it reproduces the layer, and the
Captum explanations built on it.

Runs offline in seconds: the model is built from a config (no download). With a real checkpoint, replace the
config by ``MambaForCausalLM.from_pretrained("state-spaces/mamba-130m-hf")`` and the ids by a tokenizer's output.
"""
import torch
import transformers as tf

import mamba_captum as mc

tf.logging.set_verbosity_error()  # HF logs a "falling back to the PyTorch implementation" line per kernel on CPU

torch.manual_seed(0)
config = tf.MambaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2)
model = tf.MambaForCausalLM(config).eval()
input_ids = torch.randint(0, 100, (1, 10))

# 1. The channel-mean implicit attention of every layer: (batch, query, key), causal.
maps = mc.implicit_attention(model, input_ids, formulation="unified", reduce="mean")
torch.set_printoptions(precision=3, sci_mode=True, linewidth=140)
print(f"layers: {list(maps)}; layer 1 map {tuple(maps[1].shape)} (unified, channel mean):")
print(maps[1][0])

# 2. Exactness. The library rebuilds each layer's operator and checks it against the layer's real output.
_, _, errors = mc.build_operators(model, input_ids)
print("layer output rebuilt from the operator, max relative error:", {k: f"{v:.1e}" for k, v in errors.items()})

# 3. The identity y = H x itself, with hooks of our own: with the conv bias and the D skip set to 0 (they are not
#    attributed to tokens), the input of out_proj equals Σ_s H_c[i, s] x_c[s] for every channel c.
with torch.no_grad():
    for layer in model.backbone.layers:
        layer.mixer.conv1d.bias.zero_()
        layer.mixer.D.zero_()
mixer = model.backbone.layers[1].mixer
seen = {}
handles = [mixer.in_proj.register_forward_hook(lambda m, a, out: seen.update(x=out[..., :mixer.intermediate_size])),
           mixer.out_proj.register_forward_pre_hook(lambda m, a: seen.update(y=a[0]))]
with torch.no_grad():
    model(input_ids)
for handle in handles:
    handle.remove()
H = mc.implicit_attention(model, input_ids, reduce=None, layers=[1])[1]  # (batch, channels, L, L)
y = torch.einsum("bcis,bsc->bic", H.double(), seen["x"].double())
error = ((y - seen["y"]).abs().max() / seen["y"].abs().max()).item()
print(f"out_proj input vs H x over {H.shape[1]} channels: max relative error {error:.1e}")

# 4. Explanations as Captum attributions: which input tokens the next-token prediction relies on, (batch, L).
target = int(model(input_ids).logits[0, -1].argmax())
for method in (mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution):
    relevance = method(model).attribute(input_ids, target=target)
    print(f"{method.__name__:>18}:", relevance[0])
