"""Run the faithfulness comparison over the shipped models and write ``docs/faithfulness.md``'s generated part.

``python -m mamba_captum.evaluation`` or ``mamba-captum evaluate`` runs :func:`main`: every family × task whose
shipped classifier reached the accuracy bar is scored with every method (compare.py); the results go to
``docs/assets/faithfulness/results.json``, the tables and plot links between the ``generated`` markers of
``docs/faithfulness.md`` (the prose around them is kept), the plots to ``docs/assets/faithfulness/``.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from ..files import atomic_target, check_outputs, write_atomically
from ..fla_cpu import fla_available
from ..usage import evaluate_parser
from .models import FAMILIES, FLA_FAMILIES, shipped, training_record, weights_root
from .results import LOCALISATION, PERTURBATION, journal_problem, read_doc, read_results
from .tasks import CHOICE_TASKS, HELD_OUT_TASKS, TASKS

BEGIN, END = "<!-- generated:begin (python -m mamba_captum.evaluation) -->", "<!-- generated:end -->"
ACCURACY_BAR = 0.97
# what --assets holds after a run (the journal only while one runs)
ASSET_FILES = ("results.json", "results.partial.jsonl", "roc_auc.png", "curves.png")
HEADERS = {"roc_auc": "ROC-AUC ↑", "precision_at_k": "P@k ↑", "relevance_mass": "mass ↑", "auac": "AUAC ↑",
           "au_mse": "AU-MSE ↓", "morf_auc": "MoRF ↓", "lerf_auc": "LeRF ↑", "seconds": "time (s)"}


def available_models(families, tasks, root=None, bar=ACCURACY_BAR):
    """(usable, skipped): the (family, task) pairs whose shipped classifier reached ``bar`` held-out accuracy, and
    the others with the reason."""
    usable, skipped = [], []
    for task in tasks:
        for family in families:
            if not shipped(family, task):
                continue
            try:
                record = training_record(family, task, root)
            except FileNotFoundError:
                skipped.append((family, task, "not trained"))
                continue
            if family in FLA_FAMILIES and not fla_available():
                skipped.append((family, task, 'flash-linear-attention not installed (pip install "mamba-captum[fla]")'))
                continue
            if task != "bbc_news" and record["held_out_accuracy"] < bar:
                skipped.append((family, task, f"held-out accuracy {record['held_out_accuracy']:.1%} < {bar:.0%}"))
                continue
            usable.append((family, task, record))
    return usable, skipped


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else float("nan")


def _fmt(value, digits=3):
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _methods_in_order(rows):
    seen = []
    for row in rows:
        if row["method"] not in seen:
            seen.append(row["method"])
    # the default first, as compare.implicit_methods lists it (rows merged from older runs come before it)
    return sorted(seen, key=lambda method: method != DEFAULT_METHOD)


def localisation_tables(rows) -> str:
    """Per task: methods × families ROC-AUC (P@k in parentheses); then the mean over every model."""
    out = []
    methods = _methods_in_order(rows)
    by = {(r["family"], r["task"], r["method"]): r for r in rows}
    tasks = [t for t in dict.fromkeys(r["task"] for r in rows) if any("roc_auc" in r for r in rows if r["task"] == t)]
    models = [(f, t) for f, t in dict.fromkeys((r["family"], r["task"]) for r in rows) if t in tasks]
    out.append("### Localisation: mean over every model (family × planted task)\n")
    out.append("| method | " + " | ".join(HEADERS[k] for k in LOCALISATION) + " | models won (ROC-AUC) | "
               "time (s) |")
    out.append("|---|" + "---|" * (len(LOCALISATION) + 2))
    best = {m: max(by[(m[0], m[1], x)]["roc_auc"] for x in methods if (m[0], m[1], x) in by) for m in models}
    for method in methods:
        cells = [_fmt(_mean([by[(f, t, method)].get(k) for f, t in models if (f, t, method) in by]))
                 for k in LOCALISATION]
        wins = sum(1 for m in models if (m[0], m[1], method) in by and by[(m[0], m[1], method)]["roc_auc"] >= best[m] - 1e-9)
        seconds = _mean([by[(f, t, method)]["seconds"] for f, t in models if (f, t, method) in by])
        out.append(f"| {method} | " + " | ".join(cells) + f" | {wins}/{len(models)} | {_fmt(seconds, 2)} |")
    out.append(ours_against_captum(rows, models))
    for task in tasks:
        families = [f for f, t in models if t == task]
        out.append(f"\n### {task}: ROC-AUC (precision@k)\n")
        out.append("| method | " + " | ".join(families) + " |")
        out.append("|---|" + "---|" * len(families))
        for method in methods:
            cells = []
            for family in families:
                row = by.get((family, task, method))
                cells.append("–" if row is None else f"{_fmt(row['roc_auc'], 2)} ({_fmt(row['precision_at_k'], 2)})")
            out.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def ours_against_captum(rows, models) -> str:
    """Per model, the best of our methods (group "ours") against the best Captum baseline, on ROC-AUC to three
    decimals (64 examples cannot tell 0.9995 from 1): how often ours is higher, equal, lower, and the lower ones."""
    best = {}
    for r in rows:
        if "roc_auc" in r and r["group"] in ("ours", "captum") and (r["family"], r["task"]) in models:
            key = (r["family"], r["task"], r["group"])
            if key not in best or r["roc_auc"] > best[key]["roc_auc"]:
                best[key] = r
    higher, equal, lower = [], [], []
    for family, task in models:
        if (family, task, "ours") not in best or (family, task, "captum") not in best:
            continue
        ours, captum = best[(family, task, "ours")], best[(family, task, "captum")]
        a, b = round(ours["roc_auc"], 3), round(captum["roc_auc"], 3)
        (higher if a > b else equal if a == b else lower).append((family, task, ours, captum))
    total = len(higher) + len(equal) + len(lower)
    out = [f"\nBest of our methods against the best Captum baseline, per model (ROC-AUC to 3 decimals): higher on "
           f"{len(higher)}, equal on {len(equal)}, lower on {len(lower)} of {total} "
           f"({len(higher) + len(equal)}/{total} = {(len(higher) + len(equal)) / max(total, 1):.1%} not lower).\n"]
    if lower:
        out.append("| model | ours (best) | Captum (best) |\n|---|---|---|")
        out += [f"| {f} {t} | {_fmt(o['roc_auc'])} {o['method']} | {_fmt(c['roc_auc'])} {c['method']} |"
                for f, t, o, c in lower]
    return "\n".join(out)


DEFAULT_METHOD = "Attribution (default)"  # MambaAttribution(model).attribute(ids, target=c), compare.implicit_methods
HELD_OUT_FAMILIES = ("mamba3",)


def default_against_captum(rows) -> str:
    """The default method per model against every Captum baseline (ROC-AUC to three decimals), on the models the
    default was chosen on and on the held-out ones (:data:`.tasks.CHOICE_TASKS`, :data:`.tasks.HELD_OUT_TASKS`, and
    every model of :data:`HELD_OUT_FAMILIES`), with the best of ours beside it."""
    by = {}
    for r in rows:
        if "roc_auc" in r:
            by.setdefault((r["family"], r["task"]), []).append(r)
    out = ["| models | the default's mean ROC-AUC | the default ≥ every Captum baseline | best of ours ≥ every "
           "Captum baseline | best Captum baseline's mean ROC-AUC |", "|---|---|---|---|---|"]
    for label, chosen in (("chosen on", lambda f, t: t in CHOICE_TASKS and f not in HELD_OUT_FAMILIES),
                          ("held out", lambda f, t: t in HELD_OUT_TASKS or f in HELD_OUT_FAMILIES)):
        models = [m for m in by if chosen(*m) and any(r["method"] == DEFAULT_METHOD for r in by[m])
                  and any(r["group"] == "captum" for r in by[m])]
        if not models:
            continue
        default = {m: next(r["roc_auc"] for r in by[m] if r["method"] == DEFAULT_METHOD) for m in models}
        captum = {m: max(r["roc_auc"] for r in by[m] if r["group"] == "captum") for m in models}
        ours = {m: max(r["roc_auc"] for r in by[m] if r["group"] == "ours") for m in models}
        wins = sum(round(default[m], 3) >= round(captum[m], 3) for m in models)
        best = sum(round(ours[m], 3) >= round(captum[m], 3) for m in models)
        tasks = sorted({t for _, t in models})
        out.append(f"| {label} ({len(models)}: {', '.join(tasks)}) | {_mean(list(default.values())):.3f} | "
                   f"{wins}/{len(models)} = {wins / len(models):.0%} | {best}/{len(models)} = {best / len(models):.0%} "
                   f"| {_mean(list(captum.values())):.3f} |")
    return "\n".join(out)


def perturbation_table(rows) -> str:
    """Methods × perturbation scores, mean over every model (planted tasks and BBC News)."""
    methods = _methods_in_order(rows)
    out = ["| method | " + " | ".join(HEADERS[k] for k in PERTURBATION) + " |", "|---|" + "---|" * len(PERTURBATION)]
    for method in methods:
        mine = [r for r in rows if r["method"] == method and "auac" in r]
        out.append(f"| {method} | " + " | ".join(_fmt(_mean([r[k] for r in mine]), 3 if k == "auac" else 2)
                                                  for k in PERTURBATION) + " |")
    return "\n".join(out)


def plots(rows, folder: Path) -> list[str]:
    """A heatmap of ROC-AUC (methods × models) and the mean activation / MoRF curves; returns the file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    methods = _methods_in_order(rows)
    models = [m for m in dict.fromkeys((r["family"], r["task"]) for r in rows if "roc_auc" in r)]
    by = {(r["family"], r["task"], r["method"]): r for r in rows}
    if models:
        grid = np.array([[by[(f, t, m)]["roc_auc"] if (f, t, m) in by else np.nan for f, t in models]
                         for m in methods])
        fig, ax = plt.subplots(figsize=(1.0 + 0.45 * len(models), 1.0 + 0.32 * len(methods)))
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(models)), [f"{f}\n{t}" for f, t in models], rotation=90, fontsize=7)
        ax.set_yticks(range(len(methods)), methods, fontsize=7)
        fig.colorbar(image, ax=ax, label="localisation ROC-AUC")
        with atomic_target(folder / "roc_auc.png") as temporary:
            fig.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append("roc_auc.png")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax in axes:
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # 20 distinct colours: the default cycle repeats after 10
    for method in methods:
        mine = [r for r in rows if r["method"] == method and "curves" in r]
        if not mine:
            continue
        if mine[0]["group"] == "ablation":  # scored by localisation only: no curves
            continue
        style = {"ours": "-", "captum": "--"}.get(mine[0]["group"], ":")
        activation = np.mean([r["curves"]["activation"] for r in mine], 0)
        morf = np.mean([r["curves"]["morf"] for r in mine], 0)
        axes[0].plot(np.linspace(0, 1, len(activation)), activation, style, label=method, linewidth=1)
        axes[1].plot(np.linspace(0.1, 0.9, len(morf)), morf, style, label=method, linewidth=1)
    axes[0].set(title="activation (mean over models): higher is better", xlabel="fraction of tokens put back",
                ylabel="p(true class)")
    axes[1].set(title="MoRF deletion: lower is better", xlabel="fraction of most relevant tokens → [UNK]",
                ylabel="accuracy")
    axes[1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    with atomic_target(folder / "curves.png") as temporary:
        fig.savefig(temporary, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    names.append("curves.png")
    return names


def generated_section(rows, usable, skipped, seconds, command) -> str:
    parts = [BEGIN, "", "The rows of `docs/assets/faithfulness/results.json`, written by "
             "`python -m mamba_captum.evaluation` "
             "(`--update` merges models run separately, `--report-only` rewrites this section from the file); "
             f"the last command was `{command}`. Times: 2 CPU cores, shared. Every method explains the "
             "log-probability of the true class over the label "
             "tokens at the final query token; 64 held-out examples per task (a seed no model saw).", ""]
    parts.append("### The models\n")
    parts.append("| family | task | held-out accuracy | training steps | training time (s) | parameters |")
    parts.append("|---|---|---|---|---|---|")
    for family, task, record in usable:
        parts.append(f"| {family} | {task} | {record['held_out_accuracy']:.1%} ({record['held_out_examples']}) | "
                     f"{record['steps']} | {record['train_seconds']} | {record['parameters']:,} |")
    for family, task, reason in skipped:
        parts.append(f"| {family} | {task} | not scored: {reason} | | | |")
    parts += ["", "### The default against Captum's baselines, on the models it was chosen on and on held-out ones",
              "", default_against_captum(rows),
              "", localisation_tables(rows), "", "### Perturbation: mean over every model", "",
              "AUAC and AU-MSE over the fractions 0, 0.1 … 1 (trapezoid, x in 0..1); MoRF / LeRF: top-1 accuracy "
              "after replacing 10 … 90 % of the tokens by `[UNK]`, AUC ×100 over the 9 points 0.1..0.9 (maximum 80, "
              "no clean point).", "", perturbation_table(rows), "",
              "![localisation ROC-AUC per method and model](assets/faithfulness/roc_auc.png)", "",
              "![activation and MoRF curves](assets/faithfulness/curves.png)", "", END]
    return "\n".join(parts)


NEW_DOC = f"# Faithfulness\n\n{BEGIN}\n{END}\n"  # the text of a --doc not there yet


def write_report(rows, usable, skipped, seconds, doc: Path, assets: Path, command: str):
    """Write results.json, the plots and the generated section of ``doc``; the doc is read and checked first
    (:func:`.results.read_doc`, ValueError), so a doc without the markers leaves every file as it was."""
    text = read_doc(doc, BEGIN, END, missing=NEW_DOC)
    assets.mkdir(parents=True, exist_ok=True)
    write_atomically(assets / "results.json", json.dumps(dict(rows=rows, skipped=skipped), indent=0) + "\n")
    plots(rows, assets)
    section = generated_section(rows, usable, skipped, seconds, command)
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    write_atomically(doc, head + section + tail)


def main(argv=None):
    # defined without importing the suite (torch): `mamba-captum evaluate` checks its arguments at once
    parser = evaluate_parser()
    args = parser.parse_args(argv)
    from ..parallel import side_files

    # the resumable run's files beside its journal (part files, claims, staged copy) are outputs too
    journal = args.assets / "results.partial.jsonl"
    try:  # before anything is run or written: no output may replace a shipped model's file or another output
        check_outputs([("--doc", args.doc), *(("--assets", path) for path in side_files(journal))],
                      [("--weights", args.weights or weights_root())], [("--assets", args.assets, ASSET_FILES)])
        read_doc(args.doc, BEGIN, END, missing=NEW_DOC)  # a doc the report cannot go into: refused before the work
    except ValueError as error:  # FileClashError included
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if args.report_only:
        try:
            rows = read_results(args.assets / "results.json")
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        usable, skipped = available_models(FAMILIES, list(TASKS) + ["bbc_news"], args.weights)
        usable = [u for u in usable if any((r["family"], r["task"]) == u[:2] for r in rows)]
        write_report(rows, usable, skipped, sum(r["seconds"] for r in rows), args.doc, args.assets,
                     "python -m mamba_captum.evaluation --report-only")
        print(f"rewrote {args.doc} from {args.assets}/results.json ({len(rows)} rows)")
        return
    from .compare import evaluate

    usable, skipped = available_models(args.family, args.task, args.weights)
    if not usable:
        parser.exit(2, f"{parser.prog}: error: no shipped classifier for --family {' '.join(args.family)} --task "
                       f"{' '.join(args.task)} (bbc_news has a mamba model only); nothing was run or written.\n")
    earlier = None  # --update's rows, read before any work: a damaged results.json is refused now, not after it
    if args.update and (args.assets / "results.json").exists():
        try:
            earlier = read_results(args.assets / "results.json")
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
    start = time.perf_counter()
    methods = None  # the default: our methods, their ablations and Captum's baselines
    if args.method:
        from .compare import captum_methods, implicit_methods

        def chosen(family):
            named = [m for m in implicit_methods(family) + captum_methods() if any(s in m.name for s in args.method)]
            if not named:
                parser.exit(2, f"{parser.prog}: error: no method name contains {' or '.join(args.method)!r}; "
                               "nothing was run or written.\n")
            return named

        methods = chosen

    # one job per model, shared by the processes of accelerate launch / torchrun (docs/scale.md); an interrupted
    # run's models are kept in the journal and skipped by the next run
    from ..parallel import ResumeError, processes, run_jobs

    jobs = [dict(family=family, task=task, examples=args.examples, perturbation=not args.no_perturbation,
                 methods=args.method) for family, task, _ in usable]

    def work(job):
        return {"rows": evaluate(pairs=[(job["family"], job["task"])], examples=job["examples"],
                                 perturbation=job["perturbation"], weights_root=args.weights, methods=methods,
                                 log=lambda row: print({k: v for k, v in row.items() if k != "curves"}, flush=True))}

    args.assets.mkdir(parents=True, exist_ok=True)
    try:
        records = run_jobs(jobs, work, journal, group=processes(cpu=True), restart=args.restart,
                           progress="evaluating", check=journal_problem)
    except ResumeError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if records is None:  # not the main process: the main one writes the report
        return
    rows = [row for record in records for row in record["rows"]]
    if earlier is not None:
        ran = {(family, task) for family, task, _ in usable}
        replaced = {(r["family"], r["task"], r["method"]) for r in rows}
        kept = [r for r in earlier
                if (r["family"], r["task"]) not in ran
                or (args.method and (r["family"], r["task"], r["method"]) not in replaced)]
        rows = kept + rows
        usable, skipped = available_models(FAMILIES, list(TASKS) + ["bbc_news"], args.weights)
        usable = [u for u in usable if any((r["family"], r["task"]) == u[:2] for r in rows)]
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["python -m mamba_captum.evaluation", *given])
    write_report(rows, usable, skipped, time.perf_counter() - start, args.doc, args.assets, command)
    journal.unlink()  # the results are in results.json now
    print(f"wrote {args.doc} and {args.assets}/ ({len(rows)} rows)")
