"""Verification: the rebuilt output of a layer must reproduce the layer's real output (what is checked is what is
returned). :func:`check_reconstruction` compares them and raises :class:`ReconstructionError` (or
:class:`~mamba_captum.checks.NonFiniteError` for a non-finite real output); the engine (the operator rebuild of
:func:`mamba_captum.implicit_attention`, MambaLRP's module checks) calls it for every layer.
"""
from __future__ import annotations

import dataclasses

import torch

from .checks import NonFiniteError, nonfinite_parameters
from .operators import select_channels
from .shared_state import is_library_hook

# Largest accepted relative error (max |rebuilt - real| / max |real|) of a rebuilt layer output, by model dtype:
# what the library guarantees for y = H x (README, docs/robustness.md). Real mismatches (a variant the adapter does
# not know) are O(1e-2) or more; HF runs some scans in float32 even for float64 models, hence the float64 bound.
# Half precision: about ten units of the dtype's rounding (2^-11 float16, 2^-8 bfloat16), since the real output
# itself is rounded to it at every step; measured worst over every family's tiny models: 1.0e-3 (float16),
# 1.2e-2 (bfloat16) (tests/test_robustness.py).
TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}


class ReconstructionError(RuntimeError):
    """The operator rebuilt for a layer does not reproduce that layer's real output."""


def user_hooked(module) -> list[str]:
    """Submodules of a token mixer that carry the user's forward hooks (the engine's own are passed over)."""
    return [name or type(module).__name__ for name, sub in module.named_modules()
            if any(not is_library_hook(hook) for hook in (*sub._forward_hooks.values(),
                                                          *sub._forward_pre_hooks.values()))]


def check_reconstruction(name: str, real: torch.Tensor, rebuilt: torch.Tensor, dtype: torch.dtype, rows_mask=None, *,
           module=None, layer_input=None, model=None):
    """The relative error of the rebuilt layer output; raise if it is above the dtype's tolerance.

    ``model``: where to look for the non-finite weights upstream of a layer whose input is not finite (a norm before
    the mixer).

    Raises:
        NonFiniteError: the real output holds NaN or inf (naming the layer's non-finite weights, or the model's first
            ones, or its input).
        ReconstructionError: the rebuilt output does not reproduce the real one.
    """
    if not bool(torch.isfinite(real).all()):
        culprits = [] if module is None else nonfinite_parameters(module)
        if culprits:
            cause = f"non-finite weights: {', '.join(culprits)}; reload or repair them"
        elif layer_input is not None and not bool(torch.isfinite(layer_input).all()):
            upstream = [] if model is None else nonfinite_parameters(model)  # in module order: the first bad first
            cause = (f"its input already holds NaN or inf, and the model has non-finite weights: {', '.join(upstream)};"
                     " reload or repair them" if upstream else
                     "its input already holds NaN or inf (an earlier layer, the embeddings or inputs_embeds)")
        else:
            cause = (f"its weights and input are finite, so it overflowed in {dtype}: run the model in float32, or "
                     "for an attention layer try another attn_implementation (HF's eager attention gives NaN on "
                     "fully padded rows in float64)")
        raise NonFiniteError(f"mamba_captum: the output of {name} holds NaN or inf ({cause}). Implicit attention "
                             "of non-finite numbers is meaningless.")
    real, rebuilt = real.double(), rebuilt.double()
    diff = (real - rebuilt).abs()
    if rows_mask is not None:  # compare real tokens only: pad rows of softmax layers depend on the mask convention
        keep = rows_mask.bool().reshape(*rows_mask.shape, *([1] * (diff.dim() - 2)))
        diff, real = diff * keep, real * keep
    error, scale = diff.max().item(), real.abs().max().item()
    relative = error / scale if scale > 0 else error
    if not relative <= TOLERANCE.get(dtype, 1e-3):
        hooked = [] if module is None else user_hooked(module)
        hint = (f" Note: {', '.join(hooked)} of this layer carry forward hooks, which the rebuild (from the weights) "
                "does not run; a hook that changes outputs makes the layer a different function." if hooked else "")
        raise ReconstructionError(
            f"mamba_captum: the operator rebuilt for {name} does not reproduce the layer's output "
            f"(max abs error {error:.3g}, relative {relative:.3g}, tolerance {TOLERANCE.get(dtype, 1e-3):g}). "
            "This layer variant is not supported as loaded; please report the model class and config." + hint)
    return relative


# Largest accepted relative error of the map check (:func:`check_maps`), by model dtype. The maps' kernels and the
# operator's output take different routes, and the output is in places the layer's own recorded tensor (rounded to the
# model's dtype: HF's float32 scans in float64 models, bfloat16 models): float64 models agree to ~1e-12 where the
# output is rebuilt and ~1e-8 where HF rounds to float32; half-precision models as their layer check. A kernel that
# lost precision (RWKV under decays near float64's range) or a wrong band is off by 1e-4 or more
# (tests/test_map_checks.py).
MAP_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}
MAP_CHECK_ROWS = 8  # query rows checked per map: first, last and evenly spaced between
# channels checked per operator part: the most strongly decaying ones (where precision is lost first) and random
# others; every channel of a smaller part (a map kernel's work grows with the channels: all 1536 of a 130m layer
# would cost about as much as the map itself)
MAP_CHECK_STRESSED, MAP_CHECK_RANDOM = 8, 8


class MapCheckError(ReconstructionError):
    """The maps of a layer's operator do not reproduce the operator's own output (which reproduces the layer's)."""


def map_check_rows(length: int, device=None) -> torch.Tensor:
    """The query rows :func:`check_maps` checks: up to ``MAP_CHECK_ROWS``, the first, the last (the longest sums) and
    evenly spaced between. (R,) long."""
    count = min(length, MAP_CHECK_ROWS)
    return torch.linspace(0, length - 1, count, dtype=torch.float64).round().long().unique().to(device)


def _probe_and_target(operator, generator):
    """A random operator-output gradient g (fixed seed) and Σ_c g_c[i] y_c[i] per token: (g, (B, L) float64). A
    :class:`~mamba_captum.operators.SumOperator` takes one g per part."""
    if not hasattr(operator, "output"):  # parallel parts summed, each with its own output
        probes = [_probe_and_target(part, generator) for _, part in operator.parts]
        return [g for g, _ in probes], sum(target for _, target in probes)
    output = operator.output.detach().to(torch.float64)
    g = torch.randn(output.shape, generator=generator, dtype=torch.float64).to(output.device)
    return g, (g * output).flatten(2).sum(-1)


def _is_operator(value) -> bool:
    return dataclasses.is_dataclass(value) and hasattr(value, "contributions")


def bias_operator(operator):
    """The operator's response to its convolutions' biases, as an operator: each part with a ``conv_bias`` acting,
    without its conv, on the bias at every token, every other part on zeros. Its contributions add up to the share of
    ``output`` that comes from no token (:func:`check_maps` subtracts it); None when no part has a conv bias."""
    found = False

    def replaced(value):
        nonlocal found
        if isinstance(value, (list, tuple)):
            return type(value)(replaced(item) for item in value)
        if not _is_operator(value):
            return value
        changes = {f.name: replaced(getattr(value, f.name)) for f in dataclasses.fields(value)
                   if f.name not in ("values", "conv_bias")}
        if any(f.name == "values" for f in dataclasses.fields(value)) and torch.is_tensor(value.values):
            bias = getattr(value, "conv_bias", None)
            if bias is not None and getattr(value, "conv_weight", None) is not None:
                found = True
                changes.update(values=bias.to(value.values.dtype).expand_as(value.values), conv_weight=None,
                               conv_bias=None)
            else:
                changes["values"] = torch.zeros_like(value.values)
        return dataclasses.replace(value, **changes)

    result = replaced(operator)
    return result if found else None


def _sampled_channels(operator, generator) -> torch.Tensor | None:
    """The channels :func:`channel_sample` keeps of one operator: the ``MAP_CHECK_STRESSED`` with the largest decay
    per token (Δ·max|A|, or the log-decay) and ``MAP_CHECK_RANDOM`` others at random; None to keep all."""
    first = next(iter(operator.CHANNEL_FIELDS))  # delta or log_decay: (B, L, C)
    driver = getattr(operator, first).detach()
    count = driver.shape[-1]
    values, axis = getattr(operator, "values", None), operator.CHANNEL_FIELDS.get("values", -1)
    # a unit of the sample may hold several channels (a Mamba-2 head of P): as many units as make ~16 channels
    width = 1 if not torch.is_tensor(values) else max(1, values[(0,) * (axis % values.dim() + 1)].numel())
    # (heads of 8 channels or more: the fastest-decaying head alone; a kernel's code is the same for every head)
    stressed_count, random_count = max(1, MAP_CHECK_STRESSED // width), MAP_CHECK_RANDOM // width
    if count <= stressed_count + random_count:
        return None
    stress = driver.abs().flatten(0, -2).amax(0).to(torch.float64)
    A = getattr(operator, "A", None)
    if torch.is_tensor(A):  # Δ·|A|: the exponent per token
        stress = stress * A.detach().abs().reshape(count, -1).amax(-1).to(stress.device, torch.float64)
    stressed = stress.nan_to_num(float("inf")).topk(stressed_count).indices.cpu()
    others = torch.tensor(sorted(set(range(count)) - set(stressed.tolist())))
    chosen = others[torch.randperm(len(others), generator=generator)[:random_count]].long()
    return torch.cat([stressed, chosen]).sort().values.to(driver.device)


def channel_sample(operator, generator):
    """The operator restricted to a sample of its channels (:func:`_sampled_channels`), part by part where the
    parts' channels are separable (directions, channel blocks, parallel sums); an operator without
    ``CHANNEL_FIELDS`` (softmax, delta-rule heads, compositions) whole. SSD operators with several groups of B, C
    stay whole (a head subset would have to follow its group)."""
    if getattr(operator, "CHANNEL_SEPARABLE", False):
        def sampled(value):
            if isinstance(value, (list, tuple)):
                return type(value)(sampled(item) for item in value)
            return channel_sample(value, generator) if _is_operator(value) else value

        return dataclasses.replace(operator, **{f.name: sampled(getattr(operator, f.name))
                                                for f in dataclasses.fields(operator)})
    fields = getattr(operator, "CHANNEL_FIELDS", None)
    B = getattr(operator, "B", None)
    if fields is None or (torch.is_tensor(B) and B.dim() == 4 and B.shape[2] > 1):
        return operator
    index = _sampled_channels(operator, generator)
    return operator if index is None else select_channels(operator, index)


# Largest accepted relative difference between two kernel paths of the same maps (:func:`check_map_paths`), by the
# maps' dtype: the same pieces through other code (blocked GEMMs, per-channel blocks, the direct rows) differ by
# rounding only (float32: ~1e-6 measured at L = 1024).
MAP_PATH_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
MAP_PATH_TOKENS = 128  # the paths are compared on the first tokens: the leaves are causal, their maps a corner


def first_tokens(leaf, count: int):
    """A causal leaf operator on its first ``count`` tokens (its maps: the top-left corner of the full maps)."""
    changes = {}
    for f in dataclasses.fields(leaf):
        value = getattr(leaf, f.name)
        if torch.is_tensor(value) and value.dim() >= 2 and leaf.CHANNEL_FIELDS.get(f.name) != 0:
            changes[f.name] = value[:, :count]
    return dataclasses.replace(leaf, **changes)


def _magnitude(operator, g) -> torch.Tensor:
    """Σ_c |g_c[i] y_c[i]| per token, (B, L) float64: the scale of the rounding in Σ_c g_c y_c (with the parts that
    come from no token, which the contributions' own magnitudes leave out)."""
    if not hasattr(operator, "output"):
        return sum(_magnitude(part, part_g) for (_, part), part_g in zip(operator.parts, g))
    return (g.abs() * operator.output.detach().to(torch.float64).abs()).flatten(2).sum(-1)


def _leaves(operator):
    """The operators with ``CHANNEL_FIELDS`` in ``operator``, through its separable parts."""
    if getattr(operator, "CHANNEL_SEPARABLE", False):
        for f in dataclasses.fields(operator):
            value = getattr(operator, f.name)
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                for inner in (item if isinstance(item, tuple) else (item,)):
                    if _is_operator(inner):
                        yield from _leaves(inner)
    elif getattr(operator, "CHANNEL_FIELDS", None) is not None:
        yield operator


def check_map_paths(name: str, operator, generator) -> float:
    """The kernel paths that return maps, against the one :func:`check_maps` ties to the output, on a (sampled) leaf
    operator, on its first ``MAP_PATH_TOKENS`` tokens: per-channel rows (``maps(None, rows)``) contracted with a random
    g and the values must be its contributions entry by entry; the full maps and the rows path of the reductions
    (``"mean"``, whose path ``"sum"`` shares, and ``"abs_mean"``) must be the reductions of those per-channel rows.

    Returns:
        the largest relative difference.
    Raises:
        MapCheckError: above ``MAP_PATH_TOLERANCE``.
    """
    worst = 0.0
    for leaf in _leaves(operator):
        leaf = first_tokens(leaf, MAP_PATH_TOKENS)
        units = getattr(leaf, next(iter(leaf.CHANNEL_FIELDS))).shape[-1]
        B = getattr(leaf, "B", None)
        one_group = not (torch.is_tensor(B) and B.dim() == 4 and B.shape[2] > 1)  # a head subset must follow groups
        if units > 1 and one_group and leaf.values[0, 0].numel() // units >= MAP_CHECK_STRESSED:
            leaf = select_channels(leaf, torch.zeros(1, dtype=torch.long))  # heads of many channels: one is enough
        length = leaf.values.shape[1]
        rows = map_check_rows(length, leaf.values.device)
        per_channel = leaf.maps(None, rows)  # (B, C, R, L)
        tolerance = MAP_PATH_TOLERANCE.get(per_channel.dtype, 1e-4)
        per_channel = per_channel.to(torch.float64)
        values = leaf.values.detach().to(torch.float64).flatten(2)  # (B, L, Cv)
        g = torch.randn(leaf.output.shape, generator=generator, dtype=torch.float64).to(values.device)
        expanded = per_channel.repeat_interleave(values.shape[-1] // per_channel.shape[1], dim=1)
        expected = torch.einsum("brc,bcrj,bjc->brj", g.flatten(2)[:, rows], expanded, values)
        got = leaf.contributions(g, rows).to(torch.float64)
        pairs = [("per-channel rows", got, expected)]
        # ("sum" takes the path of "mean", which divides it by the channel count)
        for reduce, reduction in (("mean", lambda t: t.mean(1)), ("abs_mean", lambda t: t.abs().mean(1))):
            wanted = reduction(per_channel)
            pairs.append((f"{reduce} maps", leaf.maps(reduce, None)[:, rows].to(torch.float64), wanted))
            pairs.append((f"{reduce} rows", leaf.maps(reduce, rows).to(torch.float64), wanted))
        for what, got, wanted in pairs:
            scale = wanted.abs().max().item()
            difference = (got - wanted).abs().max().item() if got.numel() else 0.0
            relative = difference / scale if scale > 0 else difference
            if not relative <= tolerance:  # NaN included
                raise MapCheckError(
                    f"mamba_captum: the implicit-attention maps of {name} differ between the map kernels' paths "
                    f"({what}: relative {relative:.3g}, tolerance {tolerance:g}): a map kernel is wrong for this "
                    "layer. No maps are returned for it; please report the model class and config.")
            worst = max(worst, relative)
    return worst


def check_maps(name: str, operator, dtype: torch.dtype, token_mask=None, module=None) -> float:
    """Check the maps of ``operator`` where they are made: through the maps' own kernels, for a few query rows i
    (:func:`map_check_rows`) and a random channel weighting g, the contributions Σ_j Σ_c g_c[i] H_c[i, j] x_c[j]
    (``operator.contributions``) must add up to Σ_c g_c[i] y_c[i], with y the operator's output, which the layer check
    (:func:`check_reconstruction`) compared with the layer's real output; then the other kernel paths that return maps
    (full maps, per-channel maps, every reduction) must agree with those contributions (:func:`check_map_paths`). So
    a map kernel that loses precision (or a wrong kernel) cannot return numbers unnoticed; rows of padding tokens are
    not compared. Large operators are checked on a sample of their channels (:func:`channel_sample`: the most
    strongly decaying and random others). Cost: a few rows and the full maps of the sampled channels.

    Args:
        operator: a rebuilt operator (:mod:`mamba_captum.operators`) with its ``values`` and ``output``.
        dtype: the model's dtype (the tolerance's).
        token_mask: (B, L) or None, 1 for real tokens.
        module: the token mixer, whose non-finite weights a failure names.
    Returns:
        the relative error, ``max |Σ_j contributions − Σ_c g_c y_c| / max(Σ_j |contributions|, Σ_c |g_c y_c|)``.
    Raises:
        MapCheckError: above ``MAP_TOLERANCE`` for the model's dtype.
    """
    generator = torch.Generator().manual_seed(0)
    operator = channel_sample(operator, generator)
    g, target = _probe_and_target(operator, generator)
    rows = map_check_rows(target.shape[1], target.device)
    contributions = operator.contributions(g, rows).to(torch.float64)  # (B, R, L)
    from_biases = bias_operator(operator)
    if from_biases is not None:  # the conv biases' share of the output is in no map
        target = target[:, rows] - from_biases.contributions(g, rows).to(torch.float64).sum(-1)
    else:
        target = target[:, rows]
    tolerance = MAP_TOLERANCE.get(dtype, 1e-3)
    difference = (contributions.sum(-1) - target).abs()
    # the output's rounding scales with all of it: the tokens' share, and the biases' (which may be the larger)
    scale = torch.maximum(contributions.abs().sum(-1), _magnitude(operator, g)[:, rows])
    if token_mask is not None:
        real = token_mask.to(device=difference.device)[:, rows] != 0
        difference, scale = difference * real, scale * real
    finite = bool(torch.isfinite(contributions).all())
    largest = scale.max().item() if scale.numel() else 0.0
    relative = difference.max().item() / largest if largest > 0 else difference.max().item() if finite else 0.0
    if not finite or not relative <= tolerance:
        culprits = [] if module is None else nonfinite_parameters(module)
        if culprits:  # finite outputs from infinite weights (an infinite decay forgets all but the last token)
            raise NonFiniteError(
                f"mamba_captum: the implicit-attention maps of {name} cannot be computed: its weights are not finite "
                f"({', '.join(culprits)}), though the layer's output is; reload or repair them.")
        raise MapCheckError(
            f"mamba_captum: the implicit-attention maps of {name} do not reproduce the layer's output (relative error "
            f"{relative:.3g} over {len(rows)} checked rows, tolerance {tolerance:g}"
            f"{'' if finite else '; the maps hold NaN or inf'}), although the operator itself does: its parameters "
            f"put the maps' kernel out of its exact range{_largest_decay(operator)}. No maps are returned for it; "
            "please report the model class and config.")
    check_map_paths(name, operator, generator)
    return relative


def _largest_decay(operator) -> str:
    log_decay = getattr(operator, "log_decay", None)
    if not torch.is_tensor(log_decay):
        return ""
    source = getattr(operator, "decay_source", None)
    return (f" (largest per-token log-decay {log_decay.max().item():.3g}{f', set by {source}' if source else ''}: "
            "a decay this strong forgets all but the last tokens, beyond the float64 range of the maps' log-space "
            "sums)")
