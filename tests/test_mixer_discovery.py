"""Discovery of the token mixers of the installed transformers that are not plain softmax attention.

Every model type's modeling code (transformers/models/<type>/modeling_*.py, some 540 files) is read with ``ast``,
never imported (importing them all would take minutes), and every class whose code (what its __init__ and forward
run, the module-level helpers they call, the classes it inherits from) shows one of the signals below is a token
mixer that is not plain softmax attention. Each one found must be

- supported: in ``families.ADAPTERS``;
- part of a supported mixer: a submodule that a supported class builds (transitively) in its ``__init__`` and whose
  adapter explains it as part of its own operator (RecurrentGemma's RG-LRU, the KDA forget gates, ZAYA's CCA
  projection, Inkling2's key/value projections and their convolutions, xLSTM's kernel backend);
- or listed in ``mamba_captum.families.catalogue.EXCLUDED`` with the reason it is left out.

A new unlisted one fails with its class name, model type, file and signals. The other direction: every catalogued
or supported class that the installed transformers defines must be found by the detector (a weakened signal, or an
entry under the wrong model type, fails here), and the excluded classes that sit in a text decoder
(``catalogue.DECODER_MIXERS``) must be refused by name at run time, never skipped. Entries for classes that the
installed transformers does not define are tolerated: the suite runs on transformers 5.23 and 5.24, and some classes
exist in only one of them.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import gc
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch import nn

from mamba_captum import families
from mamba_captum.families import catalogue

MODELS = Path(importlib.util.find_spec("transformers").origin).parent / "models"

# Supported classes the detector does not look for, and why: the recall check below skips them.
NOT_DETECTED = {
    "Lfm3VlVisionShortConv": "a depthwise Conv2d over the patch grid of LFM3-VL's vision tower (the detector reads "
                             "one-dimensional mixers; 2-D vision convolutions are everywhere in vision backbones)",
    "Lfm3VlVisionAttention": "softmax attention over packed patches, supported for its per-image segments",
}

# ---------------------------------------------------------------------------------------------------------------
# The signals, read in what a class runs: its __init__ (its parameters and submodules), its forward (or __call__),
# the methods these call on self and the module-level functions they call or reference, transitively, and the same
# of the classes it inherits from (a renamed subclass of a mixer is a class the adapters must name too). Other
# methods (generate, weight init, utilities) are not read. Each signal is precise on its own: it fires in a class
# that mixes tokens otherwise than by a softmax over keys, or in one of the look-alikes the catalogue excludes with
# a reason; a real mixer fires several, so one renamed kernel or one rewritten loop does not hide it.
# ---------------------------------------------------------------------------------------------------------------

# 1. sequence kernel: transformers registers the torch body of every scan / delta-rule / causal-conv kernel with
#    @use_kernel_func_from_hub_with_fallback(<kernel>, <package>); the packages that hold such kernels:
SEQUENCE_KERNEL_PACKAGES = ("mamba_ssm", "fla", "causal_conv1d")
#    and a call of a function named like a scan that is not registered so (RWKV's WKV, RG-LRU's _rnn_scan, Mamba's
#    pscan, the mLSTM kernels, Mamba-2's segment sums, fla-style chunk_* / fused_recurrent_* functions; a
#    capitalised name is a class, the model's own submodule, and does not count)
SCAN_FUNCTION = re.compile(r"selective_scan|selective_state_update|chunk_scan|_rnn_scan|associative_scan|^pscan$|"
                           r"(^|_)wkv|rwkv\w*linear_attention|delta_rule|delta_attention|kda|segment_sum|segsum|"
                           r"^mlstm_|^slstm_|lightning_attn|linear_attention|^fused_recurrent_|^fused_chunk_|"
                           r"^chunk_\w*(scan|delta|gla|retention|rwkv|attn|attention)")
# 2. decay parameter: Mamba's A_log and its Δ projection (dt_proj) or bias (dt_bias), which the gated delta rules
#    and KDA share; RWKV's time_decay / time_first. Assigned as self.<name>.
DECAY_PARAMETERS = ("A_log", "dt_bias", "dt_proj", "time_decay", "time_first")
# 3. recurrence: a Python loop over range(n) that carries a state from step to step, with n not fixed by the
#    configuration (not read from self or config: loops over layers, heads, channels or codebooks are), where a
#    variable's first assignment in the loop body reads its previous value transformed (`h = a[:, t] * h + b[:, t]`,
#    `h, c = cell(x_t, (h, c))`; a running sum `s = s + e` does not count) together with the step's slice of
#    another sequence: a subscript along a non-leading axis at an index computed from the loop variable (`x[:, t]`,
#    `k[:, :, start:end]`), or a value computed from one.
# 4. cumulative decay: exp of a cumulative sum / product (directly or through names computed from it): the decay
#    exp(Σ_{k=j+1..i} a_k) between two positions, the core of the chunked scans (segsum, chunked delta rules).
CUMULATIVE = ("cumsum", "cumprod", "logcumsumexp")
# 5. depthwise convolution: nn.Conv1d(C, C, k > 1, groups=C), a per-channel convolution along the sequence (the
#    short convolutions of Mamba, the delta rules, LFM2, Inkling, RG-LRU; also the conformer convolutions over audio
#    frames, which the catalogue excludes), or a grouped functional conv1d(x, w, groups=g). Causal or not: ZAYA pads
#    on the left by hand, with padding=0.
# 6. key-value state: linear attention's K^T V (a key operand transposed on the LEFT of a matmul with values, where
#    softmax attention has Q K^T) and the elu(q) + 1 feature map on queries or keys.
# 7. sliding windows: x.unfold(dim, k, 1), the windows of k consecutive positions of a hand-written local
#    convolution (Inkling2's per-token taps); patches (step k) and frames (step = hop) have a step other than 1.
# 8. Fourier transform: a use of torch.fft (called or passed as a value), a global mixing of the positions (FNet's
#    Fourier sublayer, Autoformer's auto-correlation; also the inverse STFT heads of audio codecs).

# What a function's text must contain for one of the signals to fire in it, matched on the text (fast) before its
# syntax tree is walked (slow): walking every function of transformers would take most of the test's time.
GATE_TOKENS = ("scan", "selective_state_update", "wkv", "delta_rule", "delta_attention", "kda", "segment_sum",
               "segsum", "mlstm_", "slstm_", "lightning_attn", "linear_attention", "fused_recurrent_", "fused_chunk_",
               *DECAY_PARAMETERS, *CUMULATIVE, "Conv1d", "conv1d", ".mT", "unfold", "fft")
GATE_PATTERNS = (("range", re.compile(r"^\s*for\s+\w+\s+in\s+range\b", re.MULTILINE)),  # a loop statement
                 ("chunk_", re.compile(r"\bchunk_\w*(scan|delta|gla|retention|rwkv|attn|attention)")),
                 ("transpose", re.compile(r"transpose\s*\(\s*-")), ("elu", re.compile(r"\belu\b")))


def _may_signal(text: str) -> bool:
    return any(token in text for token in GATE_TOKENS) or any(
        token in text and pattern.search(text) for token, pattern in GATE_PATTERNS)


def _called(node: ast.Call) -> str | None:
    function = node.func
    return function.id if isinstance(function, ast.Name) else function.attr if isinstance(function,
                                                                                          ast.Attribute) else None


def _is_method_call(node: ast.Call) -> bool:  # self.x(...): a child module or a method, resolved elsewhere
    function = node.func
    return isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name) and function.value.id == "self"


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _nodes(node: ast.AST) -> list[ast.AST]:
    """The node and all below it, like ast.walk (written out: this is the detector's inner loop), without entering
    nested classes (classes of their own)."""
    found, position = [node], 0
    while position < len(found):
        current = found[position]
        position += 1
        for name in current._fields:
            value = getattr(current, name, None)
            if isinstance(value, list):
                found += [item for item in value if isinstance(item, ast.AST) and not isinstance(item, ast.ClassDef)]
            elif isinstance(value, ast.AST) and not isinstance(value, ast.ClassDef):
                found.append(value)
    return found


def _assignments(nodes):
    """(targets, value, node) of the plain, annotated and augmented assignments among nodes."""
    for node in nodes:
        if isinstance(node, ast.Assign):
            yield node.targets, node.value, node
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            yield [node.target], node.value, node


def _bound(targets) -> set[str]:
    """The names an assignment binds (x; x, y and z in `x, (y, z) = ...`); stores into elements or attributes bind
    none (`out[:, t] = y` writes an output, it carries no state)."""
    names, todo = set(), list(targets)
    while todo:
        target = todo.pop()
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            todo += target.elts
        elif isinstance(target, ast.Starred):
            todo.append(target.value)
    return names


def _reads_itself(targets, value, node) -> bool:
    return bool(_bound(targets)) and (isinstance(node, ast.AugAssign) or bool(_bound(targets) & _names(value)))


def _derived(assignments, seeds: set[str]) -> set[str]:
    """seeds and every name assigned from an expression that reads one of them, to a fixpoint; the assignments that
    read their own target do not pass a seed on (a state is not the step's input)."""
    flows = [(_bound(targets), _names(value)) for targets, value, node in assignments
             if not _reads_itself(targets, value, node)]
    names, grown = set(seeds), True
    while grown:
        grown = False
        for bound, read in flows:
            if read & names and not bound <= names:
                names |= bound
                grown = True
    return names


def _running_sum(targets, value, node) -> bool:
    """s = s + e, s = e + s, s -= e, s += e with s not in e: an accumulation (a sum over heads, codebooks, tensor-
    parallel slices), not a recurrence."""
    bound = _bound(targets)
    if isinstance(node, ast.AugAssign):
        return isinstance(node.op, (ast.Add, ast.Sub)) and not (bound & _names(value))
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Sub)):
        for own, other in ((value.left, value.right), (value.right, value.left)):
            if isinstance(own, ast.Name) and own.id in bound and not (bound & _names(other)):
                return True
    return False


def _recurrence(nodes) -> int | None:
    """The line of a state update in a loop over the steps of a sequence (signal 3), or None."""
    for loop in nodes:
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Call)
                and isinstance(loop.iter.func, ast.Name) and loop.iter.func.id == "range"):
            continue
        if {"self", "config"} & _names(loop.iter):  # a count fixed by the configuration: layers, heads, codebooks
            continue
        body = [node for statement in loop.body for node in _nodes(statement)]
        assignments = sorted(_assignments(body), key=lambda item: (item[2].lineno, item[2].col_offset))
        index = _derived(assignments, {loop.target.id})
        steps = {id(node): _names(node.value) for node in body if isinstance(node, ast.Subscript)
                 and isinstance(node.slice, ast.Tuple) and any(_names(element) & index for element in node.slice.elts)}
        if not steps:
            continue

        def slices_a_step(value, state=frozenset()):  # a step's slice of a sequence other than the state itself
            return any(id(node) in steps and not steps[id(node)] & state for node in ast.walk(value))

        step_values = _derived(assignments, {name for targets, value, _ in assignments if slices_a_step(value)
                                             for name in _bound(targets)})
        first: dict[str, tuple] = {}  # name -> the first assignment that binds it in the loop body
        for targets, value, node in assignments:
            for name in _bound(targets):
                first.setdefault(name, (targets, value, node))
        for name, (targets, value, node) in first.items():
            state = _bound(targets)
            carried = isinstance(node, ast.AugAssign) or name in _names(value)  # reads last step's value first
            if carried and not _running_sum(targets, value, node) \
                    and ((_names(value) - state) & step_values or slices_a_step(value, state)):
                return node.lineno
    return None


def _cumulative_decay(nodes) -> int | None:
    if not any(isinstance(node, ast.Call) and _called(node) in CUMULATIVE for node in nodes):
        return None
    assignments = list(_assignments(nodes))
    cumulative = _derived(assignments, {name for targets, value, _ in assignments
                                        if any(isinstance(n, ast.Call) and _called(n) in CUMULATIVE
                                               for n in ast.walk(value)) for name in _bound(targets)})
    for node in nodes:
        if isinstance(node, ast.Call) and _called(node) == "exp":
            argument = node.args[0] if node.args else getattr(node.func, "value", None)  # torch.exp(x) / x.exp()
            if argument is not None and (_names(argument) & cumulative or any(
                    isinstance(n, ast.Call) and _called(n) in CUMULATIVE for n in ast.walk(argument))):
                return node.lineno
    return None


def _same(a, b) -> bool:
    return a is not None and b is not None and ast.dump(a) == ast.dump(b)


def _depthwise_conv(node: ast.Call) -> bool:
    keywords = {keyword.arg: keyword.value for keyword in node.keywords}
    if _called(node) == "conv1d" and not _is_method_call(node):  # F.conv1d(x, w, groups=g): grouped, g != 1
        groups = keywords.get("groups", node.args[6] if len(node.args) > 6 else None)
        return groups is not None and not (isinstance(groups, ast.Constant) and groups.value == 1)
    if _called(node) != "Conv1d":
        return False
    in_channels = node.args[0] if node.args else keywords.get("in_channels")
    out_channels = node.args[1] if len(node.args) > 1 else keywords.get("out_channels")
    kernel = node.args[2] if len(node.args) > 2 else keywords.get("kernel_size")
    groups = keywords.get("groups")
    pointwise = isinstance(kernel, ast.Constant) and kernel.value == 1
    return (_same(groups, in_channels) or _same(groups, out_channels)) and not pointwise


def _sliding_windows(node: ast.Call) -> bool:
    if _called(node) != "unfold" or not isinstance(node.func, ast.Attribute):
        return False
    keywords = {keyword.arg: keyword.value for keyword in node.keywords}
    step = node.args[2] if len(node.args) > 2 else keywords.get("step")
    return isinstance(step, ast.Constant) and step.value == 1


def _transposed_key(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "mT":
        inner = node.value
    elif isinstance(node, ast.Call) and _called(node) == "transpose" and isinstance(node.func, ast.Attribute) \
            and {ast.unparse(argument) for argument in node.args} == {"-1", "-2"}:
        inner = node.func.value
    else:
        return False
    return any(_query_or_key(name, "k", "key") for name in _names(inner))


def _query_or_key(name: str, *stems: str) -> bool:
    stems = stems or ("q", "query", "k", "key")
    return any(name == stem or name.startswith(stem + "_") or (len(stem) > 1 and stem in name) for stem in stems)


def _key_value_state(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        left, right = node.left, node.right
    elif isinstance(node, ast.Call) and _called(node) in ("matmul", "bmm") and len(node.args) == 2:
        left, right = node.args
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.left, ast.Call):
        return _called(node.left) == "elu" and isinstance(node.right, ast.Constant) and node.right.value == 1 \
            and any(_query_or_key(name) for argument in node.left.args for name in _names(argument))
    else:
        return False
    return _transposed_key(left) and any(_query_or_key(name, "v", "value") for name in _names(right))


# ---------------------------------------------------------------------------------------------------------------
# The index of the modeling files and the detector
# ---------------------------------------------------------------------------------------------------------------

ENTRY_METHODS = ("__init__", "forward", "__call__")
SELF_CALL = re.compile(r"\bself\.(\w+)\s*\(")


@dataclass(frozen=True)
class Found:
    name: str
    model_type: str
    path: str  # transformers/models/<type>/modeling_<x>.py
    signals: tuple[tuple[str, int], ...]  # (signal, line in the file where it fires, maybe in a helper)

    def __str__(self):
        return (f"{self.name} (model type {self.model_type!r}, {self.path}; signals: "
                f"{', '.join(f'{signal} @{line}' for signal, line in self.signals)})")


@dataclass
class ClassFacts:
    """What the survey keeps of a class once its file's syntax tree is dropped."""
    path: str
    signals: dict[str, int]  # of what it runs, and of the classes it inherits from in its own file
    imported_bases: list[tuple[str, str]]  # (model type, class) of the bases it imports from other model types
    children: set[tuple[str, str]]  # (model type, class) of the classes its __init__ builds


def _top_level(tree: ast.Module):
    """The module's statements, entering if / try blocks (xLSTM defines its classes under `if is_xlstm_available()`)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.If, ast.Try)):
            todo[:0] = [*node.body, *node.orelse, *(s for h in getattr(node, "handlers", ()) for s in h.body),
                        *getattr(node, "finalbody", ())]
        else:
            yield node


def _kernel_of(function: ast.FunctionDef) -> str | None:
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and _called(decorator) == "use_kernel_func_from_hub_with_fallback" \
                and len(decorator.args) >= 2 and all(isinstance(a, ast.Constant) for a in decorator.args[:2]) \
                and decorator.args[1].value in SEQUENCE_KERNEL_PACKAGES:
            return f"{decorator.args[1].value}.{decorator.args[0].value}"
    return None


def _words(names) -> re.Pattern | None:
    return re.compile(r"\b(?:%s)\b" % "|".join(map(re.escape, names))) if names else None


def _direct_signals(nodes) -> dict[str, int]:
    """The signals that fire in these nodes themselves (not in what they call), each with its first line."""
    signals: dict[str, int] = {}
    for node in nodes:
        if isinstance(node, ast.Call):
            name = _called(node)
            if name and not name[0].isupper() and SCAN_FUNCTION.search(name) and not _is_method_call(node):
                signals.setdefault(f"scan {name}", node.lineno)
            if _depthwise_conv(node):
                signals.setdefault("depthwise conv", node.lineno)
            if _sliding_windows(node):
                signals.setdefault("sliding windows", node.lineno)
        if isinstance(node, (ast.Call, ast.BinOp)) and _key_value_state(node):
            signals.setdefault("key-value state", node.lineno)
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Attribute, ast.Name)) \
                and (node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id) == "fft":
            signals.setdefault("Fourier transform", node.lineno)  # torch.fft.<function>
    for targets, _, node in _assignments(nodes):
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self" \
                    and target.attr in DECAY_PARAMETERS:
                signals.setdefault(f"decay parameter {target.attr}", node.lineno)
    line = _recurrence(nodes)
    if line:
        signals.setdefault("recurrence", line)
    line = _cumulative_decay(nodes)
    if line:
        signals.setdefault("cumulative decay", line)
    return signals


class ModelingFile:
    """One modeling file, read once: the facts of its classes (:meth:`facts`). Files are read one at a time and their
    syntax trees dropped (all of them at once hold ~1 GB, and their millions of nodes slow every garbage collection
    of the test process)."""

    def __init__(self, path: Path):
        self.model_type, self.path = path.parent.name, str(path.relative_to(MODELS.parent.parent))
        self.source = path.read_text(encoding="utf-8")
        self.line_starts = [0, *(match.end() for match in re.finditer("\n", self.source)), len(self.source)]
        self.functions: dict[str, ast.FunctionDef] = {}  # the module-level ones
        self.classes: dict[str, list[ast.ClassDef]] = {}  # a list: xLSTM defines some in both if and else
        self.kernels: dict[str, str] = {}  # function -> the "package.kernel" it is the torch body of
        self.imports: dict[str, str] = {}  # name -> the model type it is imported from (from ..<type>...)
        for node in _top_level(ast.parse(self.source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
                kernel = _kernel_of(node)
                if kernel:
                    self.kernels[node.name] = kernel
            elif isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = node.module.split(".")[0]
        self.function_names = _words(self.functions)
        self._signalling: re.Pattern | bool | None = None
        self._function_signals: dict[int, dict[str, int]] = {}
        self._class_signals: dict[str, dict[str, int]] = {}

    def text(self, node: ast.AST) -> str:
        return self.source[self.line_starts[node.lineno - 1]:self.line_starts[node.end_lineno]]

    def facts(self, wanted) -> dict[str, ClassFacts]:
        """The facts of each class; the submodules it builds only where a chain from a `wanted` class to a found one
        may pass: a file that defines a wanted class, or a found one, or imports from another model type (reading
        every __init__ of transformers would cost a second and a half; AutoModel, imported by many, builds none of
        the classes read here)."""
        signals = {name: self.class_signals(name) for name in self.classes}
        wiring = set(self.imports.values()) - {"auto"} or any(signals.values()) or not wanted.isdisjoint(self.classes)
        return {name: ClassFacts(self.path, signals[name],
                                 [(self.imports[base], base) for base in self.bases(name)
                                  if base not in self.classes and base in self.imports],
                                 self.children(name) if wiring else set()) for name in self.classes}

    def function_signals(self, function: ast.FunctionDef,
                         methods: dict[str, ast.FunctionDef] | None = None) -> dict[str, int]:
        """The signals of a function (of a method, with its class's `methods`), of the module-level functions it
        calls or names (xLSTM passes its kernels around as values) and of the methods it calls on self."""
        key = id(function)
        if key in self._function_signals:
            return self._function_signals[key]
        self._function_signals[key] = signals = {}  # what a recursive call sees while this one is being read
        text = self.text(function)
        # the callees that may matter, by name in the text; a method needs only the module functions that signal
        names = self.function_names if methods is None else self.signalling()
        helpers = {name: self.functions[name] for name in (names.findall(text) if names else ())}
        helpers.pop(function.name, None)
        callees = [(helper, None) for helper in helpers.values()]
        if methods is not None:
            callees += [(methods[name], methods) for name in SELF_CALL.findall(text) if name in methods]
        callee_signals = [self.function_signals(callee, context) for callee, context in callees]
        if not (_may_signal(text) or any(callee_signals) or set(helpers) & set(self.kernels)):
            return signals
        nodes = _nodes(function)
        signals.update(_direct_signals(nodes))
        for node in nodes:  # the callees, now read from the syntax tree (the text may name them in a docstring)
            if isinstance(node, ast.Name) and node.id in helpers:
                if node.id in self.kernels:
                    signals.setdefault(f"sequence kernel {self.kernels[node.id]}", node.lineno)
                for signal, line in self.function_signals(helpers[node.id]).items():
                    signals.setdefault(signal, line)
            elif methods is not None and isinstance(node, ast.Call) and _is_method_call(node) \
                    and node.func.attr in methods and methods[node.func.attr] is not function:
                for signal, line in self.function_signals(methods[node.func.attr], methods).items():
                    signals.setdefault(signal, line)
        return signals

    def signalling(self) -> re.Pattern | None:
        """The names of the module-level functions that signal or are sequence kernels, as words."""
        if self._signalling is None:
            self._signalling = _words([name for name, helper in self.functions.items()
                                       if name in self.kernels or self.function_signals(helper)]) or False
        return self._signalling or None

    def bases(self, name: str) -> list[str]:
        return [base.id for definition in self.classes[name] for base in definition.bases if isinstance(base, ast.Name)]

    def class_signals(self, name: str, seen=()) -> dict[str, int]:
        """The signals of what a class runs (ENTRY_METHODS and what they call) and of its bases in this file."""
        if name not in self._class_signals:
            signals: dict[str, int] = {}
            for definition in self.classes[name]:
                text, signalling = self.text(definition), self.signalling()
                if _may_signal(text) or signalling and signalling.search(text):  # else nothing in it can signal
                    methods = {member.name: member for member in definition.body
                               if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef))}
                    for entry in ENTRY_METHODS:
                        if entry in methods:
                            for signal, line in self.function_signals(methods[entry], methods).items():
                                signals.setdefault(signal, line)
            for base in self.bases(name):
                if base in self.classes and base != name and base not in seen:
                    for signal, line in self.class_signals(base, (*seen, name)).items():
                        signals.setdefault(signal, line)
            self._class_signals[name] = signals
        return self._class_signals[name]

    def children(self, name: str) -> set[tuple[str, str]]:
        """(model type, class) of the classes of this file or imported ones that the class's __init__ builds."""
        built = set()
        for definition in self.classes[name]:
            for member in definition.body:
                if isinstance(member, ast.FunctionDef) and member.name == "__init__":
                    for node in _nodes(member):
                        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id != name:
                            if node.func.id in self.classes:
                                built.add((self.model_type, node.func.id))
                            elif node.func.id in self.imports:
                                built.add((self.imports[node.func.id], node.func.id))
        return built


@dataclass(frozen=True)
class Survey:
    found: dict[str, list[Found]]  # class name -> where the detector finds it
    defined: dict[str, set[str]]  # class name -> the model types whose modeling files define it
    descendants: dict[str, set[str]]  # supported or awaited class -> the classes it builds, transitively


def _inherited(facts: dict[tuple[str, str], ClassFacts], key: tuple[str, str], seen=()) -> dict[str, int]:
    """A class's signals with those of the bases it imports from other model types (transitively)."""
    signals = dict(facts[key].signals)
    for base in facts[key].imported_bases:
        if base in facts and base not in seen:
            for signal, line in _inherited(facts, base, (*seen, key)).items():
                signals.setdefault(signal, line)
    return signals


def _descendants(facts: dict[tuple[str, str], ClassFacts], name: str) -> set[str]:
    result: set[str] = set()
    todo = [key for key in facts if key[1] == name]
    while todo:
        for child in facts[todo.pop()].children:
            if child[1] not in result and child in facts:
                result.add(child[1])
                todo.append(child)
    return result


@contextlib.contextmanager
def _without_cyclic_gc():
    """Parsing allocates millions of syntax-tree nodes; in a process that holds torch and transformers, the cyclic
    garbage collector would walk that big heap again and again meanwhile (parsing took 6.4 s instead of 2.9 s). The
    trees hold no cycles: each file's is freed by reference counting when the next file is read."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@functools.lru_cache(maxsize=1)
def survey() -> Survey:
    """Read every modeling file of the installed transformers, one at a time (what the tests need of them)."""
    facts: dict[tuple[str, str], ClassFacts] = {}  # (model type, class) -> its facts
    wanted = set(families.ADAPTERS)
    with _without_cyclic_gc():
        for path in sorted(MODELS.glob("*/modeling_*.py")):
            modeling = ModelingFile(path)
            for name, class_facts in modeling.facts(wanted).items():
                facts.setdefault((modeling.model_type, name), class_facts)  # a model type's other file: the first
    found: dict[str, list[Found]] = {}
    defined: dict[str, set[str]] = {}
    for (model_type, name), class_facts in facts.items():
        defined.setdefault(name, set()).add(model_type)
        signals = _inherited(facts, (model_type, name))
        if signals:
            found.setdefault(name, []).append(Found(name, model_type, class_facts.path,
                                                    tuple(sorted(signals.items(), key=lambda item: item[1]))))
    return Survey(found, defined, {name: _descendants(facts, name) for name in wanted})


def inside_supported() -> dict[str, str]:
    """class name -> the supported class that builds it (its adapter explains it as part of its operator)."""
    inside = {}
    for supported in sorted(families.ADAPTERS):
        for child in survey().descendants[supported]:
            inside.setdefault(child, supported)
    return inside


def classify() -> dict[str, tuple[str, str]]:
    """Every discovered class -> (status, detail): ("supported", its adapter module), ("inside", the supported class
    that builds it), ("excluded", the catalogue's reason) or ("unlisted", "")."""
    inside = inside_supported()
    table = {}
    for name in survey().found:
        if name in families.ADAPTERS:
            table[name] = ("supported", families.ADAPTERS[name].name)
        elif name in inside:
            table[name] = ("inside", inside[name])
        elif name in catalogue.EXCLUDED:
            table[name] = ("excluded", catalogue.EXCLUDED[name][1])
        else:
            table[name] = ("unlisted", "")
    return table


# ---------------------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------------------

def test_every_discovered_mixer_is_supported_or_catalogued():
    unlisted = [found for name, (status, _) in classify().items() if status == "unlisted"
                for found in survey().found[name]]
    assert not unlisted, (
        "token mixers that are not plain softmax attention, neither supported nor catalogued: write an adapter, or "
        "add each to mamba_captum/families/catalogue.py with the reason it is left out:\n  "
        + "\n  ".join(map(str, unlisted)))


def test_the_detector_finds_every_catalogued_and_supported_class_the_installed_transformers_defines():
    """Recall: a listed class that the installed transformers defines but the detector misses means a weakened signal
    (or a catalogue entry under the wrong model type). A supported softmax attention with convolutions inside
    (ZAYA, Inkling) is found through the convolutions it builds. Classes the installed version does not define are
    tolerated (another transformers version's, or the library's own VimMixer)."""
    defined, found = survey().defined, survey().found
    missed = []
    for name, (model_type, _) in catalogue.EXCLUDED.items():
        if name not in defined:
            continue
        if name not in found:
            missed.append(f"{name} (catalogued, model type {model_type!r}): not found")
        elif model_type not in {f.model_type for f in found[name]}:
            missed.append(f"{name}: catalogued under model type {model_type!r}, found in "
                          f"{sorted(f.model_type for f in found[name])}")
    for name in families.ADAPTERS:
        if name in defined and name not in NOT_DETECTED and name not in found \
                and not survey().descendants[name] & set(found):
            missed.append(f"{name} (supported, defined in {sorted(defined[name])}): not found, nor any "
                          "mixer it builds")
    assert not missed, "\n".join(missed)


def test_the_catalogue_is_consistent_and_documented():
    page = (Path(__file__).resolve().parents[1] / "docs" / "families" / "coverage.md").read_text(encoding="utf-8")
    unnamed = [name for name in catalogue.EXCLUDED if f"`{name}`" not in page]
    assert not unnamed, f"docs/families/coverage.md does not name these catalogued classes: {unnamed}"
    for name, entry in catalogue.EXCLUDED.items():
        assert isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(part, str) and part for part in entry), \
            name
        assert name not in families.ADAPTERS, f"{name} is both supported and excluded"
    assert set(catalogue.DECODER_MIXERS) <= set(catalogue.EXCLUDED)


@pytest.mark.parametrize("name", sorted(catalogue.DECODER_MIXERS))
def test_locate_refuses_an_excluded_decoder_mixer_by_name_with_its_reason(name):
    """An excluded class that sits in a text decoder's layers is refused by locate() (so by every entry point), with
    the catalogue's reason: skipped, it would leave a token mixer out of the explanation without a word. The refusal
    is by name, so a stand-in module of that class name in a decoder layer shows it."""
    layer = nn.Module()
    layer.mixer = type(name, (nn.Module,), {})()
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    reason = re.escape(catalogue.EXCLUDED[name][1])
    with pytest.raises(TypeError, match=rf"layer 0 \(mixer\) uses the token mixer {name}, which cannot be explained "
                                        rf"exactly: {reason}\."):
        families.locate(model)
