"""`make predict`: a folder of images -> one CSV row per file from the serving venv, bad files included as rows."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tasks.release.inference import OnnxModel
from tests.helpers.project import ROOT
from tests.helpers.serving import SERVE, paths_of, serve_python


def predict(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m serving.predict` in the serving venv, with cwd's params.yaml (as make predict runs it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [str(serve_python()), "-m", "serving.predict", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def workdir(project: Path, tmp_path: Path) -> Path:
    paths = paths_of(project).model_dump(mode="json")
    serve = SERVE.model_dump(mode="json", include={"max_pixels", "max_body_bytes", "top_k"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"paths": paths, "serve": serve}))
    return tmp_path


def rows_of(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == ["path", "label", "probability", "topk", "error"]
        return list(reader)


def test_a_folder_gives_one_row_per_file_bad_files_included(project: Path, workdir: Path) -> None:
    folder = workdir / "inbox"
    images = sorted(p for p in (project / "images").rglob("*") if p.is_file())[:20]
    for i, image in enumerate(images):
        target = folder / ("nested" if i % 3 == 0 else "") / f"{i:02d}_{image.name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(image, target)
    (folder / "notes.txt").write_text("not an image")
    (folder / "cut.jpg").write_bytes(images[0].read_bytes()[:200] if images[0].suffix == ".jpg" else b"\xff\xd8\xff")
    Image.new("L", (1500, 1500)).save(folder / "bomb.png")  # 2.25 Mpx > SERVE.max_pixels 1 Mpx, 7 KB on disk
    (folder / ".DS_Store").write_bytes(b"hidden")
    os.mkfifo(folder / "pipe.png")  # read, it would wait for a writer forever

    done = predict(workdir, "inbox", "--out", "out.csv")
    assert done.returncode == 3, done.stderr  # some files not classified
    rows = rows_of(workdir / "out.csv")
    files = sorted(str(p.relative_to(workdir)) for p in folder.rglob("*") if p.name != ".DS_Store" and not p.is_dir())
    assert [row["path"] for row in rows] == files  # one row per file, in path order, the hidden one aside
    errors = {Path(row["path"]).name: row["error"].split(":")[0] for row in rows if row["error"]}
    assert errors == {"notes.txt": "not_an_image", "cut.jpg": "truncated", "bomb.png": "decompression_bomb",
                      "pipe.png": "not_a_file"}  # fmt: skip
    assert next(row["error"] for row in rows if row["path"].endswith("pipe.png")) == "not_a_file: a FIFO, never opened"
    assert all(row["label"] == "" == row["probability"] for row in rows if row["error"])

    model = OnnxModel.load(project / "models" / "model.onnx")  # the same file, scored in this (training) venv
    for row in (row for row in rows if not row["error"]):
        expected = model.predict((workdir / row["path"]).read_bytes(), top_k=SERVE.top_k)
        topk = json.loads(row["topk"])
        assert [entry["label"] for entry in topk] == [p.label for p in expected]
        assert row["label"] == expected[0].label
        assert float(row["probability"]) == pytest.approx(expected[0].probability, abs=1e-5)
    assert "20 of 24 classified" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "[predict] 4 of 24 file(s) not classified (1 decompression_bomb, 1 truncated, 1 not_an_image, 1 not_a_file; "
        "exit 3); each row of out.csv says why"
    ), done.stderr
    good = workdir / "good"
    good.mkdir()
    for image in images[:3]:
        shutil.copy(image, good / image.name)
    every = predict(workdir, "good", "--out", "good.csv")
    assert every.returncode == 0 and "3 of 3 classified" in every.stderr, every.stderr


def test_none_classified_exits_1_in_one_line_and_still_writes_the_rows(workdir: Path) -> None:
    (workdir / "junk").mkdir()
    (workdir / "junk" / "a.png").write_bytes(b"")
    (workdir / "junk" / "b.jpg").write_bytes(b"not a jpeg")
    done = predict(workdir, "junk", "--out", "junk.csv")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [
        "[predict] error: none of the 2 file(s) in junk could be classified (1 empty_file, 1 not_an_image); "
        "each row of junk.csv says why"
    ]
    assert [row["error"].split(":")[0] for row in rows_of(workdir / "junk.csv")] == ["empty_file", "not_an_image"]


def test_bad_src_out_or_model_are_one_line_and_write_nothing(project: Path, workdir: Path) -> None:
    image = next(p for p in (project / "images").rglob("*.png"))
    cases = {
        ("missing",): "SRC missing: no such file or folder",
        (str(image), "--out", "no/such/dir/out.csv"): "OUT no/such/dir/out.csv: its folder no/such/dir does not exist",
        (str(image), "--model", "nope.onnx"): "MODEL nope.onnx: no such file",
    }
    os.mkfifo(workdir / "fifo")
    cases[("fifo",)] = "SRC fifo: a FIFO, not an image file or a folder"
    for args, expected in cases.items():
        done = predict(workdir, *args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1] == f"[predict] error: {expected}"
    # A model whose bytes are not the ones export recorded is refused before use.
    tampered = workdir / "models" / "model.onnx"
    tampered.parent.mkdir()
    shutil.copy(project / "models" / "model.onnx", tampered)
    tampered.write_bytes(tampered.read_bytes() + b"\0")
    params = yaml.safe_load((workdir / "params.yaml").read_text())
    params["paths"]["onnx"] = str(tampered)
    (workdir / "params.yaml").write_text(yaml.safe_dump(params))
    done = predict(workdir, str(image))
    assert done.returncode == 2 and "sha256" in done.stderr.splitlines()[-1], done.stderr
    assert not list(workdir.glob("*.csv")) and not list(workdir.glob(".*.tmp-*"))


def test_an_internal_error_has_its_own_exit_status(
    monkeypatch: pytest.MonkeyPatch, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug is exit 4 with its traceback and one line, never exit 1, which means "none classified"."""
    import serving.predict as predict_module

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(predict_module, "run", broken)
    monkeypatch.chdir(workdir)
    assert predict_module.main(["inbox"]) == predict_module.EXIT["internal error"] == 4
    said = capsys.readouterr().err
    assert "Traceback" in said and said.strip().splitlines()[-1].startswith(
        "[predict] internal error: RuntimeError: a bug (exit 4)"
    )
    assert predict_module.EXIT == {"all": 0, "none": 1, "bad arguments": 2, "some": 3, "internal error": 4}
