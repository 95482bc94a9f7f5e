"""Tiny random flash-linear-attention models (fixed seed), for the fla tests: their configs, and how each layer's
values (the unified operator's input) and its core op's call are read by the tests' own hooks.

``import_fla_models`` (mamba_captum.fla_cpu) imports ``fla.models`` without letting it take over transformers' own
``mamba`` / ``mamba2`` / ``bitnet`` model types, so the other test files of the same worker are unaffected.
"""
from __future__ import annotations

import importlib
import inspect
import warnings

import torch
from transformers import AutoModelForCausalLM

import mamba_captum as mc
from mamba_captum.fla_cpu import import_fla_models

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla: "Triton is not supported on current platform, roll back to CPU."
    fla_models = import_fla_models()

VOCAB = 64


def common_config(**kw):
    """The keyword arguments of a tiny fla config (2 layers, width 32, vocabulary :data:`VOCAB`) plus ``kw``."""
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, fuse_cross_entropy=False, **kw)


def gla_impulse(kwargs):
    """α (B, H, T, T) of fla's GLA op from its recorded inputs: fla's naive op run on one-hot values (the output for
    v = e_s is column s), zero state."""
    from fla.ops.gla.naive import naive_recurrent_gla
    q, k = kwargs["q"].double(), kwargs["k"].double()
    batch, length, heads, _ = q.shape
    eye = torch.eye(length, dtype=torch.float64)[None, :, None, :].expand(batch, length, heads, length)
    gk = kwargs["gk"] if "gk" in kwargs else kwargs["g"]
    out, _ = naive_recurrent_gla(q, k, eye.contiguous(), gk.double())
    return out.permute(0, 2, 1, 3)


# name -> how the tests build and read one tiny fla model:
#   config: (config class name in fla.models, its tiny kwargs);
#   values: the mixer's submodule whose output is the unified operator's input x (B, L, H·P) (its output, as fla
#           runs it: the real tokens packed when a mask is given);
#   ops: the names, in the layer's module, of the core op functions it may call (recorded by the hidden test);
#   impulse: recorded keyword arguments of one op call -> α (B, H, T, T) through fla's own naive op;
#   value_key: the name of the values among the op's keyword arguments.
FLA_SPECS = {
    "gla": dict(config=("GLAConfig", common_config(num_heads=2, expand_k=0.5, expand_v=1.0)),
                values="v_proj", ops=("chunk_gla", "fused_recurrent_gla", "fused_chunk_gla"), impulse=gla_impulse,
                value_key="v"),
    "gla_conv": dict(config=("GLAConfig", common_config(num_heads=2, expand_k=0.5, expand_v=1.0, use_short_conv=True,
                                                        conv_size=4)),
                     values="v_proj", ops=("chunk_gla", "fused_recurrent_gla", "fused_chunk_gla"),
                     impulse=gla_impulse, value_key="v"),
}


# -- RetNet (the other layers of the GLA family, whose o_proj runs inside a fused norm or after fla repads the batch,
# are tested in tests/test_fla_gla_family.py) ------------------------------------------------------------------------
def one_hot_values(batch, length, heads):
    """(B, T, H, T): value s of every head is the unit vector e_s (the op's output column s is α[:, s])."""
    eye = torch.eye(length, dtype=torch.float64)[None, :, None, :]
    return eye.expand(batch, length, heads, length).contiguous()


def retention_impulse(kwargs):
    """α (B, H, T, T) of fla's retention op: fla's ``naive_retention`` (its (B, H, T, ·) layout) on one-hot values."""
    from fla.ops.retention.naive import naive_retention
    q, k = kwargs["q"].double().transpose(1, 2), kwargs["k"].double().transpose(1, 2)
    batch, heads, length, _ = q.shape
    return naive_retention(q, k, one_hot_values(batch, length, heads).transpose(1, 2)).double()


_RETENTION_OPS = ("chunk_retention", "fused_recurrent_retention", "parallel_retention", "fused_chunk_retention")
FLA_SPECS.update({
    "retnet": dict(config=("RetNetConfig", common_config(num_heads=2, expand_k=0.5, expand_v=1.0)), values="v_proj",
                   ops=_RETENTION_OPS, impulse=retention_impulse, value_key="v"),
    # the norm and the gate unfused (RetNetConfig passes no conv; shared key / value heads: test_fla_gla_family)
    "retnet_unfused": dict(config=("RetNetConfig", common_config(num_heads=2, expand_k=0.5, expand_v=1.0,
                                                                 fuse_norm=False)),
                           values="v_proj", ops=_RETENTION_OPS, impulse=retention_impulse, value_key="v"),
})


# -- the delta-rule family: DeltaNet, gated DeltaNet, KDA, Comba, gated DeltaProduct (tests/test_fla_delta_family.py) --
def _fla_naive_float64(function, *args, **kwargs):
    """``function`` (one of fla's torch references, which cast to float32) run in float64."""
    from test_kernel_delta_rule_states import Float64
    with Float64():
        return function(*args, **kwargs)


def _kernel_l2(x):
    """fla's in-kernel L2 norm: x / sqrt(Σ x² + 1e-6)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def _delta_inputs(kwargs, *names):
    """The recorded tensors ``names`` in float64, q / k (/ p) L2-normalised where the op was asked to, β through
    its in-kernel sigmoid (× 2 with allow_neg_eigval) where asked, key heads repeated for the value heads."""
    tensors = {name: None if kwargs.get(name) is None else kwargs[name].double() for name in names}
    if kwargs.get("use_qk_l2norm_in_kernel"):
        for name in ("q", "k", "p"):
            if tensors.get(name) is not None:
                tensors[name] = _kernel_l2(tensors[name])
    if kwargs.get("use_beta_sigmoid_in_kernel"):
        tensors["beta"] = torch.sigmoid(tensors["beta"]) * (2.0 if kwargs.get("allow_neg_eigval") else 1.0)
    value_heads = kwargs["v"].shape[2]
    for name in ("q", "k", "p"):
        if tensors.get(name) is not None:
            tensors[name] = tensors[name].repeat_interleave(value_heads // tensors[name].shape[2], dim=2)
    return tensors


def delta_rule_impulse(kwargs):
    """α (B, HV, T, T) of fla's (gated) delta-rule ops (DeltaNet, gated DeltaNet, a DeltaProduct of one step) from
    their recorded inputs: the in-kernel norms and gates applied as fla's own ``naive_gdn_gate`` / formulas, then
    fla's ``naive_recurrent_gated_delta_rule`` (``delta_rule_recurrence`` without a decay) on one-hot values."""
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    t = _delta_inputs(kwargs, "q", "k", "beta", "g")
    q, k, beta, g = t["q"], t["k"], t["beta"], t["g"]
    batch, length, heads, _ = q.shape
    if beta is None:
        beta = torch.ones(batch, length, heads, dtype=torch.float64)
    values = one_hot_values(batch, length, heads)
    if g is None:
        head_first = lambda x: x.transpose(1, 2)  # noqa: E731
        out, _ = _fla_naive_float64(delta_rule_recurrence, head_first(q), head_first(k), head_first(values),
                                    head_first(beta))
        return out.double()
    if kwargs.get("use_gate_in_kernel"):
        g = _fla_naive_float64(naive_gdn_gate, g, kwargs["A_log"].double(),
                               None if kwargs.get("dt_bias") is None else kwargs["dt_bias"].double(),
                               output_dtype=torch.float64)
    out, _ = _fla_naive_float64(naive_recurrent_gated_delta_rule, q, k, values, beta, g, scale=kwargs.get("scale"))
    return out.double().permute(0, 2, 1, 3)


def kda_impulse(kwargs):
    """α (B, HV, T, T) of fla's KDA ops: fla's ``naive_kda_gate`` / ``naive_kda_lowerbound_gate`` for the in-kernel
    gate, then ``naive_recurrent_kda`` on one-hot values."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda
    t = _delta_inputs(kwargs, "q", "k", "beta", "g")
    g = t["g"]
    if kwargs.get("use_gate_in_kernel"):
        A_log, dt_bias = kwargs["A_log"].double(), kwargs["dt_bias"].double()
        if kwargs.get("lower_bound") is not None:
            g = _fla_naive_float64(naive_kda_lowerbound_gate, g, A_log, dt_bias, kwargs["lower_bound"],
                                   output_dtype=torch.float64)
        else:
            g = _fla_naive_float64(naive_kda_gate, g, A_log, dt_bias, output_dtype=torch.float64)
    batch, length, heads, _ = t["q"].shape
    out, _ = _fla_naive_float64(naive_recurrent_kda, t["q"], t["k"], one_hot_values(batch, length, heads), g,
                                t["beta"], scale=kwargs.get("scale"))
    return out.double().permute(0, 2, 1, 3)


def comba_impulse(kwargs):
    """α (B, HV, T, T) of fla's Comba ops: ``naive_chunk_comba`` on one-hot values (fla's ``naive_recurrent_comba``
    decays before the read, unlike fla's kernels)."""
    from fla.ops.comba.naive import naive_chunk_comba
    t = _delta_inputs(kwargs, "q", "k", "p", "beta", "g")
    batch, length, heads, _ = t["q"].shape
    out, _ = _fla_naive_float64(naive_chunk_comba, t["q"], t["k"], one_hot_values(batch, length, heads), t["p"],
                                t["g"], t["beta"], scale=kwargs.get("scale"))
    return out.double().permute(0, 2, 1, 3)


def delta_product_impulse(kwargs):
    """α (B, HV, T, T) of fla's gated DeltaProduct of one step (its layer calls ``chunk_gated_delta_product``, or
    without gradients ``fused_recurrent_gated_delta_rule``): fla's ``naive_recurrent_gated_delta_product``."""
    if "num_householder" not in kwargs:
        return delta_rule_impulse(kwargs)
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    assert kwargs["num_householder"] == 1, "the generic tests hold for one step per token"
    t = _delta_inputs(kwargs, "q", "k", "beta", "g")
    batch, length, heads, dim = t["q"].shape
    scale = dim ** -0.5 if kwargs.get("scale") is None else kwargs["scale"]
    out, _ = _fla_naive_float64(naive_recurrent_gated_delta_product, t["q"], t["k"],
                                one_hot_values(batch, length, heads), t["g"], t["beta"], scale)
    return out.double().permute(0, 2, 1, 3)


_DELTA_OPS = ("fused_recurrent_delta_rule", "chunk_delta_rule")
_GATED_DELTA_OPS = ("fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule")
_KDA_OPS = ("fused_recurrent_kda", "chunk_kda")
FLA_SPECS.update({
    "delta_net": dict(config=("DeltaNetConfig", common_config(num_heads=2, expand_k=0.5, expand_v=1.0)),
                      values="v_proj", ops=_DELTA_OPS, impulse=delta_rule_impulse, value_key="v"),
    # an output gate, no convs, elu+1 features with sum normalisation, β in (0, 2)
    "delta_net_variant": dict(config=("DeltaNetConfig", common_config(num_heads=2, expand_k=0.5, expand_v=1.0,
                                                                      use_gate=True, use_short_conv=False,
                                                                      qk_activation="elu", qk_norm="sum",
                                                                      allow_neg_eigval=True)),
                              values="v_proj", ops=_DELTA_OPS, impulse=delta_rule_impulse, value_key="v"),
    # two value heads per key head (GVA)
    "gated_deltanet": dict(config=("GatedDeltaNetConfig", common_config(num_heads=2, num_v_heads=4, head_dim=8,
                                                                        expand_v=1.0)),
                           values="v_proj", ops=_GATED_DELTA_OPS, impulse=delta_rule_impulse, value_key="v"),
    "kda": dict(config=("KDAConfig", common_config(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0)),
                values="v_proj", ops=_KDA_OPS, impulse=kda_impulse, value_key="v"),
    # the "safe gate": lower_bound · σ(exp(A_log) (f + dt_bias))
    "kda_safe_gate": dict(config=("KDAConfig", common_config(num_heads=2, head_dim=8, expand_v=1.0, safe_gate=True,
                                                             lower_bound=-5.0)),
                          values="v_proj", ops=_KDA_OPS, impulse=kda_impulse, value_key="v"),
    "comba": dict(config=("CombaConfig", common_config(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0)),
                  values="v_proj", ops=("fused_recurrent_comba", "chunk_comba"), impulse=comba_impulse,
                  value_key="v"),
    # one delta step per token: the generic tests compare channel for channel (n > 1: tests/test_fla_delta_family.py)
    "gated_deltaproduct": dict(config=("GatedDeltaProductConfig", common_config(num_heads=2, head_dim=8, expand_v=1.0,
                                                                                use_forget_gate=True)),
                               values="v_proj", ops=("chunk_gated_delta_product", "fused_recurrent_gated_delta_rule"),
                               impulse=delta_product_impulse, value_key="v"),
})


# -- the preconditioned delta rules: PrecondGatedDeltaNet, PrecondKDA (tests/test_fla_precond.py) ---------------------
def _kernel_normalised_naive(module):
    """fla's naive precond module with its L2 norm (``F.normalize``: eps 1e-12 outside the root) made the kernels'
    (eps 1e-6 inside the root, what the layer's kernels and the fla_on_cpu swaps run), while entered."""
    from types import SimpleNamespace
    from unittest import mock
    return mock.patch.object(module, "F", SimpleNamespace(normalize=lambda x, p, dim: _kernel_l2(x)))


def precond_gated_delta_rule_impulse(kwargs):
    """α (B, HV, T, T) of fla's preconditioned gated delta rule: ``naive_recurrent_precond_gated_delta_rule`` (the
    kernels' L2 norm, see :func:`_kernel_normalised_naive`) on one-hot values, zero states."""
    import fla.ops.precond_gated_delta_rule.naive as naive
    assert kwargs.get("use_qk_l2norm_in_kernel", True), "fla's naive reference always normalises q and k"
    t = {name: kwargs[name].double() for name in ("q", "k", "g", "g_atk", "beta", "beta_atk")}
    batch, length = t["q"].shape[:2]
    with _kernel_normalised_naive(naive):
        out, _, _ = _fla_naive_float64(naive.naive_recurrent_precond_gated_delta_rule, t["q"], t["k"],
                                       one_hot_values(batch, length, kwargs["v"].shape[2]), t["g_atk"], t["g"],
                                       t["beta_atk"], t["beta"], scale=kwargs.get("scale"), x=kwargs["x"],
                                       eps=kwargs["eps"], log_atk_scale=kwargs["log_atk_scale"].double())
    return out.double().permute(0, 2, 1, 3)


def precond_kda_impulse(kwargs):
    """α (B, HV, T, T) of fla's preconditioned KDA: ``naive_recurrent_precond_kda`` (which takes q, k as the kernel
    uses them: L2-normalised here, eps inside the root; key heads repeated) on one-hot values, zero states."""
    from fla.ops.precond_kda.naive import naive_recurrent_precond_kda
    assert not kwargs.get("use_gate_in_kernel"), "PrecondKDA computes its gate before the op"
    t = _delta_inputs(dict(kwargs, use_qk_l2norm_in_kernel=True), "q", "k", "g", "g_atk", "beta", "beta_atk")
    batch, length, heads, _ = t["q"].shape
    out, _, _ = _fla_naive_float64(naive_recurrent_precond_kda, t["q"], t["k"], one_hot_values(batch, length, heads),
                                   t["g"], t["g_atk"], t["beta_atk"], t["beta"], scale=kwargs.get("scale"),
                                   x=kwargs["x"], eps=kwargs["eps"], log_atk_scale=kwargs["log_atk_scale"].double())
    return out.double().permute(0, 2, 1, 3)


_PRECOND_GDN_OPS = ("fused_recurrent_precond_gated_delta_rule", "chunk_precond_gated_delta_rule")
FLA_SPECS.update({
    # two value heads per key head (GVA)
    "precond_gated_deltanet": dict(config=("PrecondGatedDeltaNetConfig",
                                           common_config(num_heads=2, num_v_heads=4, head_dim=8, expand_v=1.0)),
                                   values="v_proj", ops=_PRECOND_GDN_OPS, impulse=precond_gated_delta_rule_impulse,
                                   value_key="v"),
    # no output gate, no convs, β in (0, 2), a wider squash range
    "precond_gated_deltanet_variant": dict(config=("PrecondGatedDeltaNetConfig",
                                                   common_config(num_heads=2, head_dim=8, expand_v=2.0,
                                                                 use_gate=False, use_short_conv=False,
                                                                 allow_neg_eigval=True, squash_x=2.0,
                                                                 log_atk_scale_init=-1.0)),
                                           values="v_proj", ops=_PRECOND_GDN_OPS,
                                           impulse=precond_gated_delta_rule_impulse, value_key="v"),
    # PrecondKDA: two value heads per key head (the layer repeats q and k; the preconditioner per value head)
    "precond_kda": dict(config=("PrecondKDAConfig", common_config(num_heads=2, num_v_heads=4, head_dim=8,
                                                                  expand_v=1.0)),
                        values="v_proj", ops=("fused_recurrent_precond_kda", "chunk_precond_kda"),
                        impulse=precond_kda_impulse, value_key="v"),
    # the safe gate (lower_bound · σ(exp(A_log) (f + dt_bias))), no convs, β in (0, 2)
    "precond_kda_variant": dict(config=("PrecondKDAConfig", common_config(num_heads=2, head_dim=8, expand_v=1.0,
                                                                          safe_gate=True, lower_bound=-5.0,
                                                                          use_short_conv=False,
                                                                          allow_neg_eigval=True)),
                                values="v_proj", ops=("fused_recurrent_precond_kda", "chunk_precond_kda"),
                                impulse=precond_kda_impulse, value_key="v"),
})


def make_fla_model(name: str, dtype=torch.float32, seed: int = 0):
    """The tiny model ``name`` of :data:`FLA_SPECS` (eval mode), its projections scaled up so that every factor of
    the operator matters (fla's init gives tiny gates)."""
    config_class, kwargs = FLA_SPECS[name]["config"]
    config = getattr(fla_models, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__module__.startswith("fla.layers."):
                for parameter_name, parameter in module.named_parameters():
                    if parameter.dim() == 2 and parameter_name.endswith("weight"):
                        parameter.normal_(0.0, 0.4, generator=generator)
    return model


def fla_mixers(model):
    """The token-mixer layers of an fla model, in order."""
    import fla.layers
    return [m for m in model.modules() if type(m).__name__ in fla.layers.__all__
            and type(m).__module__.startswith("fla.layers.")]


def padded_batch(length=12, pads=3, seed=0, left=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones_like(ids)
    pad = slice(0, pads) if left else slice(length - pads, None)
    ids[0, pad], mask[0, pad] = 0, 0
    return ids, mask


def scale_up_mixer_weights(model, seed: int = 0):
    """Redraw the 2-D weights of the model's mixers from N(0, 0.4²) (generator seeded ``seed``) so that every factor
    of the operator matters (fla's init gives tiny gates); returns the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mixer in fla_mixers(model):
            for name, parameter in mixer.named_parameters():
                if parameter.dim() == 2 and name.endswith("weight"):
                    parameter.normal_(0.0, 0.4, generator=generator)
    return model


def run_hooked(model, ids, mask, handles) -> None:
    """Run ``model`` on ids (B, L) with attention mask (B, L) or None through ``fla_on_cpu`` without grad, then remove
    the hooks ``handles`` (which recorded what the test reads), even when the run fails."""
    try:
        with mc.fla_on_cpu(), torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def assert_trains_on_cpu_and_explains_both_formulations(model) -> None:
    """A training step of ``model`` on a left-padded batch inside fla_on_cpu() (fla's layers take their chunked ops
    when training): its loss is the eval forward's (the fused-recurrent ops, no gradients), every mixer parameter
    gets a gradient; then hidden and unified maps of both layers, zero at the pads, causal, not all zero."""
    import mamba_captum as mc
    from conftest import relative_error
    ids, mask = padded_batch(length=12)
    with mc.fla_on_cpu(), torch.no_grad():
        eval_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    model.train()
    with mc.fla_on_cpu():
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
    model.eval()
    assert relative_error(loss.detach(), eval_loss) <= 1e-12
    for mixer in fla_mixers(model):
        for name, parameter in mixer.named_parameters():
            assert parameter.grad is not None and parameter.grad.abs().max() > 0, name
    for formulation in ("hidden", "unified"):
        maps = mc.implicit_attention(model, ids, attention_mask=mask, formulation=formulation)
        assert sorted(maps) == [0, 1]
        for layer_map in maps.values():
            assert layer_map.shape == (2, 12, 12)
            assert layer_map[0, :3].abs().max() == 0 and layer_map[0, :, :3].abs().max() == 0  # pads
            assert torch.equal(layer_map.triu(1), torch.zeros_like(layer_map))  # causal
            assert layer_map.abs().max() > 0


def assert_a_cpu_training_step_matches_eval(model, ids, tolerance: float, every_weight: bool = True) -> None:
    """A training step of ``model`` on ``ids`` inside fla_on_cpu(): its loss equals the eval forward's (to
    ``tolerance``, relative) and every mixer weight gets a finite gradient, each non-zero (``every_weight``) or at
    least one."""
    import mamba_captum as mc
    from conftest import relative_error
    with mc.fla_on_cpu():
        with torch.no_grad():
            eval_loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        model.train()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    assert relative_error(loss, eval_loss) <= tolerance
    grads = {name: p.grad for m in fla_mixers(model) for name, p in m.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads.values()), grads.keys()
    if every_weight:
        assert all(float(g.abs().sum()) > 0 for g in grads.values()), grads.keys()
    else:
        assert sum(float(g.abs().sum()) for g in grads.values()) > 0


def assert_batch_equals_single_examples(model, ids, mask, **options) -> None:
    """Each row's maps from the padded batch (ids, mask (B, L)), restricted to its real tokens, equal the maps of the
    row alone without its pads (float64, rtol 1e-9, atol 1e-12). options: those of ``mc.implicit_attention``."""
    batched = mc.implicit_attention(model, ids, attention_mask=mask, **options)
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        single = mc.implicit_attention(model, ids[b:b + 1, real], **options)
        for key in batched:
            torch.testing.assert_close(batched[key][b][real][:, real].double(), single[key][0].double(),
                                       rtol=1e-9, atol=1e-12)


class OpRecorder:
    """Record the calls of the ops ``names`` that the model's mixers' modules hold (swapped in place while entered):
    each call as (name, its bound arguments, positional ones named and ``**kwargs`` merged in, its first output)."""

    def __init__(self, model, names):
        self.modules = {importlib.import_module(type(m).__module__) for m in fla_mixers(model)}
        self.names, self.calls, self.saved = names, [], []

    def __enter__(self):
        for module in self.modules:
            for name in self.names:
                if not hasattr(module, name):
                    continue
                original = getattr(module, name)

                def recording(*args, _original=original, _name=name, **kwargs):
                    out = _original(*args, **kwargs)
                    named = inspect.signature(_original).bind(*args, **kwargs).arguments
                    self.calls.append((_name, {**named.pop("kwargs", {}), **named}, out[0]))
                    return out

                self.saved.append((module, name, original))
                setattr(module, name, recording)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self.saved):
            setattr(module, name, original)
