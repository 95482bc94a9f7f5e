"""The ``mamba-captum`` command.

  mamba-captum demo       explain the bundled demo model's test sentences; prints top tokens, writes an HTML report
  mamba-captum explain    explain texts (or a JSONL dataset) with any local HF checkpoint directory
  mamba-captum matrices   save each layer's implicit-attention map of a text as PNG
  mamba-captum evaluate   the faithfulness comparison on the shipped tiny classifiers (docs/faithfulness.md)

Problems with what was asked (a missing directory, a damaged checkpoint, an unsupported model, an unusable device,
an empty or too-long text, an unknown target; docs/cli.md lists them) are one line on stderr and exit code 2, with no
traceback; Ctrl-C is one line and exit code 130. Words of a text that the tokenizer does not know (they became its
unknown token) are one ``warning:`` line on stderr per text, and the run goes on.

``main`` is here; the parser is in ``arguments``, the commands in ``texts`` and ``images``, the files they read and
write in ``files``, the loading of the checkpoint in ``loading``.
"""
from __future__ import annotations

import sys
import warnings

from .arguments import COMMANDS, MAX_MAP_PIXELS, build_parser
from .notices import library_logging, scoped_warnings

# Parsing the arguments imports only argparse and light modules: the library (torch, transformers) is imported by
# the command that runs. Each command stays a name of this module (_demo, _explain, _matrices), imported on first
# use by __getattr__; _run looks it up at each call (tests replace one).
_COMMAND_FUNCTIONS = {"_demo": "demo_command", "_explain": "explain_command", "_matrices": "matrices_command"}


def __getattr__(name):
    if name in _COMMAND_FUNCTIONS:
        from . import texts

        return getattr(texts, _COMMAND_FUNCTIONS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "evaluate":  # its own parser, shared with python -m mamba_captum.evaluation
        from ..usage import evaluate_parser

        try:  # --help and a bad argument answered before the suite (torch) is imported
            evaluate_parser().parse_args(argv[1:])
            from ..evaluation.report import main as evaluate

            evaluate(argv[1:])
        except SystemExit as leaving:  # its argparse errors and refusals: a code, as for the other commands
            return int(leaving.code or 0)
        return 0
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as leaving:  # --help, --version (0) and argparse's errors (2): a code, as for the other paths
        return int(leaving.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    # transformers' logging is quieted when the command starts on the library (a usage error imports none of it)
    # and put back on the way out; the warning filters and showwarning are put back, too (those of modules
    # imported meanwhile kept)
    with library_logging(), scoped_warnings() as (_, own):
        _warn_in_one_line(args.command, own)
        return _run(args)


def _warn_in_one_line(command: str, own: list) -> None:
    """Inside :func:`~mamba_captum.cli.notices.scoped_warnings` (``own``: its list of the block's filters): each UnknownTokenWarning becomes one line on stderr, ``mamba-captum
    <command>: warning: ...``, once per message (its text is named in it: once per text, though a text is tokenized
    both to check it and to explain it); other warnings are shown as before."""
    from ..tokens import UnknownTokenWarning

    shown, show = set(), warnings.showwarning

    def one_line(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, UnknownTokenWarning):
            return show(message, category, filename, lineno, file, line)
        text = str(message).removeprefix("mamba_captum: ")
        if text not in shown:
            shown.add(text)
            print(f"mamba-captum {command}: warning: {text}", file=sys.stderr)

    warnings.simplefilter("always", UnknownTokenWarning)  # this run's own once-per-text rule, above
    own.append(warnings.filters[0])
    warnings.showwarning = one_line


def _run(args) -> int:
    from ..usage import UsageError

    try:
        getattr(sys.modules[__name__], f"_{args.command}")(args)
    except UsageError as error:
        print(f"mamba-captum {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a file that vanished or filled the disk mid-run: still one line
        print(f"mamba-captum {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the JSONL keeps the rows written so far
        print(f"mamba-captum {args.command}: interrupted.", file=sys.stderr)
        return 130
    except Exception as error:
        if not _about_the_checkpoint(error):
            raise
        print(f"mamba-captum {args.command}: error: {str(error).removeprefix('mamba_captum: ')}", file=sys.stderr)
        return 2
    return 0


def _about_the_checkpoint(error: Exception) -> bool:
    """Whether ``error`` is a NonFiniteError or ReconstructionError: the checkpoint's numbers, or a variant not
    supported. Their classes are looked up among the modules already imported (one raised means its module is),
    so that a usage error imports neither (both import torch)."""
    kinds = [getattr(sys.modules.get(module), name, None)
             for module, name in (("mamba_captum.checks", "NonFiniteError"),
                                  ("mamba_captum.verification", "ReconstructionError"))]
    return any(kind is not None and isinstance(error, kind) for kind in kinds)
