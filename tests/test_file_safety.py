"""Inputs are never destroyed (issue 32): every output of the command line and of the evaluation suite is checked
against every input (checkpoint files and folders, images, datasets) and the other outputs before any model is loaded
or anything written, through symlinks, ``..`` and case; and outputs are written to a temporary file renamed into
place, so an interrupted write leaves the old file whole and no temporary behind (mamba_captum/files.py).

The refusals come before any model is loaded: the loaders are replaced by ones that fail the test if called, so the
checkpoints here are a few bytes of stand-in files."""
import itertools
import json
import os
import stat

import pytest
import torch
from test_cli import one_error_line, run_main
from tiny_models import make_vim

OUTPUTS = ["--out", "--jsonl"]  # the output files of explain (--text, --dataset, --image)
SPELLINGS = ["itself", "symlink", "detour"]  # ways to name an existing file (spelled below)

@pytest.fixture
def no_loading(monkeypatch):
    """Loading any model fails the test: a refusal must come first."""
    import mamba_captum.explain
    import mamba_captum.explain.images

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the output paths were checked")

    monkeypatch.setattr(mamba_captum.explain, "load", loaded)
    monkeypatch.setattr(mamba_captum.explain.images, "load_vim_file", loaded)


def snapshot(folder):
    """Every file under ``folder``: relative path -> bytes (symlinks as their targets' names)."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            files[str(path.relative_to(folder))] = ("link", os.readlink(path))
        elif path.is_file():
            files[str(path.relative_to(folder))] = path.read_bytes()
    return files


def spelled(path, spelling, tmp_path):
    """Another name for the existing ``path``: itself, a symlink to it, or a detour through ``..``."""
    if spelling == "itself":
        return path
    if spelling == "symlink":
        alias = tmp_path / f"alias-of-{path.name}"
        alias.symlink_to(path)
        return alias
    (tmp_path / "detour").mkdir(exist_ok=True)
    return tmp_path / "detour" / ".." / path.relative_to(tmp_path)


def refused(capsys, args, before, folder):
    """Run the command; it must exit with code 2 and one error line, leaving every file under ``folder`` as it was
    (no output, no temporary). Returns that line."""
    code, out, err = run_main(capsys, *args)
    assert code == 2, err
    assert snapshot(folder) == before
    return one_error_line(err)


# -- images: mamba-captum explain --model vim.pth --image ... ---------------------------------------------------------
@pytest.mark.parametrize("output, given, spelling",
                         list(itertools.product(OUTPUTS, ["--model", "--image"], SPELLINGS)))
def test_an_image_run_never_replaces_its_checkpoint_or_images(output, given, spelling, tmp_path, capsys, no_loading):
    (tmp_path / "vim.pth").write_bytes(b"checkpoint bytes")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG image bytes")
    (tmp_path / "other.png").write_bytes(b"\x89PNG other image")
    inputs = {"--model": tmp_path / "vim.pth", "--image": tmp_path / "photo.png"}
    target = spelled(inputs[given], spelling, tmp_path)
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", "--model", inputs["--model"], "--image", tmp_path / "other.png",
                            "--image", inputs["--image"], output, target], before, tmp_path)
    assert f"{given} and {output} both name {str(target)!r}" in line


def test_an_image_run_refuses_its_two_outputs_on_one_file(tmp_path, capsys, no_loading):
    (tmp_path / "vim.pth").write_bytes(b"checkpoint bytes")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG image bytes")
    (tmp_path / "old.html").write_text("the old report")
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", "--model", tmp_path / "vim.pth", "--image", tmp_path / "photo.png",
                            "--jsonl", tmp_path / "old.html", "--out", spelled(tmp_path / "old.html", "symlink",
                                                                               tmp_path)],
                   {**before, "alias-of-old.html": ("link", str(tmp_path / "old.html"))}, tmp_path)
    assert f"--jsonl and --out both name '{tmp_path}/alias-of-old.html'; give them different files" in line


# -- texts: mamba-captum explain --model DIR --dataset / --text --------------------------------------------------------
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def stand_in_checkpoint(folder):
    folder.mkdir()
    for name in CHECKPOINT_FILES:
        (folder / name).write_text(f"the checkpoint's {name}")
    return folder


@pytest.mark.parametrize("output, spelling", list(itertools.product(OUTPUTS, SPELLINGS)))
def test_a_text_run_never_replaces_its_dataset(output, spelling, tmp_path, capsys, no_loading):
    model = stand_in_checkpoint(tmp_path / "model")
    dataset = tmp_path / "texts.jsonl"
    dataset.write_text('{"text": "the plot was good"}\n')
    target = spelled(dataset, spelling, tmp_path)
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", "--model", model, "--dataset", dataset, output, target], before, tmp_path)
    assert f"--dataset and {output} both name {str(target)!r}" in line


@pytest.mark.parametrize("output, name, spelling",
                         list(itertools.product(OUTPUTS, CHECKPOINT_FILES, SPELLINGS)))
def test_a_text_run_never_replaces_a_file_of_its_checkpoint(output, name, spelling, tmp_path, capsys, no_loading):
    model = stand_in_checkpoint(tmp_path / "model")
    target = spelled(model / name, spelling, tmp_path)
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", "--model", model, "--text", "the plot", output, target], before, tmp_path)
    assert line.endswith(f"error: {output} {str(target)!r} is a file of --model {str(model)!r} and would replace "
                         "it; write outputs outside that folder.")


def test_a_checkpoint_file_linked_from_elsewhere_is_still_the_checkpoints(tmp_path, capsys, no_loading):
    # a Hugging Face cache snapshot: the folder's files are links into blobs/, which an output may name directly
    blobs, model = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    model.mkdir()
    for name in CHECKPOINT_FILES:
        (blobs / f"hash-of-{name}").write_text(name)
        (model / name).symlink_to(blobs / f"hash-of-{name}")
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", "--model", model, "--text", "x", "--jsonl", blobs / "hash-of-config.json"],
                   before, tmp_path)
    assert f"--jsonl '{blobs}/hash-of-config.json' is a file of --model '{model}'" in line


@pytest.mark.parametrize("args, message", [
    (["explain", "--model", "{model}", "--text", "x", "--out", "{model}"], "--model and --out both name '{model}'"),
    (["explain", "--model", "{model}", "--text", "x", "--device-map", "auto", "--offload-folder", "{model}"],
     "--model and --offload-folder both name '{model}'"),
    (["matrices", "--model", "{model}", "--text", "x", "--out-dir", "{model}"],
     "--model and --out-dir both name '{model}'"),
    (["matrices", "--model", "{model}", "--text", "x", "--out-dir", "{tmp}/maps", "--device-map", "auto",
      "--offload-folder", "{tmp}/maps"], "--out-dir and --offload-folder both name '{tmp}/maps'"),
])
def test_output_folders_are_neither_the_checkpoint_nor_each_other(args, message, tmp_path, capsys, no_loading):
    model = stand_in_checkpoint(tmp_path / "model")
    before = snapshot(tmp_path)
    line = refused(capsys, [a.replace("{model}", str(model)).replace("{tmp}", str(tmp_path)) for a in args],
                   before, tmp_path)
    assert message.replace("{model}", str(model)).replace("{tmp}", str(tmp_path)) in line


def test_the_demo_never_replaces_a_file_of_its_model(tmp_path, capsys, monkeypatch, no_loading):
    import mamba_captum.demo

    model = stand_in_checkpoint(tmp_path / "demo-model")  # the bundled model stays out of harm's way
    monkeypatch.setattr(mamba_captum.demo, "model_dir", lambda: model)
    before = snapshot(tmp_path)
    line = refused(capsys, ["demo", "--out", model / "config.json"], before, tmp_path)
    assert f"--out '{model}/config.json' is a file of the demo model '{model}'" in line


# -- the evaluation suite: python -m mamba_captum.evaluation (mamba-captum evaluate) and .evaluation.vision -----------
def stand_in_weights(root):
    for folder in ("mamba-needle", "vim-shapes"):
        (root / folder).mkdir(parents=True)
        (root / folder / "training.json").write_text(json.dumps({"held_out_accuracy": 1.0}))
        (root / folder / "model.safetensors").write_bytes(b"weights")
    return root


@pytest.mark.parametrize("args, message", [
    (["--doc", "{weights}/mamba-needle/model.safetensors"],
     "--doc '{weights}/mamba-needle/model.safetensors' is a file of --weights '{weights}'"),
    (["--doc", "{tmp}/assets/results.json", "--assets", "{tmp}/assets"],
     "--doc and --assets both name '{tmp}/assets/results.json'"),
    (["--assets", "{weights}"], "--weights and --assets both name '{weights}'"),
    (["--report-only", "--assets", "{weights}/mamba-needle"], "--assets '{weights}/mamba-needle/"),
])
def test_the_evaluation_never_replaces_a_shipped_model_or_its_own_outputs(args, message, tmp_path, capsys):
    weights = stand_in_weights(tmp_path / "weights")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "results.json").write_text('{"rows": []}')
    (weights / "mamba-needle" / "curves.png").write_bytes(b"a file of the model folder")

    def place(text):
        return text.replace("{tmp}", str(tmp_path)).replace("{weights}", str(weights))

    before = snapshot(tmp_path)
    line = refused(capsys, ["evaluate", "--weights", weights, "--doc", tmp_path / "faithfulness.md",
                            *map(place, args)], before, tmp_path)
    assert place(message) in line


def test_the_image_evaluation_never_replaces_a_shipped_model(tmp_path, capsys):
    from mamba_captum.evaluation.vision import main

    weights = stand_in_weights(tmp_path / "weights")
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as leaving:
        main(["--weights", str(weights), "--doc", str(weights / "vim-shapes" / "training.json")])
    assert leaving.value.code == 2 and snapshot(tmp_path) == before
    assert f"--doc '{weights}/vim-shapes/training.json' is a file of --weights '{weights}'" in \
        one_error_line(capsys.readouterr().err)


# -- the comparison itself: case, links, '..' --------------------------------------------------------------------------
def test_case_insensitivity_is_detected_as_the_file_system_behaves(tmp_path):
    from mamba_captum.files import is_case_insensitive

    (tmp_path / "Probe").write_text("")
    assert is_case_insensitive(tmp_path) == (tmp_path / "pROBE").exists()


def test_names_still_to_be_created_compare_by_case_where_the_file_system_ignores_it(tmp_path, monkeypatch):
    import mamba_captum.files as files

    assert files.path_key(tmp_path / "a" / ".." / "Out.html") == files.path_key(tmp_path / "Out.html")
    monkeypatch.setattr(files, "is_case_insensitive", lambda directory: True)
    assert files.path_key(tmp_path / "New" / "Out.html") == files.path_key(tmp_path / "nEW" / "out.HTML")
    with pytest.raises(files.FileClashError, match="--jsonl and --out both name"):
        files.check_outputs([("--jsonl", tmp_path / "R.jsonl"), ("--out", tmp_path / "r.JSONL")])
    monkeypatch.setattr(files, "is_case_insensitive", lambda directory: False)
    assert files.path_key(tmp_path / "New" / "Out.html") != files.path_key(tmp_path / "new" / "out.html")
    files.check_outputs([("--jsonl", tmp_path / "R.jsonl"), ("--out", tmp_path / "r.JSONL")])


# -- writing: a temporary renamed into place ---------------------------------------------------------------------------
def test_an_interrupted_write_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    from mamba_captum.files import atomic_target

    out = tmp_path / "report.html"
    out.write_bytes(b"the old report")
    with pytest.raises(KeyboardInterrupt):
        with atomic_target(out) as temporary, open(temporary, "wb") as handle:
            handle.write(b"half of the new rep")
            handle.flush()
            raise KeyboardInterrupt
    assert snapshot(tmp_path) == {"report.html": b"the old report"}


def test_a_write_replaces_the_file_a_link_names_and_keeps_its_permissions(tmp_path):
    from mamba_captum.files import write_atomically

    real, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    real.write_text("old")
    real.chmod(0o640)
    link.symlink_to(real)
    write_atomically(link, "new")
    assert link.is_symlink() and real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "real.jsonl"]
    write_atomically(os.devnull, "a device is written in place, not replaced")
    assert os.path.exists(os.devnull) and not stat.S_ISREG(os.stat(os.devnull).st_mode)


@pytest.fixture(scope="module")
def vim_files(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("vim")
    torch.save({"model": make_vim().state_dict()}, folder / "vim.pth")
    pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy()
    Image.fromarray(pixels).save(folder / "a.png")
    return folder


def test_a_cli_write_failing_mid_way_leaves_the_old_outputs_whole(vim_files, tmp_path, capsys, monkeypatch):
    old = {"report.html": b"the old report", "rows.jsonl": b'{"the": "old rows"}\n'}
    for name, data in old.items():
        (tmp_path / name).write_bytes(data)

    def disk_full(descriptor):  # the new bytes are in the temporary, not yet renamed onto the output
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    code, out, err = run_main(capsys, "explain", "--model", vim_files / "vim.pth", "--img-size", 32, "--image",
                              vim_files / "a.png", "--jsonl", tmp_path / "rows.jsonl", "--out",
                              tmp_path / "report.html")
    assert code == 2 and one_error_line(err).endswith("No space left on device")
    assert snapshot(tmp_path) == old
    monkeypatch.undo()
    code, out, err = run_main(capsys, "explain", "--model", vim_files / "vim.pth", "--img-size", 32, "--image",
                              vim_files / "a.png", "--jsonl", tmp_path / "rows.jsonl", "--out",
                              tmp_path / "report.html")
    assert code == 0, err
    assert sorted(snapshot(tmp_path)) == ["report.html", "rows.jsonl"]
    assert json.loads((tmp_path / "rows.jsonl").read_text())["image"] == str(vim_files / "a.png")


# -- the files a resumable --dataset run keeps beside --jsonl (mamba_captum.parallel.side_files) ----------------------
@pytest.mark.parametrize("given, path, args", [
    ("--dataset", "d.jsonl.part0", ["--dataset", "d.jsonl.part0", "--jsonl", "d.jsonl", "--restart"]),
    ("--dataset", "o.jsonl.tmp", ["--dataset", "o.jsonl.tmp", "--jsonl", "o.jsonl"]),
    ("--model", "r.jsonl.claims", ["--model", "r.jsonl.claims", "--dataset", "texts.jsonl", "--jsonl", "r.jsonl"]),
])
def test_a_dataset_run_never_replaces_an_input_with_its_working_files(given, path, args, tmp_path, capsys,
                                                                       no_loading):
    stand_in_checkpoint(tmp_path / "model")
    if given == "--model":
        stand_in_checkpoint(tmp_path / path)
    for name in ("texts.jsonl", path):
        if given == "--dataset" or name == "texts.jsonl":
            (tmp_path / name).write_text('{"text": "the plot was good"}\n')
    args = [str(tmp_path / a) if not a.startswith("--") else a for a in args]
    if given == "--dataset":
        args = ["--model", str(tmp_path / "model"), *args]
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", *args], before, tmp_path)
    assert line.endswith(f"error: {given} and --jsonl's working file both name {str(tmp_path / path)!r}; an output "
                         "never replaces an input: give --jsonl's working file another path.")


def test_the_evaluation_never_replaces_a_shipped_model_with_its_journals_working_files(tmp_path, capsys):
    weights = stand_in_weights(tmp_path / "weights")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "results.partial.jsonl.tmp").symlink_to(weights / "mamba-needle" / "model.safetensors")
    before = snapshot(tmp_path)
    line = refused(capsys, ["evaluate", "--weights", weights, "--doc", tmp_path / "faithfulness.md", "--assets",
                            tmp_path / "assets"], before, tmp_path)
    assert f"--assets '{tmp_path}/assets/results.partial.jsonl.tmp' is a file of --weights '{weights}'" in line


# -- matrices: the layer maps there now -------------------------------------------------------------------------------
def test_matrices_never_write_a_map_through_a_link_to_a_checkpoint_file(tmp_path, capsys, no_loading):
    model = stand_in_checkpoint(tmp_path / "model")
    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / "layer_00.png").symlink_to(model / "config.json")
    before = snapshot(tmp_path)
    line = refused(capsys, ["matrices", "--model", model, "--text", "x", "--out-dir", maps], before, tmp_path)
    assert line.endswith(f"error: --out-dir '{maps}/layer_00.png' is a file of --model '{model}' and would replace "
                         "it; write outputs outside that folder.")


# -- links to no file yet, and "-" -------------------------------------------------------------------------------------
def test_checking_an_output_link_to_no_file_creates_nothing_and_the_write_goes_through_it(vim_files, tmp_path,
                                                                                          capsys):
    from mamba_captum.cli.files import writable_file

    (tmp_path / "results").mkdir()
    link = tmp_path / "rows.jsonl"
    link.symlink_to(tmp_path / "results" / "rows.jsonl")
    assert writable_file(link) == link
    assert snapshot(tmp_path) == {"rows.jsonl": ("link", str(tmp_path / "results" / "rows.jsonl"))}
    code, out, err = run_main(capsys, "explain", "--model", vim_files / "vim.pth", "--img-size", 32, "--image",
                              vim_files / "a.png", "--jsonl", link)
    assert code == 0, err
    assert os.readlink(link) == str(tmp_path / "results" / "rows.jsonl")  # the link kept, its file written
    assert json.loads((tmp_path / "results" / "rows.jsonl").read_text())["image"] == str(vim_files / "a.png")


def test_an_output_link_into_a_missing_folder_is_refused_and_kept(tmp_path, capsys, no_loading):
    model = stand_in_checkpoint(tmp_path / "model")
    link = tmp_path / "report.html"
    link.symlink_to(tmp_path / "nowhere" / "report.html")
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", "--model", model, "--text", "x", "--out", link], before, tmp_path)
    assert line.endswith(f"error: {str(link)!r} links to '{tmp_path}/nowhere/report.html', whose folder does not "
                         "exist; create it or give another file name.")


def test_a_dash_output_is_refused_not_written_as_a_file_named_dash(tmp_path, capsys, monkeypatch, no_loading):
    model = stand_in_checkpoint(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    line = refused(capsys, ["explain", "--model", model, "--text", "x", "--out", "-"], before, tmp_path)
    assert line.endswith("error: '-' is not standard output here; give a file name (e.g. report.html).")


def test_the_weights_only_refusal_of_a_pickle_checkpoint_is_plain_text(tmp_path):
    import fractions

    from mamba_captum.vision.checkpoints import read_checkpoint

    torch.save({"model": fractions.Fraction(1, 3)}, tmp_path / "pickled.pth")  # a global weights_only refuses
    with pytest.raises(ValueError) as refusal:
        read_checkpoint(tmp_path / "pickled.pth")
    message = str(refusal.value)
    assert "weights-only PyTorch checkpoint (UnpicklingError: Weights only load failed." in message
    assert "\x1b" not in message and "\n" not in message
