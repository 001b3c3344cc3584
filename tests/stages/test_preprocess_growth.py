"""Preprocess at the cost of what changed (issue 57): a grown dataset's old shards keep their bytes (hard links, not
copies), only new images are decoded, relabels and removals rewrite only the shards that held them, a killed run's
closed shards are reused, and every one of these equals a rebuild from nothing, byte for byte."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tasks import preprocess
from tasks.core.errors import StageError
from tasks.core.io import read_json, sha256_file
from tasks.core.params import PreprocessParams
from tests.helpers.folders import make_imagefolder
from tests.helpers.project import ROOT, env_with_venv

PARAMS = PreprocessParams(image_size=16, workers=1, shard_size=4, val_fraction=0.2, test_fraction=0.2)


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def shard_files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Each shard file's bytes and inode."""
    return {p.name: (p.read_bytes(), p.stat().st_ino) for p in sorted(root.glob("*.arrow"))}


def decoded(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    line = next(r.getMessage() for r in reversed(caplog.records) if r.getMessage().startswith("images: "))
    numbers = [int(n) for n in re.findall(r"(\d+)", line)]
    return {"decoded": numbers[0], "copied": numbers[1], "linked": numbers[2], "written_shards": numbers[4]}


def record_merge(repo: Path, dataset: Path, added: list[Path]) -> None:
    """What `make add-data INTO=` records in the dataset's .dvc file: the merge's images by sha256."""
    dvc_file = dataset.with_name(dataset.name + ".dvc")
    document = yaml.safe_load(dvc_file.read_text()) if dvc_file.is_file() else {"outs": [{"path": dataset.name}]}
    merges = document.setdefault("meta", {}).setdefault("merges", [])
    merges.append({"added": len(added), "images": sorted(sha256_file(p) for p in added)})
    dvc_file.write_text(yaml.safe_dump(document))


@pytest.fixture
def dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # the repository: history is read from .dvc files inside it
    (tmp_path / ".dvc").mkdir()
    return make_imagefolder(tmp_path / "data" / "photos", classes=3, per_class=16, seed=3)


def run(source: Path, out: Path, params: PreprocessParams = PARAMS) -> None:
    preprocess.run(params, seed=7, source=source, out_dir=out)


def test_growth_writes_new_shards_only_and_equals_a_rebuild(dataset: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    caplog.set_level(logging.INFO)
    out = tmp_path / "data" / "shards"
    run(dataset, out)
    before = shard_files(out)
    assert len(before) > 6  # several shards per split: the claim below is about more than one file
    new = make_imagefolder(tmp_path / "incoming", classes=3, per_class=3, seed=11)
    added = []
    for path in sorted(new.rglob("*.*")):
        target = dataset / path.relative_to(new).parent / f"new_{path.name}"
        shutil.copy(path, target)
        added.append(target)
    record_merge(tmp_path, dataset, added)
    run(dataset, out)
    assert decoded(caplog)["decoded"] == len(added)  # nothing decoded twice
    after = shard_files(out)
    for name, (data, inode) in before.items():
        assert after[name] == (data, inode), f"{name}: an old shard was rewritten (or copied) by a merge"
    manifest = read_json(out / "manifest.json")
    new_hashes = {sha256_file(p) for p in added}
    for info in manifest["splits"].values():
        for entry in info["shards"]:
            if entry["file"] not in before:
                assert entry["generation"] == 1, entry
    assert {f["sha256"] for f in manifest["files"]} >= new_hashes
    # a rebuild from nothing reads the same .dvc file: the same bytes
    run(dataset, tmp_path / "rebuild")
    assert tree(tmp_path / "rebuild") == tree(out)


def test_relabel_and_removal_rewrite_only_the_shards_that_held_them(
    dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    out = tmp_path / "data" / "shards"
    run(dataset, out)
    before = shard_files(out)
    manifest = read_json(out / "manifest.json")
    by_path = {f["path"]: f for f in manifest["files"]}
    moved, removed = "class_0/004.jpg", "class_2/007.png"
    holders = set()
    for split in manifest["splits"]:
        start = 0
        rows = sorted((f for f in manifest["files"] if f["split"] == split), key=lambda f: f["index"])
        for entry in manifest["splits"][split]["shards"]:
            members = {f["path"] for f in rows[start : start + entry["count"]]}
            start += entry["count"]
            if members & {moved, removed}:
                holders.add(entry["file"])
    assert by_path[moved]["split"] and len(holders) <= 2
    (dataset / "class_1" / "relabelled.jpg").write_bytes((dataset / moved).read_bytes())
    (dataset / moved).unlink()
    (dataset / removed).unlink()
    run(dataset, out)
    assert decoded(caplog)["decoded"] == 0
    after = shard_files(out)
    changed = {name for name in before if after.get(name) != before[name]}
    # the removal: the shard that held it (and its neighbour if that image was a cut); the relabel: the shard it
    # left (a holder too) and the one of its new class folder it joined, with the same neighbour rule
    assert holders <= changed and len(changed) <= len(holders) + 3, (sorted(holders), sorted(changed))
    assert len(before) - len(changed) >= len(before) - 5
    run(dataset, tmp_path / "rebuild")
    assert tree(tmp_path / "rebuild") == tree(out)


def test_another_spec_decodes_everything_again(dataset: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    caplog.set_level(logging.INFO)
    out = tmp_path / "shards"
    run(dataset, out)
    total = decoded(caplog)["decoded"]
    run(dataset, out, PARAMS.model_copy(update={"interpolation": "bicubic"}))
    again = decoded(caplog)
    assert (again["decoded"], again["copied"], again["linked"]) == (total, 0, 0)  # other pixels: nothing reused
    run(dataset, out, PARAMS.model_copy(update={"interpolation": "bicubic"}))
    assert decoded(caplog)["decoded"] == 0 and decoded(caplog)["linked"] == total


def test_a_killed_run_leaves_its_closed_shards_to_the_rerun(dataset: Path, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    caplog.set_level(logging.INFO)
    run(dataset, tmp_path / "clean")
    out = tmp_path / "data" / "shards"
    script = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
              "from tasks.images import shard_build\n"
              "close = shard_build.ShardBuilder._close\n"
              "def slow(self):\n    close(self)\n    time.sleep(0.05)\n"
              "shard_build.ShardBuilder._close = slow\n"
              "from tasks import preprocess\nfrom tasks.core.params import PreprocessParams\n"
              f"preprocess.run(PreprocessParams.model_validate_json({PARAMS.model_dump_json()!r}), seed=7, "
              f"source={str(dataset)!r}, out_dir={str(out)!r})\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env_with_venv(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip  # its decoders die with it (killpg)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if sum(len(list(t.glob("*.arrow"))) for t in out.parent.glob(".shards.tmp-*")) >= 4:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a decoder left behind, if the run ended first
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not out.exists()
    run(dataset, out)
    stats = decoded(caplog)
    assert stats["linked"] + stats["copied"] >= 4 and stats["decoded"] < 48
    assert tree(out) == tree(tmp_path / "clean")
    assert not list(out.parent.glob(".shards.*")), "the salvaged folder is removed once the rerun succeeds"


def test_too_little_space_is_refused_before_decoding(dataset: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from tasks.images import space

    monkeypatch.setattr(space, "free_space", lambda path: 50_000)
    monkeypatch.setattr(preprocess, "isolated_map", lambda *a, **k: pytest.fail("decoded before the space check"))
    with pytest.raises(StageError, match=r"shards: the shards need 1\.\d MB and 50\.0 KB is free there"):
        run(dataset, tmp_path / "shards", PARAMS.model_copy(update={"resize": "crop"}))
    assert not list(tmp_path.glob(".shards*")) and not (tmp_path / "shards").exists()
