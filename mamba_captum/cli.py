"""The ``mamba-captum`` command: ``mamba-captum evaluate [...]`` runs the faithfulness comparison
(docs/faithfulness.md)."""
from __future__ import annotations

import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"evaluate": "the faithfulness comparison on the shipped tiny classifiers (docs/faithfulness.md)"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        listing = "\n".join(f"  {name:10s} {text}" for name, text in commands.items())
        print(f"usage: mamba-captum COMMAND [options]\n\ncommands:\n{listing}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "evaluate":
        from .evaluation.report import main as evaluate
        evaluate(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
