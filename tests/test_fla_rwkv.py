"""flash-linear-attention's RWKV-7 and RWKV-6 on CPU and explained (mamba_captum.fla_cpu.ops / ops_rwkv,
mamba_captum.families.fla_rwkv7 / fla_rwkv6, operators.DPLRCore).

The RWKV-7 op swaps against fla's own torch reference of the generalized delta rule (``dplr_recurrence``, run in
float64: its ``.float()`` casts are made no-ops for the call), outputs, final states and gradients; the fused helpers
against fla's ``*_ref`` functions; RWKV-6's ops against fla's ``naive_recurrent_rwkv6``; the layers' operators against
the test's own hooks and the core ops' impulse responses (an independent per-token recurrence for RWKV-7, fla's naive
op for RWKV-6): hidden α = the core op's impulse response, unified ``o_proj input = H x + offset`` (the group norm's
mean and bias), batches = single examples, left padding = none; a training step inside ``fla_on_cpu()``.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
from fla.ops.rwkv7.fused_k_update import k_update_ref
from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref
from fla_models import assert_batch_equals_single_examples, common_config, fla_mixers, fla_models, padded_batch
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from mamba_captum.fla_cpu import ops, ops_rwkv
from mamba_captum.kernels.dplr import dplr_alpha
from mamba_captum.operators import DPLRCore

B, L, H, K, V = 2, 70, 2, 4, 3  # L crosses the kernel's 64-token chunk


def rand(*shape, generator):
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def rwkv7_inputs(seed=0, length=L):
    """r, w (log decays in (−0.61, 0)), k, v, kk (unit per head), a (in (0, 1)), h0: fla's layout, float64."""
    g = torch.Generator().manual_seed(seed)
    r, k, v = rand(B, length, H, K, generator=g), rand(B, length, H, K, generator=g), rand(B, length, H, V, generator=g)
    w = -0.6065 * torch.rand(B, length, H, K, generator=g, dtype=torch.float64)
    kk = F.normalize(rand(B, length, H, K, generator=g), dim=-1)
    a = torch.rand(B, length, H, K, generator=g, dtype=torch.float64)
    return dict(r=r, w=w, k=k, v=v, kk=kk, a=a, h0=rand(B, H, K, V, generator=g))


@contextlib.contextmanager
def float64_reference():
    """fla's naive references cast their inputs with ``.float()``; for a float64 comparison the cast keeps float64."""
    original = torch.Tensor.float
    torch.Tensor.float = lambda self, *args, **kwargs: self if self.dtype == torch.float64 else original(self)
    try:
        yield
    finally:
        torch.Tensor.float = original


def fla_dplr(q, k, v, a, b, gk, h0, scale):
    """fla's ``dplr_recurrence`` (head-first, scale fixed at K^−½) in fla's (B, T, H, ·) layout with ``scale``."""
    head_first = lambda t: t.transpose(1, 2)  # noqa: E731
    q = q * (scale / q.shape[-1] ** -0.5)
    with float64_reference():
        o, state = dplr_recurrence(*(head_first(t) for t in (q, k, v, a, b, gk)), initial_state=h0)
    return head_first(o), state


def assert_same_with_gradients(ours, reference, inputs, float32_gradients=()):
    """Outputs and final states equal (float64), and the gradients of a random projection of both (those of
    ``float32_gradients`` to float32's rounding: the reference passes them through a float32 tensor)."""
    g = torch.Generator().manual_seed(1)
    for got, want in zip(ours, reference):
        assert relative_error(got, want) <= 1e-12
    probes = [rand(*t.shape, generator=g) for t in reference]
    loss = lambda outs: sum((p * o).sum() for p, o in zip(probes, outs))  # noqa: E731
    grads = torch.autograd.grad(loss(ours), inputs, retain_graph=True)
    expected = torch.autograd.grad(loss(reference), inputs)
    for tensor, got, want in zip(inputs, grads, expected):
        assert relative_error(got, want) <= (1e-6 if any(tensor is t for t in float32_gradients) else 1e-10)


def leaves(x, names):
    return [x[n].clone().requires_grad_(True) for n in names]


def test_chunk_rwkv7_equals_fla_reference_with_the_layers_arguments():
    x = rwkv7_inputs()
    r, w, k, v, kk, a, h0 = leaves(x, ["r", "w", "k", "v", "kk", "a", "h0"])
    # exactly as RWKV7Attention calls it (scale 1, the log-decay lower bound and fla's tile hints)
    ours = ops.chunk_rwkv7(r=r, w=w, k=k, v=v, a=-kk, b=kk * a, scale=1.0, initial_state=h0, output_final_state=True,
                           safe_gate=True, lower_bound=-0.6065306597126334, chunk_size=64)
    reference = fla_dplr(r, k, v, -kk, kk * a, w, h0, scale=1.0)
    assert_same_with_gradients(ours, reference, [r, w, k, v, kk, a, h0])
    default = ops.chunk_rwkv7(r, w, k, v, -kk, kk * a, initial_state=h0)[0]  # fla's default scale is 1 as well
    assert relative_error(default, reference[0]) <= 1e-12
    with pytest.raises(ValueError, match="lower_bound"):
        ops.chunk_rwkv7(r, w, k, v, -kk, kk * a, lower_bound=0.5)


def test_fused_mul_recurrent_rwkv7_equals_fla_reference():
    x = rwkv7_inputs(length=12)
    r, w, k, v, kk, a, h0 = leaves(x, ["r", "w", "k", "v", "kk", "a", "h0"])
    ours = ops_rwkv.fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, scale=1.0, initial_state=h0, output_final_state=True)
    reference = fla_dplr(r, k, v, -kk, kk * a, w, h0, scale=1.0)
    assert_same_with_gradients(ours, reference, [r, w, k, v, kk, a, h0])
    with pytest.raises(NotImplementedError, match="reverse"):
        ops_rwkv.fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, reverse=True)


@pytest.mark.parametrize("op", ["fused_recurrent_rwkv7", "chunk_dplr_delta_rule", "fused_recurrent_dplr_delta_rule"])
def test_default_scale_is_inverse_sqrt_K_as_fla(op):
    """fused_recurrent_rwkv7 and the DPLR ops default to scale = K^−½ (fla: ``q.shape[-1] ** -0.5``)."""
    x = rwkv7_inputs(seed=2)
    q, w, k, v, kk, a, h0 = leaves(x, ["r", "w", "k", "v", "kk", "a", "h0"])
    b = kk * a
    if op == "fused_recurrent_rwkv7":
        ours = ops.fused_recurrent_rwkv7(q, w, k, v, -kk, b, initial_state=h0)
    else:
        ours = getattr(ops, op)(q, k, v, -kk, b, w, initial_state=h0, output_final_state=True)
    reference = fla_dplr(q, k, v, -kk, b, w, h0, scale=K ** -0.5)
    assert_same_with_gradients(ours, reference, [q, w, k, v, kk, a, h0])


def test_packed_sequences_equal_each_sequence_alone():
    x = rwkv7_inputs(seed=3)
    r, w, k, v, kk, a = (x[n][:1] for n in ("r", "w", "k", "v", "kk", "a"))
    bounds = torch.tensor([0, 5, 40, L])
    states = x["h0"][:1].expand(3, H, K, V).contiguous()
    for run in (lambda s, e, h, c: ops.chunk_rwkv7(r[:, s:e], w[:, s:e], k[:, s:e], v[:, s:e], -kk[:, s:e],
                                                   (kk * a)[:, s:e], initial_state=h, output_final_state=True,
                                                   cu_seqlens=c),
                lambda s, e, h, c: ops_rwkv.fused_mul_recurrent_rwkv7(r[:, s:e], w[:, s:e], k[:, s:e], v[:, s:e],
                                                                      kk[:, s:e], a[:, s:e], initial_state=h,
                                                                      output_final_state=True, cu_seqlens=c)):
        packed, packed_states = run(0, L, states, bounds)
        for n, (start, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            alone, state = run(start, end, states[n:n + 1], None)
            assert relative_error(packed[:, start:end], alone) <= 1e-13
            assert relative_error(packed_states[n:n + 1], state) <= 1e-13


def test_fused_helpers_equal_fla_references():
    g = torch.Generator().manual_seed(4)
    hidden, delta = rand(2, 5, 8, generator=g).requires_grad_(), rand(2, 5, 8, generator=g).requires_grad_()
    mixes = [rand(1, 1, 8, generator=g).requires_grad_() for _ in range(6)]
    for xg in (mixes[5], None):
        ours = [t for t in ops_rwkv.fused_addcmul_rwkv7(hidden, delta, *mixes[:5], xg) if t is not None]
        reference = [t for t in torch_addcmul_rwkv7(hidden, delta, *mixes[:5], xg) if t is not None]
        assert len(ours) == (6 if xg is not None else 5)
        assert_same_with_gradients(ours, reference, [hidden, delta, *mixes[:5]])
    k, a, ka = rand(2, 5, 8, generator=g).requires_grad_(), torch.rand(2, 5, 8, dtype=torch.float64), rand(8,
                                                                                                          generator=g)
    a.requires_grad_()
    ka.requires_grad_()
    assert_same_with_gradients([ops_rwkv.fused_k_rwkv7(k, a, ka)], [k_update_ref(k, a, ka)], [k, a, ka])
    o, g_out = rand(2, 5, 6, generator=g).requires_grad_(), rand(2, 5, 6, generator=g).requires_grad_()
    r, k, r_k = (rand(*s, generator=g).requires_grad_() for s in ((2, 5, 2, 4), (2, 5, 2, 4), (2, 4)))
    v = rand(2, 5, 2, 3, generator=g).requires_grad_()
    assert_same_with_gradients([ops_rwkv.gate_output_correction(o, r, k, r_k, v, g_out)],
                               [gate_output_correction_ref(o, r, k, r_k, v, g_out)], [o, r, k, r_k, v, g_out])


def test_squared_relu_swap_is_relu_squared_with_its_gradient():
    from fla.modules.activations.ops import sqrelu
    x = torch.tensor([-2.0, -0.5, 0.0, 0.25, 3.0], dtype=torch.float64, requires_grad=True)
    with mc.fla_on_cpu():
        y = sqrelu(x)
        (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, F.relu(x.detach()) ** 2, rtol=0, atol=0)
    torch.testing.assert_close(grad, 2 * F.relu(x.detach()), rtol=0, atol=0)


def test_dplr_core_rows_diagonal_and_channel_scale():
    x = rwkv7_inputs(seed=5, length=9)
    g = torch.Generator().manual_seed(6)
    q, k, read, write, w = x["r"], x["k"], -x["kk"], x["kk"] * x["a"], x["w"]
    diagonal, channel_scale = rand(B, 9, H, generator=g), rand(B, 9, H, V, generator=g)
    alpha = dplr_alpha(q, k, read, write, w, scale=1.0)  # (B, H, L, L)
    eye = torch.eye(9, dtype=torch.float64)
    plain = DPLRCore(q, k, read, write, w).full()
    assert relative_error(plain, alpha) <= 1e-13
    bonus = DPLRCore(q, k, read, write, w, diagonal=diagonal).full()
    assert relative_error(bonus, alpha + diagonal.permute(0, 2, 1)[..., None] * eye) <= 1e-13
    per_channel = DPLRCore(q, k, read, write, w, diagonal=diagonal, channel_scale=channel_scale).full()
    expected = channel_scale.permute(0, 2, 3, 1)[..., None] * alpha[:, :, None] \
        + diagonal.permute(0, 2, 1)[:, :, None, :, None] * eye  # (B, H, P, L, L)
    assert relative_error(per_channel, expected.flatten(1, 2)) <= 1e-13
    rows = torch.tensor([8, 0, 4])
    assert relative_error(DPLRCore(q, k, read, write, w, diagonal=diagonal, channel_scale=channel_scale).rows(1, rows),
                          expected.flatten(1, 2)[1][:, rows]) <= 1e-13


# -- the layers -----------------------------------------------------------------------------------------------------
# name -> the tiny model's config, the layer's module and core ops, and its output gate: (submodule, activation)
MODELS = {
    "rwkv7": dict(config=("RWKV7Config", dict(head_dim=8, decay_low_rank_dim=8, gate_low_rank_dim=8, a_low_rank_dim=8,
                                              v_low_rank_dim=8)),
                  module="fla.layers.rwkv7", ops=("chunk_rwkv7", "fused_mul_recurrent_rwkv7"), gate="g_lora"),
    "rwkv6": dict(config=("RWKV6Config", dict(num_heads=2, expand_k=0.5, expand_v=1.0, proj_low_rank_dim=8,
                                              gate_low_rank_dim=8)),
                  module="fla.layers.rwkv6", ops=("chunk_rwkv6", "fused_recurrent_rwkv6"), gate="g_proj"),
}


def make_model(name, dtype=torch.float64, seed=0, **overrides):
    """A tiny random RWKV-7 (4 heads of 8) or RWKV-6 (2 heads of 8 key, 16 value channels), every parameter of its
    attention perturbed so that each factor of the operator matters (the group norm's weight and bias differ per
    channel)."""
    config_class, kwargs = MODELS[name]["config"]
    config = getattr(fla_models, config_class)(**common_config(**{**kwargs, **overrides}))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mixer in fla_mixers(model):
            for parameter in mixer.parameters():
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64).to(dtype)
                if parameter.dim() == 2:
                    parameter.copy_(0.4 * noise)
                else:
                    parameter.add_(0.3 * noise)
    return model


class CoreRecorder:
    """Records the layers' core op calls (op names, arguments, output), the output gate act(g) (RWKV-7: g itself,
    RWKV-6: swish of g_proj), and o_proj's input and output (the mixer's)."""

    def __init__(self, name, model):
        self.model, self.module = model, importlib.import_module(MODELS[name]["module"])
        self.ops, self.gate, self.activation = MODELS[name]["ops"], MODELS[name]["gate"], F.silu
        if name == "rwkv7":
            self.activation = lambda g: g  # noqa: E731
        self.names, self.calls, self.gates, self.out_in, self.outputs = [], [], [], [], []
        self.saved, self.handles = [], []

    def __enter__(self):
        for name in self.ops:
            original = getattr(self.module, name)

            def recording(*args, _original=original, _name=name, **kwargs):
                out = _original(*args, **kwargs)
                self.names.append(_name)
                self.calls.append((inspect.signature(_original).bind(*args, **kwargs).arguments, out[0]))
                return out

            self.saved.append((name, original))
            setattr(self.module, name, recording)
        for mixer in fla_mixers(self.model):
            self.handles.append(mixer.get_submodule(self.gate).register_forward_hook(
                lambda mod, args, out: self.gates.append(self.activation(out.detach().double()))))
            self.handles.append(mixer.o_proj.register_forward_pre_hook(
                lambda mod, args: self.out_in.append(args[0].detach())))
            self.handles.append(mixer.o_proj.register_forward_hook(
                lambda mod, args, out: self.outputs.append(out.detach())))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        for name, original in reversed(self.saved):
            setattr(self.module, name, original)


def recurrence_impulse(call):
    """α (B, H, T, T) of a recorded RWKV-7 core call by the per-token recurrence S ← diag(e^w) S + b (aᵀ S) + k vᵀ,
    o = scale · Sᵀ r, run on one-hot values (the output for v = e_s is column s), zero state."""
    if "kk" in call:
        read, write = -call["kk"].double(), (call["kk"] * call["a"]).double()
    else:
        read, write = call["a"].double(), call["b"].double()
    r, w, k = call["r"].double(), call["w"].double(), call["k"].double()
    scale = call.get("scale", 1.0)
    batch, length, heads, dim = r.shape
    state = torch.zeros(batch, heads, dim, length, dtype=torch.float64)
    rows = []
    for t in range(length):
        onehot = torch.zeros(length, dtype=torch.float64)
        onehot[t] = 1
        state = state * w[:, t].exp()[..., None] + write[:, t, :, :, None] * (read[:, t, :, :, None] * state).sum(
            -2, keepdim=True) + k[:, t, :, :, None] * onehot
        rows.append(scale * torch.einsum("bhk,bhks->bhs", r[:, t], state))
    return torch.stack(rows, dim=2)


def rwkv6_impulse(call):
    """α (B, H, T, T) of a recorded RWKV-6 core call through fla's ``naive_recurrent_rwkv6`` (float64) on one-hot
    values."""
    from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6
    r, k, w = (call[n].double().transpose(1, 2) for n in ("r", "k", "w"))
    batch, heads, length, _ = r.shape
    eye = torch.eye(length, dtype=torch.float64)[None, None].expand(batch, heads, length, length)
    with float64_reference():
        out, _ = naive_recurrent_rwkv6(r, k, eye, w, call["u"].double(), scale=call["scale"])
    return out


def impulse(name, call):
    return recurrence_impulse(call) if name == "rwkv7" else rwkv6_impulse(call)


def operators(model, ids, mask, formulation, **kwargs):
    built, _, _ = mc.build_operators(model, ids, mask, formulation=formulation, **kwargs)
    return list(built.values())


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("length", [10, 66])  # the recurrent ops up to 64 tokens, the chunked ones beyond
def test_hidden_maps_equal_the_core_ops_impulse_response(name, length):
    model = make_model(name)
    ids = padded_batch(length=length)[0]
    with mc.fla_on_cpu(), CoreRecorder(name, model) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    built = operators(model, ids, None, "hidden")
    assert len(recorder.calls) == len(built) == 2
    assert set(recorder.names) == {MODELS[name]["ops"][0 if length > 64 else 1]}
    for op, (call, out) in zip(built, recorder.calls):
        alpha = op.maps(reduce=None)  # (B, H, L, L)
        assert relative_error(alpha, impulse(name, call)) <= 1e-9
        got = torch.einsum("bhts,bshp->bthp", alpha, call["v"].double())
        assert relative_error(got, out.double()) <= 1e-9


def test_impulse_recurrence_agrees_with_fla_reference():
    """The test's recurrence is fla's ``dplr_recurrence`` on one-hot values (so the hidden reference is fla's rule)."""
    x = rwkv7_inputs(seed=7, length=9)
    call = dict(r=x["r"], w=x["w"], k=x["k"], kk=x["kk"], a=x["a"], scale=1.0)
    eye = torch.eye(9, dtype=torch.float64)[None, :, None, :].expand(B, 9, H, 9)
    out, _ = fla_dplr(x["r"], x["k"], eye, -x["kk"], x["kk"] * x["a"], x["w"], None, scale=1.0)
    assert relative_error(recurrence_impulse(call), out.permute(0, 2, 1, 3)) <= 1e-13


@pytest.mark.parametrize("op", ["chunk_rwkv6", "fused_recurrent_rwkv6"])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_rwkv6_ops_equal_fla_reference(op, scale):
    from fla.ops.rwkv6.recurrent_naive import naive_recurrent_rwkv6
    x = rwkv7_inputs(seed=8)
    # fla's reference adds h0 into a float32 state: float32 values stay exact (its gradient is rounded to float32)
    x["h0"] = x["h0"].float().double()
    r, w, k, v, h0 = leaves(x, ["r", "w", "k", "v", "h0"])
    u = x["a"][0, 0].clone().requires_grad_(True)  # (H, K)
    ours = getattr(ops, op)(r, k, v, w, u, scale=scale, initial_state=h0, output_final_state=True)
    with float64_reference():
        o, state = naive_recurrent_rwkv6(*(t.transpose(1, 2) for t in (r, k, v, w)), u, scale=scale,
                                         initial_state=h0, output_final_state=True)
    assert_same_with_gradients(ours, (o.transpose(1, 2), state), [r, w, k, v, u, h0], float32_gradients=(h0,))


def group_norm_offset(mixer, o, gate):
    """act(g) ⊙ (b − w s μ): the share of o_proj's input that the unified operator leaves to its readout, from the
    recorded core output o (B, L, H, P) and gate (B, L, H·P), by the norm's definition."""
    o = o.double()
    mean = o.mean(-1, keepdim=True)
    inverse = 1 / torch.sqrt(o.var(-1, unbiased=False, keepdim=True) + mixer.g_norm.eps)
    weight, bias = (t.double().reshape(o.shape[-2:]) for t in (mixer.g_norm.weight, mixer.g_norm.bias))
    return gate * (bias - weight * inverse * mean).flatten(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("name", "overrides"), [("rwkv7", dict(fuse_norm=True)), ("rwkv7", dict(fuse_norm=False)),
                                                 ("rwkv6", {})])
def test_unified_identity_out_proj_input_equals_H_x_plus_the_norms_offset(name, overrides, dtype):
    model = make_model(name, dtype, **overrides)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    built = operators(model, ids, mask, "unified")
    with mc.fla_on_cpu(), CoreRecorder(name, model) as recorder, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    mixers = fla_mixers(model)
    assert len(built) == len(mixers) == len(recorder.calls) == 2
    tolerance = 1e-10 if dtype == torch.float64 else 3e-5
    for mixer, op, (call, out), gate, expected, mixer_output in zip(mixers, built, recorder.calls, recorder.gates,
                                                                    recorder.out_in, recorder.outputs):
        x = call["v"].double().flatten(2)  # the values as the core sees them (RWKV-7: after the value residual)
        H = op.maps(reduce=None).double()  # (B, C, L, L), one map per value channel
        from_values = torch.einsum("bcis,bsc->bic", H, x)
        assert relative_error(from_values + group_norm_offset(mixer, out, gate), expected) <= tolerance
        assert from_values.abs().max() > 1e-2
        # the operator's output is H x, and its readout adds the offset and o_proj: the mixer's output
        assert relative_error(op.output.double().flatten(2), from_values) <= tolerance
        assert relative_error(op.readout(op.output.double()), mixer_output) <= tolerance
    assert_untouched(model, before)


@pytest.mark.parametrize("name", list(MODELS))
def test_unified_without_the_norm_is_gate_times_core(name):
    """components without "norm": one core per head, H_c = diag(act(g_c)) α_h, with RWKV-7's bonus β = Σ r ⊙ k ⊙ r_k
    on α_h's diagonal (RWKV-6's bonus u is inside its core op)."""
    model = make_model(name)
    ids = padded_batch(length=10)[0]
    built = operators(model, ids, None, "unified", components=("s6", "gate"))
    with mc.fla_on_cpu(), CoreRecorder(name, model) as recorder, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for mixer, op, (call, _), gate in zip(fla_mixers(model), built, recorder.calls, recorder.gates):
        core = impulse(name, call)  # (B, H, L, L)
        if name == "rwkv7":
            bonus = (call["r"] * call["k"] * mixer.r_k).sum(-1).double()  # (B, L, H)
            core = core + bonus.permute(0, 2, 1)[..., None] * torch.eye(10, dtype=torch.float64)
        heads = core.shape[1]
        g = gate.reshape(*gate.shape[:2], heads, -1).permute(0, 2, 3, 1)  # (B, H, P, L)
        expected = (g[..., None] * core[:, :, None]).flatten(1, 2)
        assert relative_error(op.maps(reduce=None), expected) <= 1e-10


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("formulation", ["hidden", "unified"])
def test_batch_equals_single_examples_and_left_padding_equals_none(name, formulation):
    assert_batch_equals_single_examples(make_model(name), *padded_batch(length=12), formulation=formulation)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_on_cpu_chunked_and_recurrent_paths_agree(name):
    """Inside fla_on_cpu() a train-mode forward over 70 tokens (the chunked op) and its backward run, and give the
    logits of the recurrent op (eval, no gradients, the first 12 tokens); every attention parameter gets a
    gradient."""
    model = make_model(name)
    ids = padded_batch(length=70)[0]
    with mc.fla_on_cpu():
        with torch.no_grad():
            recurrent = model(input_ids=ids[:, :12], use_cache=False).logits
        model.train()
        try:
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
        finally:
            model.eval()
    assert relative_error(out.logits.detach()[:, :12], recurrent) <= 1e-12
    for parameter_name, parameter in fla_mixers(model)[1].named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), parameter_name
        assert parameter.grad.abs().max() > 0, parameter_name
    assert math.isfinite(out.loss.item())
