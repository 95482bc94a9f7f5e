"""The rows of the faithfulness comparison read back from disk: the journal an interrupted run left
(``ASSETS/results.partial.jsonl`` and its part files, resumed by :func:`mamba_captum.parallel.run_jobs`) and
``results.json`` (``--report-only``, ``--update``). A row that the report cannot use (a damaged or hand-edited
file) is refused by name here instead of failing deep inside the tables, or, worse, scoring a model on a row of
another one.

A row, as :func:`mamba_captum.evaluation.compare.evaluate` makes it: ``family``, ``task``, ``method``, ``group``
(strings), ``seconds`` and, if there, ``held_out_accuracy`` (numbers); the localisation scores (numbers) for every
task but ``bbc_news``, which has no planted truth; with perturbation, and for every group but the ablations, the
perturbation scores (numbers) and their ``curves`` (lists of numbers).
"""
from __future__ import annotations

import json
import numbers
from pathlib import Path

from ..files import json_kind

GROUPS = ("ours", "ablation", "captum", "random")
LOCALISATION = ("roc_auc", "precision_at_k", "relevance_mass")
PERTURBATION = ("auac", "au_mse", "morf_auc", "lerf_auc")
CURVES = ("activation", "pruning", "morf", "lerf")
NO_TRUTH = ("bbc_news",)  # the tasks without planted truth: no localisation scores


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def row_problem(row, perturbation: bool | None = None) -> str | None:
    """What is wrong with one row, or None. ``perturbation``: whether the run that wrote it scored perturbation
    (None: unknown, the scores need only be all there or all absent)."""
    if not isinstance(row, dict):
        return f"a row that is a JSON {json_kind(row)}, not an object"
    for key, wanted in (("family", "a string"), ("task", "a string"), ("method", "a string"), ("group", "a string"),
                        ("seconds", "a number"), ("held_out_accuracy", "a number")):
        if key not in row:
            if key == "held_out_accuracy":  # the report does not read it (older rows lack it)
                continue
            return f"a row without {key!r}"
        if not (isinstance(row[key], str) if wanted == "a string" else _is_number(row[key])):
            return f"a row whose {key!r} is {row[key]!r}, not {wanted}"
    if row["group"] not in GROUPS:
        return f"a row of group {row['group']!r}, not one of {', '.join(GROUPS)}"
    name = f"the row of {row['method']!r}"
    for key in (*LOCALISATION, *PERTURBATION):
        if key in row and not _is_number(row[key]):
            return f"{name} whose {key!r} is {row[key]!r}, not a number"
    if row["task"] not in NO_TRUTH:
        missing = [key for key in LOCALISATION if key not in row]
        if missing:
            return f"{name} without {missing[0]!r}"
    scored = [key for key in (*PERTURBATION, "curves") if key in row]
    expected = bool(scored) if perturbation is None else (perturbation and row["group"] != "ablation")
    if expected:
        missing = [key for key in (*PERTURBATION, "curves") if key not in row]
        if missing:
            return f"{name} without {missing[0]!r}"
        curves = row["curves"]
        if not isinstance(curves, dict) or any(not isinstance(curves.get(k), list) or
                                               not all(_is_number(v) for v in curves[k]) for k in CURVES):
            return f"{name} whose 'curves' are not the lists of numbers {', '.join(CURVES)}"
    elif scored:  # perturbation known: off, or an ablation (scored by localisation only)
        which = "an ablation" if row["group"] == "ablation" else "a run without perturbation"
        return f"{name} with {scored[0]!r}, which {which} does not score"
    return None


def journal_problem(record: dict) -> str | None:
    """What is wrong with one model's result in the journal (``{"rows": [...], "job": {...}}``, the job already
    checked), or None: the rows must be those of the job's model, with the scores the job asked for."""
    job, rows = record["job"], record.get("rows")
    if not isinstance(rows, list):
        return "has no 'rows'" if "rows" not in record else f"has 'rows' that is a JSON {json_kind(rows)}, not an array"
    if not rows:
        return "has no rows (every model gets one per method)"
    for row in rows:
        problem = row_problem(row, bool(job.get("perturbation")))
        if problem is not None:
            return f"holds {problem}"
        if (row["family"], row["task"]) != (job.get("family"), job.get("task")):
            return f"holds a row of {row['family']} {row['task']}, another model"
    return None


def read_results(path: Path) -> list[dict]:
    """The rows of a ``results.json`` the comparison wrote, each checked.

    Raises:
        ValueError: naming the file and what is wrong (missing, not JSON, no ``rows``, a row the report cannot use).
    """
    advice = "run the comparison again without --report-only / --update to write it anew"
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the JSON
        data = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; run the comparison without --report-only first.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not JSON ({error}); {advice}.") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path} holds no list of 'rows'; {advice}.")
    for number, row in enumerate(rows):
        problem = row_problem(row)
        if problem is not None:
            raise ValueError(f"{path}: row {number} is {problem}; {advice}.")
    return rows


def read_image_results(path: Path) -> dict:
    """The ``images.json`` the image suite wrote (``--report-only`` rewrites the report from it; ``--arch`` keeps the
    other architectures' rows from it), checked as far as the report reads it: a JSON object with the lists
    ``models`` and ``rows``, the ``command`` string and, if there, the ``commands`` of each architecture.

    Raises:
        ValueError: naming the file, what is wrong and the fix.
    """
    advice = "run python -m mamba_captum.evaluation.vision without --report-only to write it anew"
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; {advice}.") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not the images.json of a run; {advice}.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not JSON ({error}); {advice}.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {json_kind(data)}, not the results object; {advice}.")
    for key, kind, fits in (("models", "list", list), ("rows", "list", list), ("command", "string", str)):
        if not isinstance(data.get(key), fits):
            raise ValueError(f"{path} has no {kind} {key!r}; {advice}.")
    if not all(isinstance(item, dict) for item in data["models"] + data["rows"]):
        raise ValueError(f"{path} holds a model or row that is not a JSON object; {advice}.")
    commands = data.get("commands", {})  # per architecture: the command that scored it and its seconds
    if not isinstance(commands, dict) or not all(isinstance(v, dict) and isinstance(v.get("command"), str)
                                                 for v in commands.values()):
        raise ValueError(f"{path} has 'commands' that are not {{architecture: {{'command': ..., 'seconds': ...}}}}; "
                         f"{advice}.")
    return data


def read_doc(doc: Path, begin: str, end: str, missing: str | None = None) -> str:
    """The text of the Markdown file a report goes into, read and checked before any work or write: a UTF-8 file
    holding the generated section's ``begin`` and ``end`` markers, in that order. ``missing``: the text of a file
    not there yet (None: it must exist).

    Raises:
        ValueError: naming the file, what is wrong and the fix.
    """
    doc = Path(doc)
    try:
        text = doc.read_bytes().decode("utf-8")
    except FileNotFoundError:
        if missing is not None:
            return missing
        raise ValueError(f"--doc {str(doc)!r} does not exist; give the Markdown file holding the markers "
                         f"{begin!r} … {end!r}.") from None
    except IsADirectoryError:
        raise ValueError(f"--doc {str(doc)!r} is a directory; give the Markdown file (e.g. "
                         "docs/faithfulness.md).") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"--doc {str(doc)!r} is not UTF-8 text ({error.reason} at byte {error.start}); give the "
                         "Markdown file (e.g. docs/faithfulness.md).") from None
    except OSError as error:
        raise ValueError(f"--doc {str(doc)!r} cannot be read: {error.strerror or error}.") from None
    start = text.find(begin)
    if start < 0 or text.find(end, start) < 0:
        raise ValueError(f"--doc {str(doc)!r} lacks the generated-section markers {begin!r} … {end!r} (in that "
                         "order); add those two lines where the generated part goes.")
    return text
