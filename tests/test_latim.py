"""MambaLaTIM (docs/methods/latim.md): the per-layer decomposition against a float64 hand-written Mamba-1 layer,
the ALTI / ℓ2 weights by hand, the ALTI-logit sum, batched == single, a gated delta net, refusals; and the copy
task's scores by hand."""
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from test_identities import liven

from mamba_captum.attr import MambaLaTIM, latim
from mamba_captum.evaluation.copy_task import alignment_scores, copy_examples
from mamba_captum.evaluation.models import new_classifier
from mamba_captum.fast_scans import fast_scans
from mamba_captum.verification import ReconstructionError


def tiny_mamba(layers=2, seed=0):
    torch.manual_seed(seed)
    config = tf.MambaConfig(vocab_size=20, hidden_size=8, num_hidden_layers=layers, state_size=4, expand=2,
                            conv_kernel=3, time_step_rank=2, pad_token_id=0)
    model = liven(tf.AutoModelForCausalLM.from_config(config).eval())
    with torch.no_grad():  # HF initialises the conv biases to 0; their share of the output is no token's
        for layer in model.backbone.layers:
            layer.mixer.conv1d.bias.uniform_(-1.0, 1.0)
    return model


def layer_outputs(model, ids):
    """Each decoder layer's (input, output), float64, seen by hooks of the test's own."""
    seen = []
    hooks = [layer.register_forward_hook(lambda m, a, o: seen.append((a[0].double(), o.double())))
             for layer in model.backbone.layers]
    with torch.no_grad():
        model(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return seen


def reference_token_terms(mixer, hidden):
    """T[i, j] (L, L, D) for j ≠ i of one Mamba-1 mixer, written out in float64 from its weights:
    out_proj(silu(z_i) ⊙ Σ_{m=j..i} α[i, m] σ(p_m) w_{m−j} x_j), α[i, m] = C_i · Π_{t=m+1..i} exp(Δ_t A) Δ_m B_m,
    p the conv pre-activation (silu(p) = σ(p) p: the activation's gain σ(p) on the bias-free conv of x)."""
    d = lambda t: t.detach().double()
    x, z = (d(mixer.in_proj.weight) @ hidden.T).T.chunk(2, dim=-1)  # (L, E) each
    length, width = x.shape
    taps = d(mixer.conv1d.weight)[:, 0]  # (E, K): p_m = Σ_k taps[:, K-1-k] x_{m-k} + bias
    kernel = taps.shape[1]
    conv = torch.stack([sum(taps[:, kernel - 1 - k] * x[m - k] for k in range(kernel) if m - k >= 0)
                        for m in range(length)])
    pre = conv + d(mixer.conv1d.bias)
    u = F.silu(pre)
    rank, state = mixer.time_step_rank, mixer.ssm_state_size
    dt_low, B, C = (d(mixer.x_proj.weight) @ u.T).T.split([rank, state, state], dim=-1)
    delta = F.softplus(dt_low @ d(mixer.dt_proj.weight).T + d(mixer.dt_proj.bias))  # (L, E)
    A = -torch.exp(d(mixer.A_log))  # (E, N)
    terms = torch.zeros(length, length, hidden.shape[-1], dtype=torch.float64)
    for i in range(length):
        for j in range(i):
            inner = torch.zeros(width, dtype=torch.float64)
            for m in range(j, min(i, j + kernel - 1) + 1):
                decay = torch.exp(delta[m + 1:i + 1, :, None] * A).prod(0)  # (E, N)
                alpha = (decay * delta[m, :, None] * B[m] * C[i]).sum(-1)  # (E,)
                inner += alpha * torch.sigmoid(pre[m]) * taps[:, kernel - 1 - (m - j)] * x[j]
            terms[i, j] = d(mixer.out_proj.weight) @ (F.silu(z[i]) * inner)
    return terms


def test_contributions_match_a_float64_hand_written_mamba_layer_and_sum_to_the_real_output():
    model = tiny_mamba()
    ids = torch.tensor([[3, 7, 11, 4, 9, 15]])
    decomposed = MambaLaTIM(model).decompose(ids)  # (layers, B, L, L, D)
    seen = layer_outputs(model, ids)
    for number, (layer_input, output) in enumerate(seen):
        terms = decomposed[number, 0]
        torch.testing.assert_close(terms.sum(1), output[0], rtol=0, atol=1e-6)  # the layer's real output
        mixer = model.backbone.layers[number].mixer
        normed = model.backbone.layers[number].norm(layer_input.float()).double()[0]
        reference = reference_token_terms(mixer, normed)
        below = torch.ones(6, 6, dtype=torch.bool).tril(-1)
        assert reference[below].abs().max() > 1e-3  # the tokens mix: the check is not of zeros
        torch.testing.assert_close(terms[below], reference[below], rtol=1e-4, atol=1e-7)
        assert terms.movedim(-1, 0).triu(1).abs().max() == 0  # causal: no later token contributes


def tiny_mamba2(seed=0):
    torch.manual_seed(seed)
    config = tf.Mamba2Config(vocab_size=20, hidden_size=8, num_hidden_layers=2, num_heads=2, head_dim=8, n_groups=1,
                             state_size=4, expand=2, conv_kernel=3, chunk_size=4, pad_token_id=0)
    model = liven(tf.AutoModelForCausalLM.from_config(config).eval())
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.conv1d.bias.uniform_(-1.0, 1.0)
    return model


def reference_mamba2_terms(mixer, hidden):
    """T[i, j] (L, L, D) for j ≠ i of one Mamba-2 mixer (one group), in float64 from its weights: out_proj(ν_i ⊙
    silu(z_i) ⊙ Σ_{m=j..i} α_h[i, m] σ(p_m) w_{m−j} x_j), α_h[i, m] = C_i · B_m Δ_{m,h} exp(Σ_{t=m+1..i} Δ_{t,h} A_h),
    ν_i = γ / rms(the gated SSD output at i) (the gated RMSNorm's scale at token i), p the conv pre-activation."""
    d = lambda t: t.detach().double()
    width, state, heads = mixer.intermediate_size, mixer.ssm_state_size, mixer.num_heads
    z, xbc, dt = (d(mixer.in_proj.weight) @ hidden.T).T.split([width, mixer.conv_dim, heads], dim=-1)
    length = xbc.shape[0]
    taps = d(mixer.conv1d.weight)[:, 0]
    kernel = taps.shape[1]
    conv = torch.stack([sum(taps[:, kernel - 1 - k] * xbc[m - k] for k in range(kernel) if m - k >= 0)
                        for m in range(length)])
    pre = conv + d(mixer.conv1d.bias)
    x_post, B, C = F.silu(pre).split([width, state, state], dim=-1)
    x, gain, taps_x = xbc[:, :width], torch.sigmoid(pre[:, :width]), taps[:width]
    delta = F.softplus(dt + d(mixer.dt_bias))  # (L, H)
    A = -torch.exp(d(mixer.A_log))
    per_channel = lambda v: v.repeat_interleave(mixer.head_dim, dim=-1)  # (…, H) -> (…, H·P)
    alpha = torch.zeros(length, length, width, dtype=torch.float64)
    for i in range(length):
        for m in range(i + 1):
            decay = torch.exp((delta[m + 1:i + 1] * A).sum(0))
            alpha[i, m] = per_channel((C[i] @ B[m]) * delta[m] * decay)
    ssd = torch.einsum("imc,mc->ic", alpha, x_post) + per_channel(d(mixer.D)) * x_post
    gated = ssd * F.silu(z)
    scale = d(mixer.norm.weight) / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon)
    terms = torch.zeros(length, length, hidden.shape[-1], dtype=torch.float64)
    for i in range(length):
        for j in range(i):
            inner = sum(alpha[i, m] * gain[m] * taps_x[:, kernel - 1 - (m - j)] * x[j]
                        for m in range(j, min(i, j + kernel - 1) + 1))
            terms[i, j] = d(mixer.out_proj.weight) @ (scale[i] * F.silu(z[i]) * inner)
    return terms


def test_mamba2_contributions_match_a_float64_hand_written_layer():
    model = tiny_mamba2()
    ids = torch.tensor([[3, 7, 11, 4, 9, 15]])
    decomposed = MambaLaTIM(model).decompose(ids)
    seen = layer_outputs(model, ids)
    below = torch.ones(6, 6, dtype=torch.bool).tril(-1)
    for number, (layer_input, output) in enumerate(seen):
        torch.testing.assert_close(decomposed[number, 0].sum(1), output[0], rtol=0, atol=1e-5)
        block = model.backbone.layers[number]
        reference = reference_mamba2_terms(block.mixer, block.norm(layer_input.float()).double()[0])
        assert reference[below].abs().max() > 1e-3
        torch.testing.assert_close(decomposed[number, 0][below], reference[below], rtol=1e-4, atol=1e-6)


def test_alti_and_l2_weights_by_hand():
    # row 0: y0 = (1, 0) from token 0 alone; row 1: T(1←0) = (1, 1), T(1←1) = (0, 2), y1 = (1, 3)
    contributions = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 2.0]]]], dtype=torch.float64)
    output = contributions.sum(2)
    # ALTI: ‖y1‖₁ = 4; ‖y1 − (1,1)‖₁ = 2 -> 2; ‖y1 − (0,2)‖₁ = 2 -> 2: [1/2, 1/2]
    torch.testing.assert_close(latim.alti_weights(contributions, output),
                               torch.tensor([[[1.0, 0.0], [0.5, 0.5]]], dtype=torch.float64))
    root = 2 ** 0.5
    torch.testing.assert_close(latim.l2_weights(contributions),
                               torch.tensor([[[1.0, 0.0], [root / (root + 2), 2 / (root + 2)]]], dtype=torch.float64))
    # a contribution pointing away from the output gets no proximity: y1 = (1, 0) from (1.5, 0) and (-0.5, 0)
    away = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]], [[1.5, 0.0], [-0.5, 0.0]]]], dtype=torch.float64)
    torch.testing.assert_close(latim.alti_weights(away, away.sum(2)),
                               torch.tensor([[[1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64))
    # row 1 of a 2-token layer with y1 = (1, 0) from (2, 0) and (-1, 0): both farther than the origin; the row
    # keeps its own token (rows of the rollout sum to 1)
    none = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]], [[2.0, 0.0], [-1.0, 0.0]]]], dtype=torch.float64)
    torch.testing.assert_close(latim.alti_weights(none, none.sum(2)),
                               torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64))


def test_rollout_rows_are_the_map_and_alti_logit_sums_to_the_logit():
    model = tiny_mamba()
    ids = torch.tensor([[3, 7, 11, 4, 9, 15], [5, 5, 6, 18, 2, 8]])
    method = MambaLaTIM(model, variant="l2")
    full = method.attribute_map(ids)  # (B, L, L)
    torch.testing.assert_close(full.sum(-1), torch.ones(2, 6, dtype=torch.float64))
    torch.testing.assert_close(method.attribute(ids, position=3), full[:, 3])
    assert method.attribute(ids, position=3)[:, 4:].abs().max() == 0  # causal
    relevance = method.attribute(ids, target=[4, 9], variant="alti_logit")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[:, -1]
    torch.testing.assert_close(relevance.sum(-1), logits[[0, 1], [4, 9]].double(), rtol=0, atol=1e-5)
    several = method.attribute_positions(ids, [2, 5], target=[7, [4, 9]], variant="alti_logit")  # one pass
    torch.testing.assert_close(several[1], relevance, rtol=0, atol=1e-10)
    torch.testing.assert_close(several[0], method.attribute(ids, target=7, position=2, variant="alti_logit"),
                               rtol=0, atol=1e-10)


def test_batched_equals_single_and_left_padding_changes_nothing():
    model = tiny_mamba()
    ids = torch.tensor([[3, 7, 11, 4, 9, 15], [5, 5, 6, 18, 2, 8]])
    for variant in ("alti", "l2", "alti_logit"):
        method = MambaLaTIM(model, variant=variant)
        both = method.attribute(ids, target=[4, 9])
        for b in range(2):
            torch.testing.assert_close(both[b:b + 1], method.attribute(ids[b:b + 1], target=[4, 9][b]),
                                       rtol=0, atol=1e-6)  # float32 forward, batched
        padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids[1:]], dim=1)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
        shifted = method.attribute(padded, target=9, attention_mask=mask)
        assert shifted[0, :2].abs().max() == 0
        torch.testing.assert_close(shifted[:, 2:], both[1:], rtol=0, atol=1e-6)


def test_a_gated_delta_net_decomposes_too():
    model = new_classifier("qwen3_next", 20, 9).eval()  # two gated delta-net layers with dense MLPs
    ids = torch.tensor([[3, 7, 11, 4, 9, 15, 6, 12, 5]])
    method = MambaLaTIM(model)
    decomposed = method.decompose(ids)
    assert decomposed.shape == (2, 1, 9, 9, 32)
    pairs = decomposed[:, 0].movedim(-1, 1)  # (layers, D, L, L)
    assert pairs.triu(1).abs().max() == 0 and pairs.tril(-1).abs().max() > 0
    relevance = method.attribute(ids, target=4, variant="alti_logit")
    with torch.no_grad(), fast_scans(model):
        logit = model(ids, use_cache=False).logits[0, -1, 4]
    torch.testing.assert_close(relevance.sum(), logit.double(), rtol=0, atol=1e-5)
    alti = method.attribute(ids)
    torch.testing.assert_close(alti.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_refusals_name_what_cannot_be_decomposed(monkeypatch):
    lfm2 = new_classifier("lfm2", 20, 9).eval()  # an attention layer: its operator reads out per head
    with pytest.raises(TypeError, match="SoftmaxOperator"):
        MambaLaTIM(lfm2).attribute(torch.tensor([[3, 4, 5, 6]]))
    model = tiny_mamba()
    with pytest.raises(ValueError, match="variant='bogus'"):
        MambaLaTIM(model, variant="bogus")
    with pytest.raises(ValueError, match="no token × token map"):
        MambaLaTIM(model).attribute_map(torch.tensor([[3, 4, 5]]), variant="alti_logit")
    original = latim.contribution_vectors

    def off(operator):  # contributions 0.1% off: the run-time identity check must refuse them
        terms, own = original(operator)
        return terms * 1.001, own

    monkeypatch.setattr(latim, "contribution_vectors", off)
    with pytest.raises(ReconstructionError, match="do not sum to the mixer's real output"):
        MambaLaTIM(model).attribute(torch.tensor([[3, 4, 5, 6, 7]]))


def test_copy_task_alignment_and_scores_by_hand():
    examples = copy_examples(2, 3, 5, torch.Generator().manual_seed(0))
    ids = examples.input_ids
    assert ids.shape == (2, 8) and (ids[:, 0] == 2).all() and (ids[:, 4] == 1).all()
    assert torch.equal(ids[:, 1:4], ids[:, 5:8])
    assert examples.queries.tolist() == [4, 5, 6] and examples.sources.tolist() == [1, 2, 3]
    assert torch.equal(examples.targets(1), ids[:, 2])
    # gold is candidate 1; scores [0.2, 0.5, 0.1, 0.5]: one below, one tie, one above among 3 others
    scores = torch.tensor([[0.2, 0.5, 0.1, 0.5], [0.0, 1.0, 0.0, 0.0]])
    result = alignment_scores(scores, torch.tensor([1, 1]))
    assert result["auc"] == pytest.approx(((2 + 0.5) / 3 + 1.0) / 2)
    assert result["ap"] == pytest.approx((1 / 2 + 1) / 2)  # the tie ranks ahead of the gold token
    assert result["r_at_k"] == pytest.approx(0.5)
