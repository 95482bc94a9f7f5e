"""flash-linear-attention's mixture of memories (``MomAttention``, model type ``mom``; mamba_captum.families.fla_mom)
on CPU through fla_on_cpu(). Every memory has its own values, so the generic tests of tests/test_fla_families.py
(one value projection) do not apply; their equivalents here read fla's own routing and layout (its ``transform`` /
``reconstruct`` calls, recorded) and the values and o_proj input by the test's own hooks: the unified identity
y = Σ_m H_m x_m, the hidden maps against fla's naive gated delta rule on one-hot values per routed sub-sequence,
batches against single examples with left padding, the maps' reductions and contributions against the parts, the
refusals, and a training step."""
from __future__ import annotations

import fla.layers.mom as fla_mom_layer
import pytest
import torch
from conftest import relative_error
from fla_models import (VOCAB, OpRecorder, assert_batch_equals_single_examples, common_config, delta_rule_impulse,
                        fla_mixers, fla_models, padded_batch, scale_up_mixer_weights)
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc

CONFIGS = {
    # three memories, two chosen per token, the shared memory, the gated norm
    "mom": common_config(num_heads=2, head_dim=8, expand_v=1.0, num_memories=3, topk=2),
    # one projection set for every memory, one choice per token, no shared memory, the plain RMS norm
    "mom_variant": common_config(num_heads=2, head_dim=8, expand_v=1.0, num_memories=2, topk=1, shared_mem=False,
                                 single_kv_proj=True, use_output_gate=False),
}
OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


def make_model(name, dtype=torch.float64, **changes):
    config = fla_models.MomConfig(**{**CONFIGS[name], **changes})
    torch.manual_seed(0)
    return scale_up_mixer_weights(AutoModelForCausalLM.from_config(config).to(dtype).eval())


class LayoutRecorder:
    """Records, per call of MomAttention, fla's ``transform`` outputs and ``reconstruct``'s routing weights, the
    values each memory's v projection gave (``v_proj[m]``, or ``shared_v`` over all memories with
    ``single_kv_proj``), the shared memory's values and o_proj's input (the test's own hooks)."""

    def __init__(self, model):
        self.mixers = fla_mixers(model)
        self.calls = {mixer: {} for mixer in self.mixers}
        self.current, self.handles, self.saved = None, [], []

    def __enter__(self):
        def transform(*args, _original=fla_mom_layer.transform):
            out = _original(*args)
            self.current = self.calls[self._running]
            self.current["layout"] = (args[3].shape[-1], out[1], out[2], out[4])  # topk, indices, sorted, mask
            return out

        def reconstruct(*args, _original=fla_mom_layer.reconstruct, **kwargs):
            self.current["weights"] = kwargs["routing_weights"].detach()
            return _original(*args, **kwargs)

        for name, function in (("transform", transform), ("reconstruct", reconstruct)):
            self.saved.append((name, getattr(fla_mom_layer, name)))
            setattr(fla_mom_layer, name, function)
        for mixer in self.mixers:
            record = self.calls[mixer]
            self.handles.append(mixer.register_forward_pre_hook(lambda mod, args: setattr(self, "_running", mod)))
            self.handles.append(mixer.o_proj.register_forward_pre_hook(
                lambda mod, args, record=record: record.update(out_in=args[0].detach())))
            projections = [mixer.shared_v] if mixer.single_kv_proj else list(mixer.v_proj)
            for memory, projection in enumerate(projections):
                self.handles.append(projection.register_forward_hook(
                    lambda mod, args, out, record=record, memory=memory: record.setdefault("v", []).append(
                        out.detach())))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        for name, function in self.saved:
            setattr(fla_mom_layer, name, function)


def routed_tokens(record, batch, length):
    """Per (b, m): fla's sub-sequence of memory m in row b as (token positions, choice j of each), from its own
    transform outputs (the slot i of (b, m) holds the copy sorted[indices[b·M + m, i]] = b·L·k + t·k + j)."""
    topk, indices, sorted_indices, slot_mask = record["layout"]
    memories = indices.shape[0] // batch
    tokens = {}
    for b in range(batch):
        for m in range(memories):
            valid = slot_mask[b * memories + m]
            flat = sorted_indices[indices[b * memories + m][valid]]
            assert bool((flat // (length * topk) == b).all())
            tokens[b, m] = ((flat % (length * topk)) // topk, flat % topk)
    return tokens


def memory_values(mixer, record, batch, length):
    """Per memory, the hooked values of its v projection at token positions (B, L, V), zero where not routed."""
    tokens = routed_tokens(record, batch, length)
    # v_proj[m] ran on memory m's slots (B, max_len, D); with single_kv_proj shared_v once on all (M, B, max_len, D)
    routed = list(record["v"][0]) if mixer.single_kv_proj else record["v"][:mixer.num_memories]
    values = []
    for m in range(mixer.num_memories):
        x = torch.zeros(batch, length, routed[m].shape[-1], dtype=torch.float64)
        for b in range(batch):
            positions, _ = tokens[b, m]
            x[b, positions] = routed[m][b, :len(positions)].double()
        values.append(x)
    return values


def test_unified_identity_out_proj_input_equals_sum_of_memories():
    """y = Σ_m H_m x_m per layer, x_m the hooked value projections, y o_proj's hooked input (float32 and float64,
    left padding), the shared memory's x from the operator's own values, checked against shared_v's hooked output."""
    for name, dtype in (("mom", torch.float64), ("mom", torch.float32), ("mom_variant", torch.float64)):
        model = make_model(name, dtype)
        ids, mask = padded_batch(length=12)
        before = model_state(model)
        operators = list(mc.build_operators(model, ids, mask, formulation="unified")[0].values())
        shared_records = {}
        with LayoutRecorder(model) as recorder:
            for mixer in recorder.mixers:
                if mixer.shared_mem:
                    recorder.handles.append(mixer.shared_v.register_forward_hook(
                        lambda mod, args, out, mixer=mixer: shared_records.setdefault(mixer, out.detach())))
            with mc.fla_on_cpu(), torch.no_grad():
                model(input_ids=ids, attention_mask=mask, use_cache=False)
        assert len(operators) == len(recorder.mixers) == 2
        real = mask.bool()
        for mixer, op in zip(recorder.mixers, operators):
            record = recorder.calls[mixer]
            values = memory_values(mixer, record, *ids.shape)
            parts = op.part_maps()
            assert len(parts) == mixer.num_memories + mixer.shared_mem
            if mixer.shared_mem:  # fla unpads the shared memory's tokens: (1, T_real, V)
                shared = torch.zeros_like(values[0])
                shared[real] = shared_records[mixer].double().reshape(-1, shared.shape[-1])
                values.append(shared)
            got = 0
            for (H, own_values), x in zip(parts, values):
                assert relative_error(own_values, x) <= (1e-12 if dtype == torch.float64 else 1e-6)
                got = got + torch.einsum("bcis,bsc->bic", H.double(), x)
            expected = record["out_in"].double()
            assert relative_error(got, expected) <= (1e-5 if dtype == torch.float64 else 3e-5), (name, dtype)
            assert expected.abs().max() > 1e-3 and expected[~real].abs().max() == 0
        assert_untouched(model, before)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hidden_maps_equal_the_naive_op_impulse_response_per_routed_sub_sequence(name):
    """H_h[t, s] = Σ_m w_{t,m} α^{b,m}_h[i(t), i(s)] (+ α^shared_h[t, s]), α^{b,m} from fla's naive gated delta rule
    on one-hot values over the op call's own inputs for the segment of (b, m), placed by fla's own layout."""
    model = make_model(name)
    ids = padded_batch(length=10)[0]
    batch, length = ids.shape
    with mc.fla_on_cpu(), LayoutRecorder(model) as layouts, OpRecorder(model, OPS) as ops, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    operators = list(mc.build_operators(model, ids, None, formulation="hidden")[0].values())
    calls = iter(ops.calls)
    for mixer, op in zip(layouts.mixers, operators):
        record = layouts.calls[mixer]
        tokens = routed_tokens(record, batch, length)
        _, kwargs, out = next(calls)  # the routed memories: one packed call, segments (m, b) for m, then b
        bounds = kwargs["cu_seqlens"].tolist()
        segments = [(b, m) for m in range(mixer.num_memories) for b in range(batch) if len(tokens[b, m][0])]
        assert len(segments) == len(bounds) - 1
        expected = torch.zeros(batch, mixer.num_heads, length, length, dtype=torch.float64)
        for (b, m), start, end in zip(segments, bounds, bounds[1:]):
            piece = {key: kwargs[key][:, start:end] for key in ("q", "k", "v", "g", "beta")}
            alpha = delta_rule_impulse({**piece, "use_qk_l2norm_in_kernel": True})[0]  # (H, n, n)
            positions, choices = tokens[b, m]
            weight = record["weights"][b, positions, choices].double()
            expected[b][:, positions[:, None], positions[None, :]] += weight[None, :, None] * alpha
            got_out = torch.einsum("hts,shp->thp", alpha, kwargs["v"][0, start:end].double())
            assert relative_error(got_out, out[0, start:end].double()) <= 1e-6
        if mixer.shared_mem:
            _, shared_kwargs, _ = next(calls)
            expected += delta_rule_impulse(shared_kwargs)
        got = op.maps(reduce=None)
        assert got.shape == expected.shape
        assert relative_error(got, expected) <= 1e-6, name
    assert next(calls, None) is None


def stable_argsort(self, dim=-1, descending=False, stable=False):
    return torch.sort(self, dim=dim, descending=descending, stable=True).indices


def test_fla_on_cpu_lays_out_each_memory_in_token_order_as_fla_would_with_a_stable_sort(monkeypatch):
    """fla's ``transform`` with a stable ``argsort`` and the library's torch version give the same layout, and each
    memory's tokens come in token order (fla's own CPU sort need not: test_the_layer_is_causal_inside_fla_on_cpu)."""
    from mamba_captum.fla_cpu.ops_mom import transform
    generator = torch.Generator().manual_seed(3)
    batch, length, memories, topk = 3, 40, 4, 2
    x = torch.randn(batch, length, 5, generator=generator, dtype=torch.float64)
    selected = torch.stack([torch.randperm(memories, generator=generator)[:topk] for _ in range(batch * length)])
    selected = selected.reshape(batch, length, topk)
    routing_mask = torch.zeros(batch, length, memories, dtype=torch.int).scatter(2, selected, 1)  # as fla builds it
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, :5] = False
    ours = transform(x, routing_mask.clone(), memories, selected, mask)
    monkeypatch.setattr(torch.Tensor, "argsort", stable_argsort)
    theirs = fla_mom_layer.transform(x, routing_mask.clone(), memories, selected, mask)
    for got, want in zip(ours, theirs):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))
    order = ours[2] // topk  # the token of each sorted copy
    keys = torch.arange(batch).repeat_interleave(length * topk)[ours[2]] * memories + selected.reshape(-1)[ours[2]]
    same_run = keys[1:] == keys[:-1]
    assert (order[1:][same_run] > order[:-1][same_run]).all()


def test_the_rebuild_orders_each_memory_as_the_layer_runs_it():
    """The rebuild's sub-sequences are the layer's (inside fla_on_cpu: each memory's tokens in token order), slot for
    slot, and its operators reproduce the layer."""
    from mamba_captum.families.fla_mom import routing
    model = make_model("mom", num_hidden_layers=1)
    ids, mask = padded_batch(length=12)
    inputs = {}
    with LayoutRecorder(model) as recorder:
        mixer = recorder.mixers[0]
        recorder.handles.append(mixer.register_forward_pre_hook(
            lambda mod, args, kwargs: inputs.update(h=kwargs["hidden_states"]), with_kwargs=True))
        with mc.fla_on_cpu(), torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    tokens = routed_tokens(recorder.calls[mixer], *ids.shape)
    weights, layout = routing(mixer, inputs["h"], mask)
    torch.testing.assert_close(weights, recorder.calls[mixer]["weights"], rtol=0, atol=0)
    for m, (positions, choices) in enumerate(layout):
        for b in range(ids.shape[0]):
            kept = positions[b] >= 0
            assert positions[b][kept].tolist() == tokens[b, m][0].tolist()
            assert positions[b][kept].tolist() == sorted(positions[b][kept].tolist())
            assert choices[b][kept].tolist() == tokens[b, m][1].tolist()
    for formulation in ("unified", "hidden"):
        errors = mc.build_operators(model, ids, mask, formulation=formulation)[2]
        assert max(errors.values()) <= 1e-12


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batch_equals_single_examples_and_left_padding_equals_none(name):
    model = make_model(name)
    for formulation in ("unified", "hidden"):
        assert_batch_equals_single_examples(model, *padded_batch(length=12), formulation=formulation)


def test_the_layer_is_causal_inside_fla_on_cpu():
    """Changing the last token leaves every earlier position's logits as they were (fla's unstable CPU sort broke
    this: 0.26 relative on a tiny model)."""
    model = make_model("mom")
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(5))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    with mc.fla_on_cpu(), torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits[:, :-1]
        after = model(input_ids=changed, use_cache=False).logits[:, :-1]
    assert relative_error(after, before) <= 1e-12


def test_reductions_rows_and_contributions_are_those_of_the_summed_parts():
    """maps(None) = Σ_p H_p; "mean" / "sum" / "abs_mean" its channel reductions (|·| of the sum); rows are rows of
    the full maps; contributions = Σ_p Σ_c g_c H_p,c x_p,c, whose rows add up to Σ_c g_c y_c."""
    model = make_model("mom", num_hidden_layers=1)
    ids, mask = padded_batch(length=12)
    for formulation in ("unified", "hidden"):
        (op,) = mc.build_operators(model, ids, mask, formulation=formulation)[0].values()
        parts = op.part_maps()
        summed = sum(H for H, _ in parts)
        assert summed.abs().max() > 1e-3
        torch.testing.assert_close(op.maps(None), summed, rtol=1e-12, atol=1e-14)
        for reduce, reduction in (("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1)),
                                  ("abs_mean", lambda t: t.abs().mean(1))):
            torch.testing.assert_close(op.maps(reduce), reduction(summed), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(op.maps(reduce, [9, 2, 11]), reduction(summed)[:, [9, 2, 11]], rtol=1e-12,
                                       atol=1e-14)
        g = torch.randn(op.output.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        per_value = g.flatten(2)
        expected = 0
        for H, x in parts:
            H = H.repeat_interleave(x.shape[-1] // H.shape[1], dim=1)
            expected = expected + torch.einsum("bic,bcij,bjc->bij", per_value, H, x)
        torch.testing.assert_close(op.contributions(g), expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(op.contributions(g, [3, 10]), expected[:, [3, 10]], rtol=1e-10, atol=1e-12)
        target = (g * op.output).flatten(2).sum(-1)
        assert relative_error(op.contributions(g).sum(-1), target) <= 1e-10
        assert op.value_channels == fla_mixers(model)[0].value_dim


def test_what_the_rebuild_cannot_follow_is_refused_by_name():
    ids, mask = padded_batch(length=8)
    model = make_model("mom", num_hidden_layers=1)
    model.train()
    with pytest.raises(NotImplementedError, match="training mode"):
        mc.implicit_attention(model, ids, attention_mask=mask)
    model.eval()
    mixer = fla_mixers(model)[0]
    with torch.no_grad():  # a value conv with a bias: the unified operator would be affine
        mixer.v_conv1d.bias = torch.nn.Parameter(torch.full((mixer.value_dim,), 0.3, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match="conv_bias"):
        mc.implicit_attention(model, ids, attention_mask=mask, formulation="unified")
    maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation="hidden")  # hidden: exact with it
    assert maps[0].shape == (2, 8, 8)


def test_a_training_step_runs_on_cpu_and_both_formulations_explain_it():
    model = make_model("mom")
    ids, mask = padded_batch(length=10)
    model.train()
    with mc.fla_on_cpu():
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in fla_mixers(model)[0].gate.parameters())
    model.eval()
    for formulation in ("unified", "hidden"):
        maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
        assert set(maps) == {0, 1} and maps[0].shape == (2, 10, 10) and torch.isfinite(maps[1]).all()
