"""flash-linear-attention's Mamba layers (mamba_captum.families.fla_mamba, fla_mamba2) on a CPU.

fla's Mamba and Mamba2 run their own torch paths on a CPU; what they hold of fla's Triton functions (the SiLU, the
gated norm) is exact inside fla_on_cpu(), and the models train there with transformers' gradients. The operators' maps equal references built here from the layer's own recorded tensors (hooks on its
projections and conv): α by a per-token recurrence on one-hot inputs, H = diag(row) α diag(col) M with the conv band
M built from the taps; and those references reproduce the real layer's output (the identity y = H x + the conv
bias's and the D skip's shares). fla's torch path computes in float32 inside a float64 model (A from
``A_log.float()``; Mamba-2's SSD from ``.float()`` inputs), hence the 1e-5 bound wherever the real output enters.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from conftest import relative_error
from fla_models import VOCAB, fla_mixers, fla_models, padded_batch, run_hooked
from test_engine import assert_untouched, model_state
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from mamba_captum.families import fla_mamba

CONFIGS = {
    # in_proj's bias on: fla zeroes the pads' conv input after in_proj (the pads' bias must not reach the conv)
    "mamba": ("MambaConfig", dict(state_size=4, expand=2, use_bias=True)),
    # two groups of B, C: fla's torch path gives head h group h mod G
    "mamba2": ("Mamba2Config", dict(head_dim=8, state_size=4, expand=2, n_groups=2, chunk_size=4, use_bias=True)),
    "mamba2_norm_first": ("Mamba2Config", dict(head_dim=8, state_size=4, expand=2, n_groups=2, chunk_size=4,
                                               norm_before_gate=True, D_has_hdim=True)),
    "mamba2_no_norm": ("Mamba2Config", dict(head_dim=8, state_size=4, expand=2, chunk_size=4, rmsnorm=False)),
}
NAMES = list(CONFIGS)
REAL = 1e-5  # where fla's own float32 arithmetic enters (see the module docstring)


def config_of(config_class: str, **kwargs):
    return getattr(fla_models, config_class)(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0,
                                             bos_token_id=1, eos_token_id=2, fuse_cross_entropy=False, **kwargs)


def scaled_up(model, seed: int = 0):
    """The mixers' weights drawn large enough that every factor matters (fla's init leaves B, C tiny), their biases
    and skips random."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mixer in fla_mixers(model):
            for name, parameter in mixer.named_parameters():
                if (parameter.dim() == 2 and name.endswith("weight")) or name == "conv1d.weight":
                    parameter.normal_(0.0, 0.4, generator=generator)
                elif name in ("conv1d.bias", "in_proj.bias", "out_proj.bias"):
                    parameter.normal_(0.0, 0.3, generator=generator)
                elif name == "norm.weight":
                    parameter.uniform_(0.5, 1.5, generator=generator)
                elif name == "D":
                    parameter.normal_(0.0, 0.2, generator=generator)
    return model


def make_model(name: str, dtype=torch.float64, seed: int = 0):
    config_class, kwargs = CONFIGS[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_of(config_class, **kwargs)).to(dtype).eval()
    return scaled_up(model, seed)


# -- the references ---------------------------------------------------------------------------------------------------
def impulse_alpha(delta, A, B, C):
    """α (b, H, L, L) of h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t x_t, y_t = C_t · h_t, token by token on one-hot inputs
    (one state per source token). delta (b, L, H); A (H, N); B, C (b, L, H, N)."""
    batch, length, heads = delta.shape
    state = torch.zeros(batch, heads, length, A.shape[-1], dtype=torch.float64)
    alpha = torch.zeros(batch, heads, length, length, dtype=torch.float64)
    for t in range(length):
        state = torch.exp(delta[:, t, :, None] * A)[:, :, None, :] * state
        state[:, :, t, :] = delta[:, t, :, None] * B[:, t]
        alpha[:, :, t, :] = torch.einsum("bhjn,bhn->bhj", state, C[:, t])
    return alpha


def conv_band(taps, length):
    """M (C, L, L) of a causal depthwise conv: M_c[j, s] = taps[c, K−1−(j−s)] for 0 ≤ j−s < K."""
    kernel = taps.shape[-1]
    band = torch.zeros(taps.shape[0], length, length, dtype=torch.float64)
    for j in range(length):
        for lag in range(min(kernel, j + 1)):
            band[:, j, j - lag] = taps[:, kernel - 1 - lag]
    return band


def record(model, ids, mask):
    """What each mixer's submodules saw and gave, by the test's own hooks (fla_on_cpu, no grad)."""
    records, handles = [], []
    for mixer in fla_mixers(model):
        seen = {}
        records.append((mixer, seen))

        def keep(name, output=True, seen=seen):
            def hook(module, args, out=None):
                value = out if output else args
                seen[name] = tuple(v.detach() for v in value) if isinstance(value, tuple) else value.detach()
            return hook

        handles.append(mixer.in_proj.register_forward_hook(keep("in_proj")))
        handles.append(mixer.conv1d.register_forward_hook(keep("conv")))
        handles.append(mixer.out_proj.register_forward_pre_hook(keep("out_in", output=False)))
        if hasattr(mixer, "x_proj"):
            handles.append(mixer.x_proj.register_forward_hook(keep("x_proj")))
            handles.append(mixer.dt_proj.register_forward_hook(keep("dt_proj")))
    run_hooked(model, ids, mask, handles)
    return records


def mamba_reference(mixer, seen, mask):
    """The references of one fla ``Mamba`` layer from its recorded tensors (float64): α (b, D, L, L) over u, the
    unified H (b, D, L, L) over x = in_proj's first half · m, and the out_proj input's parts."""
    d = lambda t: t.double()  # noqa: E731
    m = d(mask)
    length = m.shape[1]
    x, z = d(seen["in_proj"]).chunk(2, dim=-1)
    x = x * m[:, :, None]
    pre = d(seen["conv"])[..., :length].transpose(1, 2)  # (b, L, D) the conv's pre-activation
    dt_low, B, C = d(seen["x_proj"]).split([mixer.dt_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    delta = F.softplus(d(seen["dt_proj"]))
    A = -torch.exp(d(mixer.A_log))
    channels = delta.shape[-1]
    alpha = impulse_alpha(delta, A, B[:, :, None].expand(-1, -1, channels, -1), C[:, :, None].expand(-1, -1, channels, -1))
    u = F.silu(pre) * m[:, :, None]
    gate = F.silu(z)
    column = torch.sigmoid(pre) * m[:, :, None]
    band = conv_band(d(mixer.conv1d.weight[:, 0]), length)
    unified = torch.einsum("bic,bcij,bjc,cjs->bcis", gate, alpha, column, band)
    bias_share = gate * torch.einsum("bcij,bjc->bic", alpha, column * d(mixer.conv1d.bias))
    skip_share = gate * d(mixer.D) * u
    return dict(x=x, values=u, alpha=alpha, unified=unified, bias_share=bias_share, skip_share=skip_share,
                out_in=d(seen["out_in"][0]))


def mamba2_reference(mixer, seen, mask):
    """The references of one fla ``Mamba2`` layer (float64): α (b, H, L, L) over x after the conv, the unified H
    (b, H·P, L, L) over x before it, and the out_proj input's parts. B, C of head h: group h mod G (fla's torch
    path tiles the groups)."""
    d = lambda t: t.double()  # noqa: E731
    m = d(mask)[:, :, None]
    length = m.shape[1]
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    d_inner = heads * head_dim
    z, xbc, dt = d(seen["in_proj"]).split([d_inner, mixer.conv_dim, heads], dim=-1)
    pre = d(seen["conv"])[..., :length].transpose(1, 2)
    act = F.silu(pre) * m
    x_post, B, C = act.split([d_inner, groups * state, groups * state], dim=-1)
    tiled = [h % groups for h in range(heads)]
    B, C = (t.reshape(*t.shape[:2], groups, state)[:, :, tiled] for t in (B, C))
    low, high = mixer.dt_limit
    delta = torch.clamp(F.softplus(dt + d(mixer.dt_bias)), low, high)
    alpha = impulse_alpha(delta, -torch.exp(d(mixer.A_log))[:, None].expand(-1, state), B, C)
    per_channel = alpha.repeat_interleave(head_dim, dim=1)  # (b, H·P, L, L)
    D = d(mixer.D) if mixer.D_has_hdim else d(mixer.D).repeat_interleave(head_dim)
    y = torch.einsum("bcij,bjc->bic", per_channel, x_post) + D * x_post
    gate = F.silu(z)
    if mixer.norm is None:
        row = gate
    else:
        norm = mixer.norm
        normed = y if norm.norm_before_gate else y * gate
        grouped = normed.reshape(*normed.shape[:2], -1, norm.group_size)
        nu = (torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.eps).expand_as(grouped)
              .reshape(normed.shape) * d(norm.weight))
        row = nu * gate
    column = torch.sigmoid(pre[..., :d_inner]) * m
    band = conv_band(d(mixer.conv1d.weight[:d_inner, 0]), length)
    unified = torch.einsum("bic,bcij,bjc,cjs->bcis", row, per_channel, column, band)
    bias_share = row * torch.einsum("bcij,bjc->bic", per_channel, column * d(mixer.conv1d.bias[:d_inner]))
    return dict(x=xbc[..., :d_inner] * m, values=x_post, alpha=alpha, unified=unified, bias_share=bias_share,
                skip_share=row * D * x_post, out_in=d(seen["out_in"][0]))


def reference(mixer, seen, mask):
    return (mamba_reference if type(mixer).__name__ == "Mamba" else mamba2_reference)(mixer, seen, mask)


def masked_maps(maps, mask):
    m = mask.double()
    return maps * (m[:, :, None] * m[:, None, :])[:, None]


def operators_of(model, ids, mask, formulation):
    operators, _, _ = mc.build_operators(model, ids, mask, formulation=formulation)
    return list(operators.values())


# -- what the layers hold ---------------------------------------------------------------------------------------------
def test_the_layers_silu_and_gated_norm_are_exact_inside_fla_on_cpu():
    """fla's Mamba layers keep their SiLU (``self.act``, fla's SwishFunction.apply, taken from ACT2FN when built) and
    Mamba-2 its RMSNormGated, both Triton in fla: inside fla_on_cpu() they equal x · σ(x) and fla's torch reference
    ``rms_norm_ref``, with their gradients (float64)."""
    from fla.modules.norm.layernorm_gated import rms_norm_ref
    mixer = fla_mixers(make_model("mamba2_norm_first"))[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, dtype=torch.float64, generator=g, requires_grad=True)
    z = torch.randn(2, 5, 64, dtype=torch.float64, generator=g, requires_grad=True)
    dy = torch.randn(2, 5, 64, dtype=torch.float64, generator=g)
    norm = mixer.norm
    # the reference rounds the weight to float32 (``weight.float()``): give the norm one it holds exactly
    norm.weight.data = norm.weight.data.float().double()
    for ours, theirs in (
            (lambda: mixer.act(x), lambda: x * torch.sigmoid(x)),
            (lambda: norm(x, z), lambda: rms_norm_ref(x, norm.weight, None, z, eps=norm.eps, group_size=norm.group_size,
                                                      norm_before_gate=norm.norm_before_gate, upcast=False))):
        with mc.fla_on_cpu():
            got = ours()
            got_grads = torch.autograd.grad(got, (x, z), dy, allow_unused=True)
        expected = theirs()
        expected_grads = torch.autograd.grad(expected, (x, z), dy, allow_unused=True)
        assert relative_error(got, expected) <= 1e-14
        for got_grad, expected_grad in zip(got_grads, expected_grads):
            assert (got_grad is None) == (expected_grad is None)
            assert got_grad is None or relative_error(got_grad, expected_grad) <= 1e-13


# -- the models on a CPU ----------------------------------------------------------------------------------------------
def twins(kind: str):
    """(fla's model, transformers' model of the same weights): Mamba, or Mamba-2 with one group of B, C (where fla's
    torch path and transformers' agree); no in_proj bias (with one, fla also zeroes the pads' conv input and
    transformers does not), float64."""
    from transformers import Mamba2Config as HFMamba2Config
    from transformers import MambaConfig as HFMambaConfig
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, pad_token_id=0,
                  tie_word_embeddings=False, residual_in_fp32=False)
    if kind == "mamba":
        fla_config, hf_config = config_of("MambaConfig", state_size=4, expand=2), HFMambaConfig(**common)
    else:
        fla_config = config_of("Mamba2Config", head_dim=8, state_size=4, expand=2, chunk_size=4,
                               residual_in_fp32=False)
        hf_config = HFMamba2Config(num_heads=8, head_dim=8, n_groups=1, chunk_size=4, **common)
    torch.manual_seed(0)
    fla_model = scaled_up(AutoModelForCausalLM.from_config(fla_config).double().eval())
    hf_model = AutoModelForCausalLM.from_config(hf_config).double().eval()
    hf_model.load_state_dict(fla_model.state_dict())
    return fla_model, hf_model


def next_token_loss(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits.double()
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_model_trains_on_cpu_with_the_gradients_of_transformers_twin(kind):
    """A training step inside fla_on_cpu() (the swapped SiLU and norms, forward and backward): the gradient of every
    parameter equals transformers' for the same weights (both implementations run parts in float32: 1e-5)."""
    fla_model, hf_model = twins(kind)
    ids, mask = padded_batch(length=10)
    fla_model.train(), hf_model.train()
    with mc.fla_on_cpu():
        next_token_loss(fla_model, ids, mask).backward()
    next_token_loss(hf_model, ids, mask).backward()
    theirs = dict(hf_model.named_parameters())
    for name, parameter in fla_model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().max() > 0, name
        assert relative_error(parameter.grad, theirs[name].grad) <= REAL, name


# -- the operators ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_maps_equal_the_references_and_the_references_reproduce_the_layer(name):
    model = make_model(name)
    ids, mask = padded_batch(length=12)
    before = model_state(model)
    hidden, unified = operators_of(model, ids, mask, "hidden"), operators_of(model, ids, mask, "unified")
    records = record(model, ids, mask)
    assert len(hidden) == len(unified) == len(records) == 2
    real_rows = mask.bool()
    for op_hidden, op_unified, (mixer, seen) in zip(hidden, unified, records):
        ref = reference(mixer, seen, mask)
        assert relative_error(op_hidden.maps(reduce=None), masked_maps(ref["alpha"], mask)) <= 1e-10, name
        assert relative_error(op_unified.maps(reduce=None), masked_maps(ref["unified"], mask)) <= 1e-10, name
        # the real layer: out_proj's input = H x + the conv bias's share + the D skip's share
        rebuilt = torch.einsum("bcis,bsc->bic", op_unified.maps(reduce=None), ref["x"])
        expected = ref["out_in"] - ref["bias_share"] - ref["skip_share"]
        assert relative_error(rebuilt[real_rows], expected[real_rows]) <= REAL, name
        assert ref["bias_share"].abs().max() > 1e-2 and ref["skip_share"].abs().max() > 1e-2  # both matter
        # the hidden operator's values and output are the layer's
        assert relative_error(op_hidden.values.reshape(ref["values"].shape), ref["values"]) <= REAL
    assert_untouched(model, before)


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_float32_models_reproduce_the_layer(name):
    model = make_model(name, torch.float32)
    ids, mask = padded_batch(length=12)
    unified = operators_of(model, ids, mask, "unified")
    for op, (mixer, seen) in zip(unified, record(model, ids, mask)):
        ref = reference(mixer, seen, mask)
        rebuilt = torch.einsum("bcis,bsc->bic", op.maps(reduce=None).double(), ref["x"])
        expected = ref["out_in"] - ref["bias_share"] - ref["skip_share"]
        assert relative_error(rebuilt[mask.bool()], expected[mask.bool()]) <= 3e-5, name


@pytest.mark.parametrize("name", NAMES)
def test_batch_equals_single_examples_and_left_padding_equals_none(name):
    model = make_model(name)
    ids, mask = padded_batch(length=12)
    # fla's Mamba-2 torch path runs its SSD in float32, over chunks padded otherwise for the shorter single rows
    tolerance = 1e-12 if name == "mamba" else 1e-6
    for formulation in ("hidden", "unified"):
        batched = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
        for b in range(2):
            real = mask[b].bool()
            single = mc.implicit_attention(model, ids[b:b + 1, real], formulation=formulation)
            for key in batched:
                assert relative_error(batched[key][b][real][:, real], single[key][0]) <= tolerance, (name, key)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_fla_and_transformers_twins_are_explained_alike(kind):
    """fla's layer and transformers' with the same weights, through two adapters sharing their operator code: the
    same maps (the layers' real outputs, with their float32 parts, feed the next layer: 1e-5)."""
    fla_model, hf_model = twins(kind)
    ids, mask = padded_batch(length=12)
    for formulation in ("hidden", "unified"):
        ours = mc.implicit_attention(fla_model, ids, attention_mask=mask, formulation=formulation)
        theirs = mc.implicit_attention(hf_model, ids, attention_mask=mask, formulation=formulation)
        assert list(ours) == list(theirs) == [0, 1]
        for key in ours:
            assert relative_error(ours[key], theirs[key]) <= REAL


def test_a_saved_fla_mamba_checkpoint_loads_in_fla_and_in_transformers_alike(tmp_path):
    """fla's ``mamba`` checkpoint (a model type transformers has too): fla's class reads it back as it was;
    transformers' Auto loader (its own ``mamba`` type, which import_fla_models leaves in place) reads it as its
    MambaForCausalLM: the same parameters, the same function and maps up to transformers' float32 norms."""
    model, _ = twins("mamba")
    model.save_pretrained(tmp_path)
    ours = fla_models.MambaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(ours).__module__.startswith("fla.") and type(theirs).__module__.startswith("transformers.")
    assert all(torch.equal(value, theirs.state_dict()[key]) for key, value in model.state_dict().items())
    ids, mask = padded_batch(length=12)
    with mc.fla_on_cpu(), torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        assert torch.equal(ours(ids, attention_mask=mask).logits, logits)
        assert relative_error(theirs(ids, attention_mask=mask).logits, logits) <= REAL
    ours_maps = mc.implicit_attention(ours, ids, attention_mask=mask)
    theirs_maps = mc.implicit_attention(theirs, ids, attention_mask=mask)
    for key in ours_maps:
        assert relative_error(ours_maps[key], theirs_maps[key]) <= REAL


# -- samba ------------------------------------------------------------------------------------------------------------
def samba(attn):
    torch.manual_seed(0)
    config = config_of("SambaConfig", state_size=4, expand=2, hidden_ratio=2, attn=attn)
    return scaled_up(AutoModelForCausalLM.from_config(config).double().eval())


def test_samba_without_attention_layers_is_explained():
    model = samba(None)
    ids, mask = padded_batch(length=10)
    for formulation in ("hidden", "unified"):
        maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
        assert list(maps) == [0, 1] and all(bool(torch.isfinite(m).all()) for m in maps.values())


def test_samba_attention_layers_are_refused_by_name(monkeypatch):
    import fla.layers.attn
    # fla's Attention needs flash-attn to be built at all: a stand-in lets the model be built on this CPU
    monkeypatch.setattr(fla.layers.attn, "flash_attn_func", lambda *args, **kwargs: None)
    model = samba(dict(layers=[1], num_heads=2, num_kv_heads=2, qkv_bias=False, window_size=4, rope_theta=1e4))
    assert [type(m).__name__ for m in fla_mixers(model)] == ["Mamba", "Attention"]
    ids, mask = padded_batch(length=10)
    with pytest.raises(TypeError, match=r"layer 1 \(mixer\) uses the token mixer Attention .*softmax attention"):
        mc.implicit_attention(model, ids, attention_mask=mask)


def test_a_mamba_class_from_another_package_is_refused():
    layer = type("Mamba", (torch.nn.Module,), {"activation": "silu"})()  # mamba-ssm's class has the same name
    call = types.SimpleNamespace(located=types.SimpleNamespace(module=layer, name="0.mixer"))
    with pytest.raises(NotImplementedError, match="not fla's Mamba layer"):
        fla_mamba.fla_mixer(call, "Mamba")
