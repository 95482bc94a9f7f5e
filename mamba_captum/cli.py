"""The ``mamba-captum`` command.

  mamba-captum demo       explain the bundled demo model's test sentences; prints top tokens, writes an HTML report
  mamba-captum explain    explain texts (or a JSONL dataset) with any local HF checkpoint directory
  mamba-captum matrices   save each layer's implicit-attention map of a text as PNG
  mamba-captum evaluate   the faithfulness comparison on the shipped tiny classifiers (docs/faithfulness.md)

Problems with what was asked (a missing directory, a damaged checkpoint, an unsupported model, an unusable device,
an empty or too-long text, an unknown target; docs/cli.md lists them) are one line on stderr and exit code 2, with no
traceback; Ctrl-C is one line and exit code 130.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .attention import ReconstructionError
from .checks import NonFiniteError
from .explain import DTYPES, METHODS, UsageError

# The largest side of a `matrices` PNG: 4096² RGB pixels are 48 MiB in memory and seconds to encode; a bigger map
# shows no more (one entry per token) and would need gigabytes (a 5-token text at --scale 100000 asks for 750 GB).
MAX_MAP_PIXELS = 4096

COMMANDS = {"demo": "explain the bundled demo model's test sentences and write an HTML report",
            "explain": "explain texts or a JSONL dataset with a local HF checkpoint directory",
            "matrices": "save each layer's implicit-attention map of a text as a PNG",
            "evaluate": "the faithfulness comparison on the shipped tiny classifiers (docs/faithfulness.md)"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2 (argparse prints usage first)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _common(parser, model_required=True):
    if model_required:
        parser.add_argument("--model", required=True, help="a local HF checkpoint directory (save_pretrained); "
                            "with --image, a Vision Mamba checkpoint file (.pth)")
    parser.add_argument("--formulation", choices=("unified", "hidden"), default="unified")
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default cpu; under "
                        "accelerate launch with cuda, each process its own GPU)")
    parser.add_argument("--device-map", default=None, metavar="MAP",
                        help="load the model dispatched by accelerate: auto, balanced, sequential, or a JSON object "
                        'module name -> device / "cpu" / "disk" (docs/scale.md)')
    parser.add_argument("--max-memory", default=None, metavar="SIZES",
                        help="with --device-map auto: the most each device holds, e.g. 0=20GiB,cpu=60GiB (the rest "
                        "is offloaded to disk)")
    parser.add_argument("--offload-folder", type=Path, default=None,
                        help="where disk-offloaded weights go (default: a temporary folder, removed at exit)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="weights' dtype (default float32)")


def _method_args(parser):
    parser.add_argument("--method", action="append", choices=list(METHODS),
                        help="raw, rollout, attribution, selection or lrp; repeat for several (default: every one the "
                        "model supports; raw, rollout and attribution for an image)")
    parser.add_argument("--target", default=None,
                        help="what to explain: a label word / token, or an id (default: the prediction)")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="a causal LM's candidate answer tokens (default: config.label_words if set); with "
                        "--image, the class names in class order")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mamba-captum", description="Implicit-attention explanations of Mamba-family models.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, text in COMMANDS.items():
        sub = commands.add_parser(name, help=text, description=text, add_help=name != "evaluate")
        if name == "demo":
            sub.add_argument("--out", type=Path, default=Path("mamba-captum-demo.html"), help="the HTML report")
            _common(sub, model_required=False)
        elif name == "explain":
            _common(sub)
            _method_args(sub)
            source = sub.add_mutually_exclusive_group(required=True)
            source.add_argument("--text", action="append", help="a text to explain (repeatable)")
            source.add_argument("--dataset", type=Path, help='a JSONL file, one {"text": ..., "target": ...} a line')
            source.add_argument("--image", action="append", type=Path,
                                help="an image file (PNG, JPEG, ...) to explain with a Vim checkpoint (repeatable)")
            sub.add_argument("--img-size", type=int, default=None,
                             help="with --image: the Vim's training image size, if not 224")
            sub.add_argument("--out", type=Path, default=None, help="write an HTML report here")
            sub.add_argument("--jsonl", type=Path, default=None,
                             help="the results as JSONL (default with --dataset: DATASET.explained.jsonl); with "
                             "--dataset, a rerun skips the lines already there")
            sub.add_argument("--restart", action="store_true",
                             help="with --dataset: recompute every line, discarding the results of an earlier run")
        elif name == "matrices":
            _common(sub)
            sub.add_argument("--text", required=True)
            sub.add_argument("--out-dir", type=Path, default=Path("matrices"))
            sub.add_argument("--scale", type=int, default=8,
                             help=f"pixels per map entry (default 8; a map is at most {MAX_MAP_PIXELS} pixels a side)")
    return parser


def _print_summary(explanations, file=sys.stdout, deciding=None, k=3):
    """Each text's prediction and each method's top-k tokens; with ``deciding`` (one word mask per text, the demo
    grammar's deciding words) also those words and, at the end, how many of them each method's top k hold."""
    found, total = {}, 0
    for number, item in enumerate(explanations):
        print(f"{item.text!r}: {item.prediction} (p = {item.probability:.3f}); explained: {item.target}", file=file)
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


def _writable_file(path: Path) -> Path:
    """Check an output file can be written before any model work (the parent is created; a file this check creates
    is removed again, so a run refused later leaves no empty output behind)."""
    try:
        if path.is_dir():
            raise UsageError(f"{str(path)!r} is a directory; give a file name.")
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with path.open("a", encoding="utf-8"):
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        raise UsageError(f"cannot write {str(path)!r}: {error.strerror or error}.") from None
    return path


def _writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".mamba-captum-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"cannot write into {str(path)!r}: {error.strerror or error}.") from None
    return path


def _write_report(explanations, out: Path, title: str):
    from .html_report import render_html

    out.write_text(render_html(explanations, title=title), encoding="utf-8")
    print(f"report: {out}")


def _read_dataset(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) for each non-empty line; every row checked before any model work."""
    if path.is_dir():
        raise UsageError(f"dataset {str(path)!r} is a directory; give a JSONL file.")
    if not path.exists():  # a pipe (--dataset <(...)) exists without being a regular file, and reads as one
        raise UsageError(f"dataset {str(path)!r} does not exist.")
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the first line's JSON
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as error:
        raise UsageError(f"dataset {str(path)!r} is not UTF-8 text ({error.reason} at byte {error.start}).") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}:{number} is not JSON ({error.msg}).") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UsageError(f'{path}:{number} has no "text" string; each line must be {{"text": ..., '
                             '"target": ... (optional)}.')
        rows.append((number, row))
    if not rows:
        raise UsageError(f"dataset {str(path)!r} holds no lines.")
    return rows


def _distinct_files(named: dict) -> None:
    """Refuse two options naming one file: an output would overwrite the dataset being read, or the other output."""
    seen = {}
    for option, path in named.items():
        if path is None:
            continue
        key = path.resolve()
        if key in seen:
            raise UsageError(f"{seen[key]} and {option} both name {str(path)!r}; give them different files.")
        seen[key] = option


def _device_map(text: str | None):
    """--device-map: a strategy name, or a JSON object module name -> device."""
    if text is None or not text.lstrip().startswith("{"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"--device-map {text!r} is not a JSON object ({error.msg}); e.g. "
                         '\'{"model.embeddings": "cpu", "model.layers": "disk"}\'.') from None


def _max_memory(text: str | None):
    """--max-memory 0=20GiB,cpu=60GiB -> {0: "20GiB", "cpu": "60GiB"}."""
    if text is None:
        return None
    sizes = {}
    for item in text.split(","):
        device, equals, size = item.strip().partition("=")
        if not equals or not device or not size:
            raise UsageError(f"--max-memory {text!r}: give device=size pairs, e.g. 0=20GiB,cpu=60GiB.")
        sizes[int(device) if device.isdigit() else device] = size
    return sizes


def _load(args, model_dir):
    """The checkpoint on --device, or dispatched by accelerate with --device-map."""
    from .explain import load

    if args.device_map is not None and args.device is not None:
        raise UsageError("give --device or --device-map, not both (--device-map places every layer itself).")
    device = "cpu" if args.device is None else args.device
    return load(model_dir, device=device, dtype=args.dtype, device_map=_device_map(args.device_map),
                max_memory=_max_memory(args.max_memory), offload_folder=args.offload_folder)


def _demo(args):
    from .demo import DEMO_TEXTS, grammar, model_dir
    from .explain import explain

    _writable_file(args.out)
    model, tokenizer = _load(args, model_dir())
    explanations = explain(model, tokenizer, DEMO_TEXTS, formulation=args.formulation)
    for item in explanations:
        item.settings["model"] = "bundled demo model (mamba_captum/demo/model)"
    _print_summary(explanations, deciding=[grammar.deciding_words(text) for text in DEMO_TEXTS])
    _write_report(explanations, args.out, "mamba-captum demo: a tiny Mamba sentiment model")


def _explain_images(args):
    from .html_report import render_image_html
    from .vision_explain import explain_images, load_vim_file

    for path in (args.jsonl, args.out):
        if path is not None:
            _writable_file(path)
    for image in args.image:  # every file, before the model is loaded
        if not image.is_file():
            raise UsageError(f"no image file at {str(image)!r}.")
    if args.device_map is not None:
        raise UsageError("--device-map loads HF checkpoints; a Vision Mamba file is loaded on --device.")
    device = "cpu" if args.device is None else args.device
    model = load_vim_file(args.model, device=device, dtype=args.dtype, img_size=args.img_size)
    if args.labels:  # class names, in class order
        if len(args.labels) != model.num_classes:
            raise UsageError(f"--labels gives {len(args.labels)} names for a model of {model.num_classes} classes.")
        model.class_names = list(args.labels)
    explanations = explain_images(model, [str(p) for p in args.image], target=args.target,
                                  methods=args.method or ("raw", "rollout", "attribution"),
                                  formulation=args.formulation)
    for item in explanations:
        item.settings["model"] = f"{Path(args.model).name} ({item.settings['model']})"
        peaks = {name: _peak_patch(scores) for name, scores in item.relevance.items()}
        print(f"{item.path}: class {item.prediction} (p = {item.probability:.3f}); explained: {item.target}; "
              "most relevant pixel (row, column): " + ", ".join(f"{k} {v}" for k, v in peaks.items()))
    if args.jsonl is not None:
        args.jsonl.write_text("".join(json.dumps(item.to_dict()) + "\n" for item in explanations), encoding="utf-8")
        print(f"results: {args.jsonl} ({len(explanations)} lines)")
    if args.out is not None:
        args.out.write_text(render_image_html(explanations, title=f"mamba-captum: {Path(args.model).name}"),
                            encoding="utf-8")
        print(f"report: {args.out}")


def _peak_patch(scores) -> tuple[int, int]:
    flat = int(scores.abs().argmax())
    return divmod(flat, scores.shape[-1])


def _explain(args):
    from .explain import encode_text, explain, label_words, resolve_target

    if args.image:
        return _explain_images(args)

    # read before anything is written: --jsonl naming the dataset would otherwise empty it
    rows = _read_dataset(args.dataset) if args.dataset else None
    jsonl = args.jsonl or (args.dataset.with_suffix(".explained.jsonl") if args.dataset else None)
    _distinct_files({"--dataset": args.dataset, "--jsonl": jsonl, "--out": args.out})
    for path in (jsonl, args.out):
        if path is not None:
            _writable_file(path)
    group = None
    if rows is not None:  # a dataset: shared by the processes of accelerate launch / torchrun, if any
        from .parallel import processes

        group = processes(cpu=_runs_on_cpu(args))
        if group.count > 1 and args.device == "cuda":
            args.device = f"cuda:{group.state.local_process_index}"  # each process its own GPU
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--text runs in one process; give the texts as --dataset to share them among processes.")
    model, tokenizer = _load(args, args.model)
    methods = args.method  # None: every method the model supports
    options = dict(methods=methods, formulation=args.formulation, labels=args.labels,
                   layer_maps=args.out is not None)
    if args.text:
        explanations = explain(model, tokenizer, args.text, target=args.target, **options)
        _print_summary(explanations)
        if jsonl is not None:
            jsonl.write_text("".join(json.dumps(item.to_dict()) + "\n" for item in explanations), encoding="utf-8")
            print(f"results: {jsonl} ({len(explanations)} lines)")
    else:
        from .explain import Explanation
        from .parallel import ResumeError, run_jobs

        # a row's "target": null means --target
        jobs = [dict(line=number, text=row["text"],
                     target=row["target"] if row.get("target") is not None else args.target,
                     methods=methods, formulation=args.formulation, labels=args.labels) for number, row in rows]
        words = label_words(model, args.labels)
        for job in jobs:  # every row's target and length, before hours of work
            try:
                resolve_target(model, tokenizer, job["target"], words)
                encode_text(model, tokenizer, job["text"])
            except UsageError as error:
                raise UsageError(f"{args.dataset}:{job['line']}: {error}") from None

        def work(job):
            (item,) = explain(model, tokenizer, job["text"], target=job["target"], methods=methods,
                              formulation=args.formulation, labels=args.labels, layer_maps=False)
            return item.to_dict()

        try:
            records = run_jobs(jobs, work, jsonl, group=group, restart=args.restart, progress="explaining")
        except ResumeError as error:
            raise UsageError(str(error)) from None
        if records is None:  # not the main process: the main one writes the report
            return
        print(f"results: {jsonl} ({len(records)} lines)")
        if args.out is not None:
            _write_report([Explanation.from_dict(record) for record in records], args.out,
                          f"mamba-captum: {Path(args.model).name}")
        return
    if args.out is not None:
        _write_report(explanations, args.out, f"mamba-captum: {Path(args.model).name}")


def _runs_on_cpu(args) -> bool:
    """Whether this run computes on CPU (torch.distributed's gloo backend between processes) or on GPUs."""
    import torch

    if args.device_map is not None:
        return not torch.cuda.is_available()
    return str(args.device or "cpu").startswith("cpu")


def _matrices(args):
    from .explain import encode_text, explain
    from .html_report import map_png

    if args.scale < 1:
        raise UsageError(f"--scale must be at least 1, not {args.scale}.")
    if args.scale > MAX_MAP_PIXELS:  # even a one-token text would exceed the largest map
        raise UsageError(f"--scale {args.scale} is too large: a map is at most {MAX_MAP_PIXELS} pixels a side "
                         "(tokens × scale); use a smaller --scale.")
    _writable_dir(args.out_dir)
    model, tokenizer = _load(args, args.model)
    length = encode_text(model, tokenizer, args.text).shape[1]
    if length * args.scale > MAX_MAP_PIXELS:
        fitting = MAX_MAP_PIXELS // length
        advice = (f"use --scale {fitting} or less" if fitting else
                  f"the text is too long for a map even at --scale 1; give at most {MAX_MAP_PIXELS} tokens")
        raise UsageError(f"{length} tokens at --scale {args.scale} make maps {length * args.scale} pixels a side; "
                         f"the most is {MAX_MAP_PIXELS}: {advice}.")
    (item,) = explain(model, tokenizer, args.text, methods=(), formulation=args.formulation)
    for layer, matrix in item.layer_maps.items():
        # Zamba2's shared attention block has the key "{i}.shared_attention", Inkling's MLP branch "{i}.mlp_sconv"
        name = f"layer_{layer:02d}" if isinstance(layer, int) else f"layer_{str(layer).replace('.', '_')}"
        (args.out_dir / f"{name}.png").write_bytes(map_png(matrix, args.scale))
    (args.out_dir / "tokens.json").write_text(json.dumps(item.tokens) + "\n")
    print(f"{len(item.layer_maps)} layer maps ({len(item.tokens)} tokens, {args.formulation}) in {args.out_dir}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "evaluate":  # its own parser (mamba_captum.evaluation.report)
        from .evaluation.report import main as evaluate

        try:
            evaluate(argv[1:])
        except SystemExit as leaving:  # its argparse errors and refusals: a code, as for the other commands
            return int(leaving.code or 0)
        return 0
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as leaving:  # --help (0) and argparse's errors (2): a code, as for the other paths
        return int(leaving.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    import transformers

    # main() may be called from a user's program: transformers' logging settings are put back on the way out
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # HF's per-kernel "falling back to torch" lines on CPU
    transformers.logging.disable_progress_bar()  # "Loading weights" bars: errors stay one line
    try:
        return _run(args)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()


def _run(args) -> int:
    try:
        {"demo": _demo, "explain": _explain, "matrices": _matrices}[args.command](args)
    except UsageError as error:
        print(f"mamba-captum {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (NonFiniteError, ReconstructionError) as error:  # the checkpoint's numbers, or a variant not supported
        print(f"mamba-captum {args.command}: error: {str(error).removeprefix('mamba_captum: ')}", file=sys.stderr)
        return 2
    except OSError as error:  # a file that vanished or filled the disk mid-run: still one line
        print(f"mamba-captum {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the JSONL keeps the rows written so far
        print(f"mamba-captum {args.command}: interrupted.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
