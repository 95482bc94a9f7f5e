"""Zamba (v1): Mamba-1 heads with their own B, C, Δ. The operators reproduce each mixer (unified y = H x against the
test's own hooks, hidden α against the inputs HF's own scan received and unit impulses through it), reductions and
rows agree with the per-channel maps, gradient contributions with the maps, batches equal single examples, padding
equals no padding, the three methods run, and nothing is left on the model."""
import pytest
import torch
import transformers.models.zamba.modeling_zamba as modeling_zamba
from conftest import relative_error
from test_engine import assert_untouched, model_state
from tiny_models import VOCAB, make_model

import mamba_captum as mc
from mamba_captum.operators import ChannelBlocksOperator

TOL = 1e-5
OUT_PROJ_TOL = 3e-5  # the float32 model's own out_proj input, whose rounding reaches ~1e-5 (tests/test_identities)


def mixers(model):
    return [m for m in model.modules() if type(m).__name__ == "ZambaMambaMixer"]


def make(dtype=torch.float32, zero_bias_and_skip=False):
    """The tiny Zamba with its projections scaled up and Δ spread, so that every factor matters (a random init
    leaves the mixer outputs near zero)."""
    model = make_model("zamba", dtype=dtype, attn_implementation="sdpa")  # eager softmax: NaN rows at left pads
    with torch.no_grad():
        for mixer in mixers(model):
            mixer.in_proj.weight.mul_(10.0)
            mixer.conv1d.weight.mul_(10.0)
            mixer.x_proj_weight.mul_(10.0)
            mixer.dt_proj_bias.copy_(torch.linspace(-2.0, 1.5, mixer.dt_proj_bias.numel()).view_as(mixer.dt_proj_bias))
            if zero_bias_and_skip:  # the unified identity holds exactly without them (not attributed to tokens)
                mixer.conv1d.bias.zero_()
                mixer.D.zero_()
    return model


def padded_batch(length=12, pads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :pads], mask[0, :pads] = 0, 0  # left padding in the first example
    return ids, mask


def zamba_operators(model, ids, mask, formulation):
    operators, _, errors = mc.build_operators(model, ids, mask, formulation=formulation)
    return {k: op for k, op in operators.items() if isinstance(op, ChannelBlocksOperator)}, errors


def test_mixers_found_in_both_layer_kinds_with_per_head_pieces():
    model = make()
    ids, mask = padded_batch()
    operators, errors = zamba_operators(model, ids, mask, "unified")
    assert list(operators) == [0, 1, 2, 3]  # layers 1 and 3 are hybrid: the mixer at .mamba_decoder.mamba
    assert "1.shared_attention" in errors and "3.shared_attention" in errors
    for op in operators.values():
        assert len(op.parts) == 2 and op.channels == op.value_channels == 64
        assert (op.parts[0].B - op.parts[1].B).abs().max() > 1e-3  # each head has its own B, C, Δ
        assert (op.parts[0].C - op.parts[1].C).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unified_identity_out_proj_input_equals_H_x(dtype):
    model = make(dtype, zero_bias_and_skip=True)
    ids, mask = padded_batch()
    records, handles = {}, []
    for mixer in mixers(model):  # in_proj's output interleaves x (even channels) and the gate z (odd channels)
        handles.append(mixer.in_proj.register_forward_hook(
            lambda mod, args, out, mixer=mixer: records.setdefault(mixer, {}).update(x=out[..., 0::2].detach())))
        handles.append(mixer.out_proj.register_forward_pre_hook(
            lambda mod, args, mixer=mixer: records.setdefault(mixer, {}).update(out_in=args[0].detach())))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in handles:
        h.remove()
    operators, _ = zamba_operators(model, ids, mask, "unified")
    assert len(operators) == len(mixers(model)) == 4
    for mixer, (key, op) in zip(mixers(model), operators.items()):
        H = op.maps(reduce=None).double()  # (B, D_in, L, L)
        got = torch.einsum("bcis,bsc->bic", H, records[mixer]["x"].double())
        expected = records[mixer]["out_in"].double()
        assert relative_error(got, expected) <= (TOL if dtype == torch.float64 else OUT_PROJ_TOL), key
        assert relative_error(op.output, expected) <= TOL, key
        assert expected.abs().max() > 1e-1  # not vacuous


class ScanRecorder:
    """Patch Zamba's module-level ``mamba_selective_scan`` (one call per head): record its arguments and its output
    without the D skip and the gate."""

    def __init__(self):
        self.original = modeling_zamba.mamba_selective_scan
        self.calls = []

    def __enter__(self):
        def recording(*args, **kwargs):
            self.calls.append((args, kwargs, self.original(*args, **dict(kwargs, D=None, z=None))))
            return self.original(*args, **kwargs)

        modeling_zamba.mamba_selective_scan = recording
        return self

    def __exit__(self, *exc):
        modeling_zamba.mamba_selective_scan = self.original

    def impulse_alpha(self, call):
        """α of one head, column by column: unit impulses through HF's own scan with the recorded Δ, B, C.
        (B, P, L, L)."""
        args, kwargs, _ = call
        u, delta, A, B, C = args[:5]
        length, width = u.shape[-1], u.shape[1]
        maps = []
        for b in range(u.shape[0]):
            impulses = torch.eye(length, dtype=u.dtype)[:, None, :].expand(length, width, length)
            rep = lambda t: t[b:b + 1].expand(length, *t.shape[1:])  # noqa: E731
            out = self.original(impulses, rep(delta), A, rep(B), rep(C), **dict(kwargs, D=None, z=None))
            maps.append(out.permute(1, 2, 0))  # (j, P, i) -> (P, i, j)
        return torch.stack(maps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hidden_identity_against_the_scans_own_inputs(dtype):
    model = make(dtype)
    ids, mask = padded_batch()
    with ScanRecorder() as recorder, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    operators, _ = zamba_operators(model, ids, mask, "hidden")
    heads = mixers(model)[0].n_mamba_heads
    assert len(recorder.calls) == heads * len(operators)
    keep = (mask[:, None, :, None] * mask[:, None, None, :]).double()  # pads: zero rows and columns
    for index, (key, op) in enumerate(operators.items()):
        calls = recorder.calls[index * heads:(index + 1) * heads]
        alpha = op.maps(reduce=None).double()  # (B, D_in, L, L), heads' channels in order
        u = torch.cat([c[0][0] for c in calls], dim=1).double()  # (B, D_in, L)
        pure = torch.cat([c[2] for c in calls], dim=1).double()
        assert relative_error(torch.einsum("bcij,bcj->bci", alpha, u), pure) <= TOL, key
        assert relative_error(op.output.transpose(1, 2), pure) <= TOL, key
        reference = torch.cat([recorder.impulse_alpha(c) for c in calls], dim=1).double() * keep
        assert relative_error(alpha, reference) <= TOL, key
        assert pure.abs().max() > 1e-1  # not vacuous


@pytest.mark.parametrize("formulation", ["unified", "hidden"])
def test_reductions_rows_and_batches(formulation):
    model = make()
    ids, mask = padded_batch()
    full = mc.implicit_attention(model, ids, mask, formulation=formulation, reduce=None)
    assert full[0].shape == (2, 64, 12, 12)
    rows = [0, -1, 5, 5]
    for reduce, fn in (("mean", lambda t: t.mean(1)), ("sum", lambda t: t.sum(1)),
                       ("abs_mean", lambda t: t.abs().mean(1))):
        reduced = mc.implicit_attention(model, ids, mask, formulation=formulation, reduce=reduce)
        some = mc.implicit_attention(model, ids, mask, formulation=formulation, reduce=reduce, rows=rows)
        per_channel = mc.implicit_attention(model, ids, mask, formulation=formulation, reduce=None, rows=rows)
        assert reduced.keys() == full.keys() == some.keys()
        for key in full:
            expected = fn(full[key])
            scale = max(1.0, expected.abs().max().item())
            assert (reduced[key] - expected).abs().max() <= 1e-6 * scale, (key, reduce)
            assert (some[key] - reduced[key][:, [0, 11, 5, 5]]).abs().max() <= 1e-6 * scale, (key, reduce)
            assert (per_channel[key] - full[key][..., [0, 11, 5, 5], :]).abs().max() <= 1e-6 * scale, key
    # the batch equals its examples one by one (the padded one without its pads)
    single = mc.implicit_attention(model, ids[1:], formulation=formulation)
    unpadded = mc.implicit_attention(model, ids[:1, 3:], formulation=formulation)
    batched = mc.implicit_attention(model, ids, mask, formulation=formulation)
    for key in batched:
        assert relative_error(batched[key][1], single[key][0]) <= 1e-5, key
        assert relative_error(batched[key][0, 3:, 3:], unpadded[key][0]) <= 1e-4, key
        assert batched[key][0, :3].abs().max() == 0 and batched[key][0, :, :3].abs().max() == 0


@pytest.mark.parametrize("formulation", ["unified", "hidden"])
def test_contributions_are_gradient_times_maps_times_values(formulation):
    model = make(torch.float64)
    ids, mask = padded_batch()
    operators, _ = zamba_operators(model, ids, mask, formulation)
    g = torch.Generator().manual_seed(1)
    for key, op in operators.items():
        grad = torch.randn(op.output.shape, generator=g, dtype=torch.float64)
        values = torch.cat([part.values for part in op.parts], dim=-1)  # (B, L, D_in)
        expected = torch.einsum("bic,bcij,bjc->bij", grad, op.maps(None), values)
        assert relative_error(op.contributions(grad), expected) <= 1e-10, key
        assert relative_error(op.contributions(grad, torch.tensor([11, 4])), expected[:, [11, 4]]) <= 1e-10, key


def test_every_method_runs_and_leaves_the_model_untouched():
    model = make()
    before = model_state(model)
    ids, mask = padded_batch()
    for method in (mc.MambaRawAttention, mc.MambaRollout, mc.MambaAttribution):
        relevance = method(model).attribute(ids, additional_forward_args=(mask,), start_layer=0)
        assert relevance.shape == (2, 12) and torch.isfinite(relevance).all()
        assert relevance[0, :3].abs().max() == 0  # pads get nothing
        assert relevance[0, 3:].abs().max() > 0 and relevance[1].abs().max() > 0
    assert_untouched(model, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_scans_swap_zambas_scan_and_keep_its_output(dtype):
    model = make(dtype)
    ids, mask = padded_batch()
    original = modeling_zamba.mamba_selective_scan
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with mc.fast_scans(model):
            assert modeling_zamba.mamba_selective_scan is not original
            got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert modeling_zamba.mamba_selective_scan is original
    keep = mask[:, :, None].bool()
    # float64: HF's own scan rounds B and u to float32 (measured 9e-8), the chunked scan does not
    assert relative_error(got * keep, expected * keep) <= (1e-5 if dtype == torch.float32 else 1e-6)
