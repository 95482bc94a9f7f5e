"""The evaluation suite's command lines (``mamba-captum evaluate``, ``python -m mamba_captum.evaluation.vision`` and
``.train``) refuse what they cannot use in one line, exit code 2, before any model runs and with nothing written: a
damaged resume journal (by file and line), a damaged ``results.json``, a count that is not positive
(``evaluate --examples``: in tests/test_cli.py)."""
import json
from pathlib import Path

import pytest
from test_cli import one_error_line, run_main

import mamba_captum
from mamba_captum.evaluation import compare, train, vision
from mamba_captum.evaluation.report import BEGIN, END
from mamba_captum.evaluation.results import journal_problem, read_results, row_problem

OPTIONS = ["--family", "mamba", "--task", "counting", "--examples", "8", "--no-perturbation", "--method", "Saliency"]
JOB = dict(family="mamba", task="counting", examples=8, perturbation=False, methods=["Saliency"])
ROW = dict(family="mamba", task="counting", method="Saliency", group="captum", seconds=0.5, held_out_accuracy=1.0,
           roc_auc=0.9, precision_at_k=0.5, relevance_mass=0.4)
CURVES = dict(activation=[0.1, 0.2], pruning=[0.3], morf=[0.4], lerf=[0.5])
PERTURBED = dict(ROW, auac=0.5, au_mse=0.1, morf_auc=40.0, lerf_auc=60.0, curves=CURVES)


def line(**record) -> bytes:
    return json.dumps({"rows": [ROW], "job": JOB, **record}).encode()


# a line of an interrupted run's journal (after a good one) and what the one error line says about it
DAMAGED_JOURNAL = [
    (b"\xff\xfe\x00", "byte 1 of the line is not UTF-8 text"),
    (b"42", "a JSON number, not a result object"),
    (b'{"rows": [], "job": {"family": "mam', "not a JSON line"),
    (line(job=dict(JOB, examples=64)), "a result of other work than asked for now"),
    (line(rows=None), "has 'rows' that is a JSON null, not an array"),
    (line(rows=[]), "has no rows"),
    (line(rows=[42]), "holds a row that is a JSON number, not an object"),
    (line(rows=[{k: v for k, v in ROW.items() if k != "method"}]), "holds a row without 'method'"),
    (line(rows=[dict(ROW, seconds="fast")]), "holds a row whose 'seconds' is 'fast', not a number"),
    (line(rows=[dict(ROW, roc_auc=None)]), "holds the row of 'Saliency' whose 'roc_auc' is None, not a number"),
    (line(rows=[dict(ROW, group="baseline")]), "holds a row of group 'baseline'"),
    (line(rows=[dict(ROW, family="rwkv")]), "holds a row of rwkv counting, another model"),
    (line(rows=[PERTURBED]), "holds the row of 'Saliency' with 'auac', which a run without perturbation does not "
                             "score"),
]


@pytest.mark.parametrize("damaged, message", DAMAGED_JOURNAL, ids=[m for _, m in DAMAGED_JOURNAL])
def test_a_damaged_journal_is_one_line_naming_file_and_line(tmp_path, capsys, damaged, message):
    doc, assets = tmp_path / "faithfulness.md", tmp_path / "assets"
    assets.mkdir()
    journal = assets / "results.partial.jsonl.part0"
    journal.write_bytes(line() + b"\n" + damaged + b"\n")
    code, out, err = run_main(capsys, "evaluate", *OPTIONS, "--doc", doc, "--assets", assets)
    error = one_error_line(err)
    assert code == 2 and error.startswith(f"mamba-captum evaluate: error: {journal}:2: ") and message in error
    assert "--restart" in error and "Traceback" not in err
    assert not doc.exists() and sorted(p.name for p in assets.iterdir()) == [journal.name]  # nothing written


@pytest.mark.parametrize("perturbation, row, problem", [
    (True, ROW, "the row of 'Saliency' without 'auac'"),
    (True, dict(PERTURBED, curves=dict(CURVES, morf="none")), "'curves' are not the lists of numbers"),
    (True, dict(PERTURBED, group="ablation"), "the row of 'Saliency' with 'auac', which an ablation does not score"),
    (None, dict(ROW, auac=0.5), "the row of 'Saliency' without 'au_mse'"),
    (None, {k: v for k, v in ROW.items() if k != "roc_auc"}, "the row of 'Saliency' without 'roc_auc'"),
    (None, dict(ROW, held_out_accuracy=True), "'held_out_accuracy' is True, not a number"),
])
def test_rows_the_report_cannot_use_are_named(perturbation, row, problem):
    assert problem in row_problem(row, perturbation)


def test_the_rows_a_run_writes_pass():
    bbc = {k: v for k, v in PERTURBED.items() if k not in ("roc_auc", "precision_at_k", "relevance_mass")}
    assert row_problem(PERTURBED, True) is None and row_problem(ROW, False) is None
    assert row_problem(dict(bbc, task="bbc_news"), None) is None  # no planted truth: no localisation scores
    assert row_problem(dict(ROW, group="ablation"), True) is None  # ablations: localisation only
    assert journal_problem({"rows": [ROW], "job": JOB}) is None
    # what the comparison writes: a run with perturbation, and the committed results (every family, task, method)
    methods = [m for m in compare.captum_methods() if m.name in ("Saliency", "Random")]
    rows = compare.evaluate(pairs=[("mamba", "counting")], examples=4, methods=lambda family: methods)
    assert journal_problem({"rows": rows, "job": dict(JOB, examples=4, perturbation=True)}) is None
    assert len(read_results(Path(mamba_captum.__file__).parents[1] / "docs/assets/faithfulness/results.json")) > 1000


@pytest.mark.parametrize("content, message", [
    (None, "does not exist; run the comparison without --report-only first"),
    (b"{\"rows\": [", "is not JSON"),
    (b"\xff", "is not JSON"),
    (b"[]", "holds no list of 'rows'"),
    (json.dumps({"rows": [ROW, dict(ROW, method=7)]}).encode(), "row 1 is a row whose 'method' is 7, not a string"),
])
def test_report_only_refuses_a_damaged_results_json(tmp_path, capsys, content, message):
    doc, assets = tmp_path / "faithfulness.md", tmp_path / "assets"
    doc.write_text(f"# Faithfulness\n\n{BEGIN}\n{END}\n")
    assets.mkdir()
    if content is not None:
        (assets / "results.json").write_bytes(content)
    code, _, err = run_main(capsys, "evaluate", "--report-only", "--doc", doc, "--assets", assets)
    assert code == 2 and message in one_error_line(err) and "Traceback" not in err
    assert doc.read_text() == f"# Faithfulness\n\n{BEGIN}\n{END}\n" and len(list(assets.iterdir())) == len(
        [content] if content is not None else [])


def test_update_refuses_a_damaged_results_json_before_any_work(tmp_path, capsys, monkeypatch):
    from mamba_captum.evaluation import compare

    monkeypatch.setattr(compare, "evaluate", lambda **k: pytest.fail("a model was run"))
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "results.json").write_text(json.dumps({"rows": [{"family": "mamba"}]}))
    code, _, err = run_main(capsys, "evaluate", *OPTIONS, "--update", "--doc", tmp_path / "f.md", "--assets", assets)
    assert code == 2 and "row 0 is a row without 'task'" in one_error_line(err)
    assert not (tmp_path / "f.md").exists() and [p.name for p in assets.iterdir()] == ["results.json"]


@pytest.mark.parametrize("main, arguments", [
    (vision.main, ["--examples", "0"]), (vision.main, ["--train", "shapes", "--max-steps", "-1"]),
    (train.main, ["--family", "mamba", "--task", "counting", "--max-steps", "0"]),
])
def test_the_evaluation_modules_refuse_counts_below_one(tmp_path, capsys, main, arguments):
    with pytest.raises(SystemExit) as leaving:
        main([*arguments, "--weights" if main is vision.main else "--out", str(tmp_path / "out")])
    assert leaving.value.code == 2 and "must be at least 1, not" in one_error_line(capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def tree(folder) -> dict:
    """Every file under ``folder``: relative path -> bytes (folders as None)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


# a --doc the report cannot go into (how it is made in tmp_path) and what the one error line says about it
BAD_DOCS = [
    ("no markers", lambda doc: doc.write_text("# Faithfulness\n\nprose only\n"),
     "lacks the generated-section markers"),
    ("a directory", lambda doc: doc.mkdir(), "is a directory; give the Markdown file"),
    ("not UTF-8", lambda doc: doc.write_bytes(b"# Faithfulness \xff\n"), "is not UTF-8 text (invalid start byte"),
]


@pytest.mark.parametrize("report_only", [False, True], ids=["run", "report-only"])
@pytest.mark.parametrize("name, make, message", BAD_DOCS, ids=[name for name, _, _ in BAD_DOCS])
def test_a_doc_the_report_cannot_go_into_is_refused_before_any_work(tmp_path, capsys, monkeypatch, report_only,
                                                                     name, make, message):
    monkeypatch.setattr(compare, "evaluate", lambda **k: pytest.fail("a model was run"))
    doc, assets = tmp_path / "faithfulness.md", tmp_path / "assets"
    make(doc)
    assets.mkdir()
    (assets / "results.json").write_text(json.dumps({"rows": [ROW]}))
    before = tree(tmp_path)
    code, _, err = run_main(capsys, "evaluate", *(["--report-only"] if report_only else OPTIONS), "--doc", doc,
                            "--assets", assets)
    assert code == 2 and "Traceback" not in err
    assert one_error_line(err).startswith(f"mamba-captum evaluate: error: --doc {str(doc)!r} ") and \
        message in one_error_line(err)
    assert tree(tmp_path) == before  # results.json and the plots untouched


@pytest.mark.parametrize("name, make, message", BAD_DOCS + [
    ("missing", lambda doc: None, "does not exist; give the Markdown file holding the markers")],
    ids=[name for name, _, _ in BAD_DOCS] + ["missing"])
def test_the_image_suite_refuses_a_doc_it_cannot_go_into(tmp_path, capsys, monkeypatch, name, make, message):
    from mamba_captum.evaluation import vision_compare

    monkeypatch.setattr(vision_compare, "evaluate_images", lambda *a, **k: pytest.fail("a model was run"))
    doc = tmp_path / "faithfulness.md"
    make(doc)
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as leaving:
        vision.main(["--doc", str(doc), "--assets", str(tmp_path / "assets")])
    err = capsys.readouterr().err
    assert leaving.value.code == 2 and message in one_error_line(err) and f"--doc {str(doc)!r}" in err
    assert tree(tmp_path) == before


@pytest.mark.parametrize("content, message", [
    (None, "images.json does not exist; run python -m mamba_captum.evaluation.vision without --report-only"),
    (b'{"rows": [', "images.json is not JSON"),
    (b"[]", "images.json holds a JSON array, not the results object"),
    (b'{"rows": [], "models": []}', "images.json has no string 'command'"),
])
def test_image_report_only_refuses_a_missing_or_damaged_images_json(tmp_path, capsys, content, message):
    from mamba_captum.evaluation.vision_compare import BEGIN as IMAGES_BEGIN, END as IMAGES_END

    doc, assets = tmp_path / "faithfulness.md", tmp_path / "assets"
    doc.write_text(f"# Faithfulness\n\n{IMAGES_BEGIN}\n{IMAGES_END}\n")
    assets.mkdir()
    if content is not None:
        (assets / "images.json").write_bytes(content)
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as leaving:
        vision.main(["--report-only", "--doc", str(doc), "--assets", str(assets)])
    err = capsys.readouterr().err
    assert leaving.value.code == 2 and message in one_error_line(err) and "Traceback" not in err
    assert tree(tmp_path) == before


def test_a_results_json_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "results.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"rows": [ROW]}).encode())  # as a Windows editor saves it
    assert read_results(path) == [ROW]
