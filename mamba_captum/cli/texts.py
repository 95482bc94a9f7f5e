"""The text commands: ``mamba-captum demo``, ``explain`` (texts or a JSONL dataset; ``--image`` hands over to
images.py) and ``matrices``.

Each command first checks what it was asked that needs no model (paths and outputs, the dataset, the options
together, --device last: :func:`~mamba_captum.cli.loading.check_loading`) and only then imports the library (torch,
transformers, captum: seconds), so that a usage error answers at once."""
from __future__ import annotations

import json
import os
import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from ..files import write_atomically
from ..tokens import UnknownTokenWarning
from ..usage import UsageError
from .arguments import MAX_MAP_PIXELS
from .files import check_paths, read_dataset, writable_dir, writable_file, write_report
from .images import explain_images_command
from .loading import check_labels, check_loading, load_model
from .notices import quiet_library, scoped_warnings


DEMO_STORY = ("The bundled demo model: a 2-layer Mamba trained on a sentiment grammar (mamba_captum.demo.grammar) "
              "with negation and contrast. The grammar decides every sentence and the model learnt it (100 % held "
              "out), so its probabilities saturate: p says which label, not how sure a person would be.")
DEMO_PREAMBLE = """\
The bundled demo model: a 2-layer Mamba trained on a sentiment grammar (mamba_captum.demo.grammar). Its tokenizer
appends the query token [SENTIMENT]; the next-token logits there at "negative" / "positive" are the answer, and p
is their softmax over those two words. The grammar decides every sentence and the model learnt it (100 % held out),
so p saturates (p > 0.999): it says which label, not how sure a person would be. Each method's top tokens follow,
the default first, on three scales: attribution (MambaAttribution's default) is the magnitude of lrp's relevance
and lrp is in logit units (its scores sum to the explained logit less the biases, so the query token [SENTIMENT]
carries a share); raw is the query's row of the implicit attention (the model's own weights, signed); rollout and
selection are shares (each text's scores sum to 1).
"""


@contextmanager
def _warnings_once_checked():
    """Hold the warnings (unknown words) raised while the inputs are checked; pass them on only once every check
    passed, so that a refused run stays one error line."""
    with scoped_warnings(record=True) as (held, _):
        yield
    for warning in held:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _print_summary(explanations, file=None, deciding=None, k=3):
    """Each text's prediction and each method's top-k tokens (to ``file``, default the current ``sys.stdout``); with
    ``deciding`` (one word mask per text, the demo grammar's deciding words) also those words and, at the end, how
    many of them each method's top k hold."""
    from ..html_report import probability_text

    file = sys.stdout if file is None else file  # read at the call: stdout may have been replaced since the import
    found, total = {}, 0
    for number, item in enumerate(explanations):
        explained = item.target if item.target == item.prediction else \
            f"{item.target} ({probability_text(item.target_probability)})"
        print(f"{item.text!r}: {item.prediction} ({probability_text(item.probability)}); explained: {explained}",
              file=file)
        words = None
        if deciding is not None:
            words = {i for i, is_deciding in enumerate(deciding[number]) if is_deciding}
            total += len(words)
            print(f"  {'deciding':>11}: {', '.join(item.shown()[i] for i in sorted(words))} (by the grammar)",
                  file=file)
        for name in item.relevance:
            tops = ", ".join(f"{token} {score:+.3f}" for token, score in item.top_tokens(name, k))
            print(f"  {name:>11}: {tops}", file=file)
            if words is not None:
                found[name] = found.get(name, 0) + len(words & set(item.top_indices(name, k)))
    if found:
        print(f"deciding words among each method's top {k} ({total} in all): "
              + ", ".join(f"{name} {count}" for name, count in found.items()), file=file)


def demo_command(args):
    from ..demo import DEMO_TEXTS, grammar, model_dir

    check_paths([("--out", args.out)], [("the demo model", model_dir())],
                [("--offload-folder", args.offload_folder, ())])
    writable_file(args.out)
    check_loading(args, model_dir())
    quiet_library()
    from ..explain import explain

    model, tokenizer = load_model(args, model_dir())
    explanations = explain(model, tokenizer, DEMO_TEXTS, formulation=args.formulation)
    for item in explanations:
        item.settings["model"] = "bundled demo model (mamba_captum/demo/model)"
    print(DEMO_PREAMBLE)
    _print_summary(explanations, deciding=[grammar.deciding_words(text) for text in DEMO_TEXTS])
    # the model's story; the report's own paragraphs say what p and each method's numbers are
    write_report(explanations, args.out, "mamba-captum demo: a tiny Mamba sentiment model", notes=DEMO_STORY)


def explain_command(args):
    if args.restart and args.dataset is None:  # argparse cannot tie it to --dataset: said, not ignored
        raise UsageError("--restart recomputes a --dataset run's results; --text and --image runs keep none: leave it "
                         "out.")
    if args.image:
        return explain_images_command(args)
    if getattr(args, "weights", None) is not None:  # the same: an image model's weights file
        raise UsageError("--weights applies to --image (an image model's architecture name as --model); an HF "
                         "checkpoint directory holds its own weights: leave it out.")
    if args.img_size is not None:  # argparse cannot tie it to --image: said, not ignored
        raise UsageError("--img-size applies to --image (a Vision Mamba checkpoint); an HF checkpoint's texts need "
                         "none: leave it out.")
    # read before anything is written: --jsonl naming the dataset would otherwise empty it
    rows = read_dataset(args.dataset) if args.dataset else None
    jsonl = args.jsonl or (args.dataset.with_suffix(".explained.jsonl") if args.dataset else None)
    # no output may replace the dataset, a file of the checkpoint folder or the other output; with --dataset, nor
    # may the files the resumable run keeps beside --jsonl (its part files, claims and staged copy)
    working = []
    if rows is not None:
        from ..parallel import side_files

        working = [("--jsonl's working file", path) for path in side_files(jsonl)]
    check_paths([("--jsonl", jsonl), ("--out", args.out), *working],
                [("--model", args.model), ("--dataset", args.dataset)],
                [("--offload-folder", args.offload_folder, ())])
    for path in (jsonl, args.out):
        if path is not None:
            writable_file(path)
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under accelerate launch / torchrun
    if rows is None and several:
        raise UsageError("--text runs in one process; give the texts as --dataset to share them among processes.")
    check_labels(args.labels)
    # a dataset shared by processes: each takes its own GPU below, its device checked when loaded (a check of
    # --device cuda here would open a CUDA context on GPU 0 in every process)
    check_loading(args, args.model, device=not several)
    quiet_library()
    from ..explain import encode_text, explain, label_words, resolve_target
    from ..explain.text import candidate_ids

    group = None
    if rows is not None:  # a dataset: shared by the processes of accelerate launch / torchrun, if any
        from ..parallel import processes

        group = processes(cpu=_runs_on_cpu(args))
        if group.count > 1 and args.device == "cuda":
            args.device = f"cuda:{group.state.local_process_index}"  # each process its own GPU
    model, tokenizer = load_model(args, args.model)
    methods = args.method  # None: every method the model supports
    options = dict(methods=methods, formulation=args.formulation, labels=args.labels,
                   layer_maps=args.out is not None)
    if args.text:
        with _warnings_once_checked():  # the labels and target, then each text (explain() checks them in turn)
            words = label_words(model, args.labels)
            resolve_target(model, tokenizer, args.target, words, candidate_ids(model, tokenizer, words))
            for text in args.text:
                encode_text(model, tokenizer, text)
        explanations = explain(model, tokenizer, args.text, target=args.target, **options)
        _print_summary(explanations)
        if jsonl is not None:
            write_atomically(jsonl, "".join(json.dumps(item.to_dict()) + "\n" for item in explanations))
            print(f"results: {jsonl} ({len(explanations)} lines)")
    else:
        from ..explain import Explanation
        from ..parallel import ResumeError, run_jobs

        # a row's "target": null means --target
        jobs = [dict(line=number, text=row["text"],
                     target=row["target"] if row.get("target") is not None else args.target,
                     methods=methods, formulation=args.formulation, labels=args.labels) for number, row in rows]
        words = label_words(model, args.labels)
        candidates = candidate_ids(model, tokenizer, words)  # the labels, whatever the rows' targets

        def work(job):
            (item,) = explain(model, tokenizer, job["text"], target=job["target"], methods=methods,
                              formulation=args.formulation, labels=args.labels, layer_maps=False)
            return item.to_dict()

        with scoped_warnings() as (_, own):
            if not group.main:  # each process checks every row: the main one alone names the unknown words
                warnings.simplefilter("ignore", UnknownTokenWarning)
                own.append(warnings.filters[0])
            with _warnings_once_checked():
                for job in jobs:  # every row's target and length (and unknown words), before hours of work
                    try:
                        resolve_target(model, tokenizer, job["target"], words, candidates)
                        encode_text(model, tokenizer, job["text"])
                    except UsageError as error:
                        raise UsageError(f"{args.dataset}:{job['line']}: {error}") from None
            try:
                records = run_jobs(jobs, work, jsonl, group=group, restart=args.restart, progress="explaining",
                                   check=explanation_problem)
            except ResumeError as error:
                raise UsageError(str(error)) from None
        if records is None:  # not the main process: the main one writes the report
            return
        print(f"results: {jsonl} ({len(records)} lines)")
        if args.out is not None:
            write_report([Explanation.from_dict(record) for record in records], args.out,
                         f"mamba-captum: {Path(args.model).name}")
        return
    if args.out is not None:
        write_report(explanations, args.out, f"mamba-captum: {Path(args.model).name}")


def explanation_problem(record: dict) -> str | None:
    """What is wrong with an explained line read back from an earlier run (its job already checked), or None: it
    must hold what :meth:`mamba_captum.explain.Explanation.from_dict` reads, for the job's text."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    for key, kind, fits in (("text", "a string", lambda v: isinstance(v, str)),
                            ("tokens", "a list of strings", lambda v: isinstance(v, list)
                             and all(isinstance(t, str) for t in v)),
                            ("prediction", "a string", lambda v: isinstance(v, str)),
                            ("probability", "a number", number),
                            ("target", "a string", lambda v: isinstance(v, str)),
                            ("target_probability", "a number", number),
                            ("relevance", "an object of lists of numbers", lambda v: isinstance(v, dict) and all(
                                isinstance(s, list) and all(number(x) for x in s) for s in v.values()))):
        if key not in record:
            return f"has no {key!r}"
        if not fits(record[key]):
            return f"has a {key!r} that is not {kind}"
    if record["text"] != record["job"].get("text"):
        return "explains another text than its job's"
    lengths = {name: len(scores) for name, scores in record["relevance"].items()
               if len(scores) != len(record["tokens"])}
    if lengths:
        name = next(iter(lengths))
        return f"has {lengths[name]} {name} scores for {len(record['tokens'])} tokens"
    return None


def _runs_on_cpu(args) -> bool:
    """Whether this run computes on CPU (torch.distributed's gloo backend between processes) or on GPUs."""
    import torch

    if args.device_map is not None:
        return not torch.cuda.is_available()
    return str(args.device or "cpu").startswith("cpu")


def existing_maps(out_dir: Path) -> list[tuple[str, Path]]:
    """("--out-dir", path) of each entry of ``out_dir`` a ``matrices`` run may replace (``layer_*.png``, any case),
    links included; none when the folder is not there yet."""
    try:
        names = [entry.name for entry in os.scandir(out_dir)]
    except OSError:  # not there yet (or not a folder: writable_dir says so)
        return []
    return [("--out-dir", out_dir / name) for name in sorted(names) if re.fullmatch(r"layer_.*\.png", name, re.I)]


def matrices_command(args):
    if args.scale > MAX_MAP_PIXELS:  # even a one-token text would exceed the largest map
        raise UsageError(f"--scale {args.scale} is too large: a map is at most {MAX_MAP_PIXELS} pixels a side "
                         "(tokens × scale); use a smaller --scale.")
    # the layer_NN.png names are known once the model is loaded; the ones there now (a link to a checkpoint file
    # included) are checked before then, and the new names replace nothing
    check_paths(existing_maps(args.out_dir), [("--model", args.model)],
                [("--out-dir", args.out_dir, ("tokens.json",)), ("--offload-folder", args.offload_folder, ())])
    writable_dir(args.out_dir)
    check_loading(args, args.model)
    quiet_library()
    from ..explain import encode_text, explain
    from ..html_report import map_png

    model, tokenizer = load_model(args, args.model)
    with _warnings_once_checked():
        length = encode_text(model, tokenizer, args.text).shape[1]
        if length * args.scale > MAX_MAP_PIXELS:
            fitting = MAX_MAP_PIXELS // length
            advice = (f"use --scale {fitting} or less" if fitting else
                      f"the text is too long for a map even at --scale 1; give at most {MAX_MAP_PIXELS} tokens")
            raise UsageError(f"{length} tokens at --scale {args.scale} make maps {length * args.scale} pixels a "
                             f"side; the most is {MAX_MAP_PIXELS}: {advice}.")
    (item,) = explain(model, tokenizer, args.text, methods=(), formulation=args.formulation)
    for layer, matrix in item.layer_maps.items():
        # Zamba2's shared attention block has the key "{i}.shared_attention", Inkling's MLP branch "{i}.mlp_sconv"
        name = f"layer_{layer:02d}" if isinstance(layer, int) else f"layer_{str(layer).replace('.', '_')}"
        write_atomically(args.out_dir / f"{name}.png", map_png(matrix, args.scale))
    write_atomically(args.out_dir / "tokens.json", json.dumps(item.tokens) + "\n")
    print(f"{len(item.layer_maps)} layer maps ({len(item.tokens)} tokens, {args.formulation}) in {args.out_dir}")
