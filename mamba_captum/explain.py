"""Texts in, explanations out: the layer the CLI, the HTML report and the Trainer callback share.

``explain(model, tokenizer, texts)`` runs the methods (by default every one the model supports) on each text and
returns :class:`Explanation` records (tokens, prediction, per-method relevance, per-layer implicit-attention maps)
that serialise to JSON.
"""
from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path

import torch

from .attention import implicit_attention
from .checks import input_device as _input_device
from .attr import MambaAttribution, MambaLRP, MambaRawAttention, MambaRollout, MambaSelectionAttribution
from .families import SUPPORTED_MIXERS, decoder_layers
from .session import session

METHODS = {"raw": MambaRawAttention, "rollout": MambaRollout, "attribution": MambaAttribution,
           "selection": MambaSelectionAttribution, "lrp": MambaLRP}
# the methods that explain one output (``target``); raw and rollout read the operator alone
CLASS_SPECIFIC = ("attribution", "selection", "lrp")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(ValueError):
    """A problem with what the user asked for (a path, a target, a text): the CLI prints it as one line."""


@dataclasses.dataclass
class Explanation:
    """One explained text.

    Attributes:
        text: the input text.
        tokens: its L tokens (special tokens included; padding never).
        prediction, probability: the predicted label / token and its probability (over ``labels`` when the model
            has label words, over the whole vocabulary or the classes otherwise).
        target, target_probability: what was explained (the prediction unless a target was given).
        relevance: method name -> L scores (raw and rollout are class-agnostic; attribution explains ``target``).
        layer_maps: layer index -> (L, L) channel-mean implicit attention (query row, key column), or None.
        settings: formulation and the model's name, for the report.
        display_tokens: the L tokens as readable text (see :func:`readable_tokens`), or None.
    """
    text: str
    tokens: list[str]
    prediction: str
    probability: float
    target: str
    target_probability: float
    relevance: dict[str, list[float]]
    layer_maps: dict[int, torch.Tensor] | None = None
    settings: dict = dataclasses.field(default_factory=dict)
    display_tokens: list[str] | None = None  # the tokens as text (byte-level BPE's "Ġthe" -> "the"), for people

    def shown(self) -> list[str]:
        """The tokens to show people: ``display_tokens`` when known, else ``tokens``."""
        return self.display_tokens or self.tokens

    def top_tokens(self, method: str, k: int = 3) -> list[tuple[str, float]]:
        """The ``k`` tokens (as shown to people, :meth:`shown`) with the largest |relevance| under ``method``,
        largest first, with their scores."""
        scores = self.relevance[method]
        return [(self.shown()[i], float(scores[i])) for i in self.top_indices(method, k)]

    def top_indices(self, method: str, k: int = 3) -> list[int]:
        """The positions of :meth:`top_tokens`: the ``k`` largest |relevance| under ``method``, largest first."""
        return torch.tensor(self.relevance[method]).abs().argsort(descending=True, stable=True)[:k].tolist()

    def to_dict(self) -> dict:
        """JSON-safe: everything but the layer maps."""
        return {"text": self.text, "tokens": self.tokens, "display_tokens": self.shown(), "prediction": self.prediction,
                "probability": self.probability, "target": self.target,
                "target_probability": self.target_probability, "relevance": self.relevance,
                "top_tokens": {name: self.top_tokens(name) for name in self.relevance}, "settings": self.settings}


    @classmethod
    def from_dict(cls, row: dict) -> "Explanation":
        """The explanation :meth:`to_dict` wrote (without its layer maps)."""
        return cls(text=row["text"], tokens=row["tokens"], prediction=row["prediction"],
                   probability=row["probability"], target=row["target"], target_probability=row["target_probability"],
                   relevance=row["relevance"], settings=row.get("settings", {}), display_tokens=row.get("display_tokens"))


def readable_tokens(tokenizer, tokens) -> list[str]:
    """Each token as the text it stands for (byte-level BPE's ``Ġthe`` -> ``the``, SentencePiece's ``▁the`` ->
    ``the``); a token that reads as blank (a space, a newline) keeps its vocabulary spelling."""
    shown = []
    for token in tokens:
        try:
            text = tokenizer.convert_tokens_to_string([token]).strip()
        except (TypeError, ValueError, KeyError):
            text = ""
        shown.append(text or token)
    return shown


def is_classifier(model) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def check_supported(model) -> None:
    """Raise :class:`UsageError` unless ``model`` is a causal LM or sequence classifier with a supported mixer."""
    name = type(model).__name__
    if not (is_classifier(model) or getattr(model, "get_output_embeddings", lambda: None)() is not None):
        raise UsageError(f"{name} is neither a *ForCausalLM nor a *ForSequenceClassification model; explain it with "
                         "the Python API and a forward_func instead.")
    if not any(type(module).__name__ in SUPPORTED_MIXERS for module in model.modules()):
        raise UsageError(f"model type {model.config.model_type!r} has no token mixer mamba-captum explains "
                         f"(supported: Mamba, Mamba-2, RWKV, RecurrentGemma and the hybrids; see the README).")


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    if lines[0].endswith(":") and len(lines) > 1:  # "Validation error for field 'x':" says nothing alone
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def check_device(device) -> torch.device:
    """``device`` as a torch device that can hold this run's tensors, else :class:`UsageError` (before any loading,
    so a typo costs no model load)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"device {device!r} is not available: it is not a torch device name; choose cpu, cuda or "
                         "cuda:N.") from None
    if parsed.type == "meta":  # meta tensors have shapes but no values: nothing to explain
        raise UsageError(f"device {device!r} holds no data (only tensor shapes), so nothing can be computed on it; "
                         "choose cpu, cuda or cuda:N.")
    if parsed.type == "cuda" and torch.cuda.is_available() and (parsed.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"device {device!r} is not available: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    try:
        torch.empty(1, device=parsed)
    except Exception as error:  # AssertionError (no CUDA build), NotImplementedError (no backend), ModuleNotFoundError
        reason = _first_line(error).split(". ")[0]
        raise UsageError(f"device {device!r} is not available on this machine ({reason}); choose cpu or an "
                         "available cuda:N.") from None
    return parsed


def _weight_files(path: Path) -> list[Path]:
    """The weight files ``from_pretrained`` reads from a checkpoint directory (safetensors first, as HF does)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            try:
                shards = json.loads((path / index).read_text(encoding="utf-8"))["weight_map"].values()
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                raise UsageError(f"the weights index {str(path / index)!r} is not a valid index file (JSON with a "
                                 "\"weight_map\"); re-save the checkpoint with save_pretrained.") from None
            return [path / shard for shard in sorted(set(map(str, shards)))]
    return []


def _corrupt(files, detail: str) -> UsageError:
    if len(files) == 1:
        named, them = f"file {str(files[0])!r} is", "it"
    else:  # a .bin shard torch.load could not read, among several
        named, them = f"files {', '.join(repr(str(f)) for f in files)} are", "them"
    return UsageError(f"the weights {named} corrupt or truncated ({detail}); re-save {them} with save_pretrained or "
                      f"download {them} again.")


def _check_weight_files(path: Path) -> None:
    """Refuse a corrupt or truncated safetensors file by name: its header must describe exactly the file's bytes,
    which a cut-off copy or a file of other bytes does not (reading the header is cheap; the tensors stay on disk)."""
    from safetensors import SafetensorError, safe_open

    for file in _weight_files(path):
        if file.suffix != ".safetensors" or not file.is_file():
            continue  # a missing shard: from_pretrained names it
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError as error:
            raise _corrupt([file], _first_line(error)) from None


def _check_vocabulary(tokenizer, path: Path) -> None:
    if not set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):
        # transformers builds an empty tokenizer when the files are missing: every text would read as nothing
        raise UsageError(f"the tokenizer in {str(path)!r} has no vocabulary (its tokenizer.json / vocabulary files "
                         "are missing); save it there with tokenizer.save_pretrained(DIR).")


def load(model_dir, *, device: str = "cpu", dtype: str = "float32", device_map=None, max_memory=None,
         offload_folder=None):
    """A local HF checkpoint directory -> (model in eval mode, tokenizer), offline. Errors are :class:`UsageError`.

    ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"`` or a dict module name -> device / ``"cpu"`` /
    ``"disk"``), with ``max_memory`` (device -> size, e.g. ``{0: "20GiB", "cpu": "60GiB"}``) and ``offload_folder``
    (for ``"disk"``; default a temporary folder removed at exit), loads the model dispatched by accelerate instead
    of on ``device`` (docs/scale.md).
    """
    import transformers as tf
    from safetensors import SafetensorError

    path = Path(model_dir)
    if not path.is_dir():
        raise UsageError(f"model directory {str(path)!r} does not exist; pass a folder written by save_pretrained.")
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} holds no config.json: it is not a HF checkpoint directory.")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}.")
    placement = {"dtype": DTYPES[dtype]}
    if device_map is None and max_memory is not None:
        raise UsageError("max_memory (--max-memory) bounds what device_map='auto' places per device; give a "
                         "device_map (--device-map auto) with it.")
    if device_map is not None:
        _check_device_map(device_map)
        placement.update(device_map=device_map, max_memory=max_memory,
                         offload_folder=str(offload_folder or _offload_folder()))
    else:
        check_device(device)
    try:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as error:  # only the file is read here: malformed JSON, an unknown model_type, a wrong field
        raise UsageError(f"the config.json in {str(path)!r} cannot be read: {_first_line(error)}") from None
    _check_weight_files(path)
    try:
        architectures = config.architectures or []
        if any(a.endswith("ForSequenceClassification") for a in architectures):
            auto = tf.AutoModelForSequenceClassification
        elif any(a.endswith("ForConditionalGeneration") for a in architectures):
            # a vision-language checkpoint (Qwen3.5, GLM-5-Next, LFM2-VL, ...): text in, its language model explained
            auto = tf.AutoModelForImageTextToText
        else:
            auto = tf.AutoModelForCausalLM
        # mismatched shapes are reported below, by name, rather than raised with the details only in HF's log
        model, loading = auto.from_pretrained(path, local_files_only=True, output_loading_info=True,
                                              ignore_mismatched_sizes=True, **placement)
    except ValueError as error:  # transformers' "Unrecognized configuration class ..."
        raise UsageError(f"model type {config.model_type!r} cannot be loaded as a causal LM or sequence "
                         f"classifier: {_first_line(error)}") from None
    except OSError as error:  # no weights file
        raise UsageError(f"the weights in {str(path)!r} cannot be loaded: {_first_line(error)}") from None
    except (SafetensorError, pickle.UnpicklingError, EOFError) as error:
        raise _corrupt(_weight_files(path) or [path], _first_line(error).split(". ")[0]) from None
    except RuntimeError as error:
        if "PytorchStreamReader" in str(error):  # torch.load of a cut-off .bin (a zip archive)
            raise _corrupt(_weight_files(path) or [path], _first_line(error).split(". ")[0]) from None
        raise UsageError(f"the model in {str(path)!r} cannot be built from its config.json and weights: "
                         f"{_first_line(error).split('. ')[0]}; re-save it with save_pretrained or download it "
                         "again.") from None
    missing, mismatched = sorted(loading["missing_keys"]), sorted(loading["mismatched_keys"])
    if missing:  # transformers would fill them with random values: explanations of a model nobody trained
        raise UsageError(f"the weights in {str(path)!r} lack {len(missing)} tensor(s) the model needs "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): the checkpoint is "
                         "incomplete or for another architecture; re-save it with save_pretrained.")
    if mismatched:
        name, stored, expected = mismatched[0]
        raise UsageError(f"the weights in {str(path)!r} do not fit its config.json: {name} is stored as "
                         f"{list(stored)} but the config makes it {list(expected)} ({len(mismatched)} tensor(s) "
                         "differ); use the config.json the weights were saved with.")
    check_supported(model)
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"no tokenizer could be loaded from {str(path)!r}: {_first_line(error)}") from None
    _check_vocabulary(tokenizer, path)
    if device_map is not None:  # accelerate placed it
        return model.eval(), tokenizer
    try:
        model = model.to(device)
    except (RuntimeError, AssertionError) as error:
        raise UsageError(f"device {device!r} is not available: {_first_line(error)}") from None
    return model.eval(), tokenizer


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _check_device_map(device_map) -> None:
    if isinstance(device_map, str) and device_map in DEVICE_MAP_STRATEGIES:
        return
    if not isinstance(device_map, dict) or not device_map:
        raise UsageError(f"device_map {device_map!r} is neither one of {', '.join(DEVICE_MAP_STRATEGIES)} nor a "
                         'non-empty mapping of module names to devices (e.g. {"": "cpu"}).')
    for name, place in device_map.items():
        if place == "disk":
            continue
        try:
            torch.device(place)
        except (RuntimeError, TypeError):
            raise UsageError(f"device_map puts {name!r} on {place!r}, which is not a device; use cpu, cuda:N, N or "
                             "disk.") from None


def _inputs_device(model) -> torch.device:
    """Where the token ids go: the input embeddings' device (accelerate moves them for a dispatched model)."""
    try:
        return _input_device(model)
    except ValueError:
        raise UsageError("the model is on the meta device, which holds no weights; move it to cpu or cuda first.") \
            from None


def _offload_folder() -> Path:
    """A temporary folder for disk-offloaded weights, removed when the process exits."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="mamba-captum-offload-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def label_words(model, labels=None) -> list[str] | None:
    """The candidate answers: ``labels`` if given, else a causal LM's ``config.label_words`` (the bundled demo model
    sets it), else a classifier's ``id2label``; None means the whole vocabulary."""
    if isinstance(labels, str):  # labels="positive" would be read letter by letter
        labels = [labels]
    if labels:
        labels = list(labels)
        if not all(isinstance(word, str) for word in labels):
            raise UsageError(f"the labels {labels} must all be strings (label words / tokens).")
        repeated = sorted({word for word in labels if labels.count(word) > 1})
        if repeated:  # a repeated label would be both a candidate and its own rival
            raise UsageError(f"the labels {labels} repeat {', '.join(map(repr, repeated))}; give each label once.")
        if is_classifier(model) and len(labels) != model.config.num_labels:
            raise UsageError(f"{len(labels)} labels given for a classifier with {model.config.num_labels} classes; "
                             "give one name per class, in class order (or none: its id2label is used).")
        return list(labels)
    if is_classifier(model):
        return [model.config.id2label[i] for i in range(model.config.num_labels)]
    return list(getattr(model.config, "label_words", None) or []) or None


def _max_length(model, tokenizer) -> int | None:
    limits = [getattr(tokenizer, "model_max_length", None), getattr(model.config, "max_position_embeddings", None)]
    limits = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    return min(limits) if limits else None


def _candidates(model, tokenizer, words):
    """Index of each candidate in the model's output row (class index, or vocabulary id)."""
    if words is None:
        return None
    if is_classifier(model):
        return list(range(model.config.num_labels))
    if tokenizer is None:
        raise UsageError(f"the label words {words} need the model's tokenizer; pass tokenizer=.")
    ids = [_token_id(tokenizer, word, _vocab_size(model), what="label word") for word in words]
    if len(set(ids)) != len(ids):
        raise UsageError(f"the label words {words} map to repeated token ids {ids}; give distinct tokens.")
    return ids


def _vocab_size(model) -> int:
    """The model's vocabulary size; a vision-language model keeps it in its text config."""
    config = model.config
    return config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size


def _token_id(tokenizer, word: str, vocab_size: int, what: str = "target") -> int:
    """The id of the single vocabulary token ``word`` (its spelling, or the one token it tokenizes to)."""
    token = tokenizer.convert_tokens_to_ids(word)
    if token is None or token == tokenizer.unk_token_id and word != tokenizer.unk_token:
        pieces = tokenizer.encode(word, add_special_tokens=False)
        if len(pieces) != 1:
            raise UsageError(f"{what} {word!r} is not one token of the vocabulary (it tokenizes to {len(pieces)} "
                             "tokens); pass a single token or its id.")
        if pieces[0] == tokenizer.unk_token_id:  # a word-level / SentencePiece vocabulary's stand-in for anything
            raise UsageError(f"{what} {word!r} is not in the tokenizer's vocabulary (it reads as the unknown token "
                             f"{tokenizer.unk_token!r}); pass a token of the vocabulary or its id.")
        token = pieces[0]
    if not 0 <= token < vocab_size:
        raise UsageError(f"{what} id {token} is outside the vocabulary (0..{vocab_size - 1}).")
    return int(token)


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: str.isdigit() also passes "²", which int() refuses


def resolve_target(model, tokenizer, target, words, candidates=None) -> int | None:
    """The output index to explain: None (the prediction), a label word / token string, or an integer id / class
    index (also as a digit string). A string that is exactly a label word is that label, even if it looks like a
    number. With label words, the target must be one of them."""
    if target is None:
        return None
    if isinstance(target, bool) or not isinstance(target, (str, int)):
        raise UsageError(f"target {target!r} must be a label word / token or an integer id, not a "
                         f"{type(target).__name__}.")
    names = words or []
    if candidates is None and words is not None:
        candidates = _candidates(model, tokenizer, words)
    if isinstance(target, str) and target in names:
        return candidates[names.index(target)]
    if isinstance(target, str) and not _INTEGER.fullmatch(target):
        if is_classifier(model):
            raise UsageError(f"target {target!r} is not a label of this model; its labels are {names}.")
        if words is not None:
            raise UsageError(f"target {target!r} is not one of the model's label words {words}.")
        return _token_id(tokenizer, target, _vocab_size(model))
    index = int(target)
    if is_classifier(model):
        if not 0 <= index < model.config.num_labels:
            raise UsageError(f"target class {index} is outside the model's {model.config.num_labels} labels "
                             f"({names}).")
        return index
    if not 0 <= index < _vocab_size(model):
        raise UsageError(f"target id {index} is outside the vocabulary (0..{_vocab_size(model) - 1}).")
    if candidates is not None and index not in candidates:
        raise UsageError(f"target id {index} is not one of the model's label words {words} (ids {candidates}).")
    return index


def encode_text(model, tokenizer, text: str) -> torch.Tensor:
    """``text`` -> (1, L) ids, refusing an empty result or more tokens than the model allows (:class:`UsageError`)."""
    if not isinstance(text, str):
        raise UsageError(f"a text must be a string, not a {type(text).__name__}.")
    if not text.strip():  # it would "explain" the special tokens the tokenizer adds, and nothing else
        raise UsageError(f"the text {text!r} is empty or only whitespace; give a text to explain.")
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
    limit = _max_length(model, tokenizer)
    if limit is not None and input_ids.shape[1] > limit:
        raise UsageError(f"the text has {input_ids.shape[1]} tokens; the model allows at most {limit}: "
                         f"{text[:40]!r}...")
    if input_ids.shape[1] == 0:
        raise UsageError(f"the text {text[:40]!r} is empty after tokenization.")
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):  # no embedding table to read: the config's size
        rows = _vocab_size(model)
    if int(input_ids.max()) >= rows:  # the embedding lookup would fail with an index error deep in the model
        top = int(input_ids.max())
        raise UsageError(f"the text has token id {top} ({tokenizer.convert_ids_to_tokens(top)!r}), outside the "
                         f"model's {rows}-token vocabulary: the tokenizer does not belong to this model.")
    return input_ids


def _name(model, tokenizer, index, words, candidates) -> str:
    if candidates is not None and index in candidates:
        return words[candidates.index(index)]
    if is_classifier(model):
        return str(model.config.id2label.get(index, index))
    return tokenizer.convert_ids_to_tokens(int(index)) if tokenizer is not None else str(int(index))


def lrp_refusal(model) -> str | None:
    """None if MambaLRP has rules for every layer of ``model`` (docs/methods/lrp.md lists them), else why not."""
    try:
        with MambaLRP(model):  # its construction plans the rules; leaving closes what it opened
            pass
    except NotImplementedError as error:
        return str(error).removeprefix("mamba_captum: ")
    return None


def explain(model, tokenizer, texts, *, target=None, methods=None, formulation: str = "unified",
            labels=None, layer_maps: bool = True) -> list[Explanation]:
    """Explain each text (one at a time, so no padding) with ``methods``.

    Args:
        model: a supported HF ``*ForCausalLM`` (explains the next token after the text) or
            ``*ForSequenceClassification`` model, in eval mode.
        tokenizer: its tokenizer.
        texts: a string or a list of strings.
        target: None (explain each prediction), a label word / token string, or an id / class index.
        methods: names among ``"raw"``, ``"rollout"``, ``"attribution"``, ``"selection"``
            (MambaSelectionAttribution), ``"lrp"`` (MambaLRP); default every one, less ``"lrp"`` for a model
            without MambaLRP rules (asked for by name, that raises).
        formulation: ``"unified"`` or ``"hidden"`` (MambaLRP has none: it differentiates the model itself).
        labels: candidate answers of a causal LM (e.g. ``["negative", "positive"]``); see :func:`label_words`.
        layer_maps: also return each layer's (L, L) channel-mean map.
    Returns:
        one :class:`Explanation` per text.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    device = _inputs_device(model)
    inputs = [encode_text(model, tokenizer, text).to(device) for text in texts]
    return explain_ids(model, tokenizer, inputs, texts=texts, target=target, methods=methods,
                       formulation=formulation, labels=labels, layer_maps=layer_maps)


def explain_ids(model, tokenizer, inputs, *, texts=None, target=None, methods=None,
                formulation: str = "unified", labels=None, layer_maps: bool = True) -> list[Explanation]:
    """As :func:`explain`, for token ids: ``inputs`` is a list of (1, L) or (L,) id tensors (no padding), or a
    (B, L) batch with its (B, L) ``attention_mask`` given as ``inputs=(ids, mask)`` (each row is cut to its real
    tokens). ``tokenizer`` may be None (tokens are then shown as ids)."""
    if isinstance(inputs, tuple):
        ids, mask = inputs
        inputs = [row[mask_row.bool()][None] for row, mask_row in zip(ids, mask)]
    inputs = [ids if ids.dim() == 2 else ids[None] for ids in inputs]
    if any(ids.shape[1] == 0 for ids in inputs):
        raise UsageError("an input has no tokens (an empty id tensor or an all-zero attention_mask row).")
    chosen = methods is not None
    methods = list(METHODS) if methods is None else [methods] if isinstance(methods, str) else list(
        dict.fromkeys(methods))  # each method once
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise UsageError(f"unknown method {unknown[0]!r}; choose among {', '.join(METHODS)}.")
    if formulation not in ("unified", "hidden"):
        raise UsageError(f"unknown formulation {formulation!r}; choose unified or hidden.")
    check_supported(model)
    refusal = lrp_refusal(model) if "lrp" in methods else None
    if refusal is not None and not chosen:
        methods.remove("lrp")  # the default: every method the model supports
    elif refusal is not None:
        raise UsageError(f"{refusal} Leave out the method lrp.")
    device = _inputs_device(model)
    words = label_words(model, labels)
    candidates = _candidates(model, tokenizer, words)
    wanted = resolve_target(model, tokenizer, target, words, candidates)
    results = []
    for number, input_ids in enumerate(inputs):
        input_ids = input_ids.to(device)
        attention_mask = torch.ones_like(input_ids)
        with torch.no_grad(), session(model, decoder_layers(model)):  # as the library's own forwards: RWKV's
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # rescaling undone after it
        scores = (logits[0] if is_classifier(model) else logits[0, -1]).float()
        if candidates is not None:
            probabilities = torch.zeros_like(scores)
            probabilities[candidates] = scores[candidates].softmax(-1)
        else:
            probabilities = scores.softmax(-1)
        predicted = int(probabilities.argmax())
        explained = predicted if wanted is None else wanted
        relevance = {}
        for name in methods:
            options = {"target": explained} if name in CLASS_SPECIFIC else {}
            if name != "lrp":
                options["formulation"] = formulation
            row = METHODS[name](model).attribute(input_ids, attention_mask=attention_mask, **options)
            relevance[name] = [float(v) for v in row[0].float().cpu()]
        maps = None
        if layer_maps:
            maps = {layer: value[0].float().cpu() for layer, value in implicit_attention(
                model, input_ids, attention_mask, formulation=formulation, reduce="mean").items()}
        ids = input_ids[0].tolist()
        tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]
        text = texts[number] if texts is not None else (
            tokenizer.decode(ids) if tokenizer is not None else " ".join(tokens))
        results.append(Explanation(
            text=text, tokens=tokens, prediction=_name(model, tokenizer, predicted, words, candidates),
            probability=float(probabilities[predicted]),
            target=_name(model, tokenizer, explained, words, candidates),
            target_probability=float(probabilities[explained]), relevance=relevance, layer_maps=maps,
            display_tokens=readable_tokens(tokenizer, tokens) if tokenizer is not None else None,
            settings={"model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
                      "model_class": type(model).__name__, "formulation": formulation,
                      "labels": words}))
    return results
