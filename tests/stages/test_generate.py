"""The generate stage: deterministic bytes for any worker count, layout, variety, atomicity, skip path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks import generate
from tasks.core.errors import StageError
from tasks.core.params import GenerateParams, Params
from tasks.images import synth

pytestmark = pytest.mark.fast  # unit-level: make test-fast

SMALL = GenerateParams(num_classes=4, images_per_class=12, min_side=32, max_side=96, workers=1)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gen") / "generated"
    result = generate.run(SMALL, seed=3, out_dir=out)
    assert result.num_images == 4 * 12
    assert result.class_names == synth.CLASS_NAMES[:4]
    assert result.out_dir == out
    return out


def test_class_names_are_unique_lowercase() -> None:
    assert len(synth.CLASS_NAMES) == 10
    assert len(set(synth.CLASS_NAMES)) == 10
    assert all(name.isalpha() and name.islower() for name in synth.CLASS_NAMES)


def test_layout_names_and_counts(dataset: Path) -> None:
    assert sorted(p.name for p in dataset.iterdir()) == sorted(synth.CLASS_NAMES[:4])
    for name in synth.CLASS_NAMES[:4]:
        files = sorted(p.name for p in (dataset / name).iterdir())
        assert [f.rsplit(".", 1)[0] for f in files] == [f"{name}_{i:05d}" for i in range(12)]
        assert {f.rsplit(".", 1)[1] for f in files} <= {"png", "jpg"}
    assert not list(dataset.parent.glob(".*tmp*"))


def test_same_bytes_for_any_worker_count(dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generate, "CHUNK", 5)  # several chunks, so both workers draw images
    parallel = generate.run(SMALL.model_copy(update={"workers": 2}), seed=3, out_dir=tmp_path / "a")
    assert tree(parallel.out_dir) == tree(dataset)
    other_seed = generate.run(SMALL, seed=4, out_dir=tmp_path / "b")
    assert tree(other_seed.out_dir) != tree(dataset)


def test_modes_formats_and_sizes_vary(dataset: Path) -> None:
    seen = set()
    widths, heights = [], []
    for path in dataset.rglob("*.*"):
        with Image.open(path) as img:
            expected_format = "PNG" if path.suffix == ".png" else "JPEG"
            assert img.format == expected_format
            assert img.mode in ("RGB", "L")
            seen.add((img.format, img.mode))
            widths.append(img.width)
            heights.append(img.height)
            assert not img.info.get("exif") and "date" not in str(img.info).lower()
    assert {fmt for fmt, _ in seen} == {"PNG", "JPEG"}
    assert {mode for _, mode in seen} == {"RGB", "L"}
    assert SMALL.min_side <= min(widths + heights) and max(widths + heights) <= SMALL.max_side
    assert len(set(widths)) > 10 and any(w != h for w, h in zip(widths, heights, strict=True))


def test_draw_is_rgb_and_deterministic() -> None:
    for k in range(len(synth.CLASS_NAMES)):
        a = synth.draw(k, np.random.default_rng(k), 40, 70)
        b = synth.draw(k, np.random.default_rng(k), 40, 70)
        assert a.mode == "RGB" and a.size == (40, 70)
        assert a.tobytes() == b.tobytes()
    with pytest.raises(ValueError):
        synth.draw(len(synth.CLASS_NAMES), np.random.default_rng(0), 32, 32)


def test_failure_midway_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_draw = synth.draw
    calls = []

    def flaky(class_index: int, rng: np.random.Generator, width: int, height: int) -> Image.Image:
        calls.append(class_index)
        if len(calls) == 20:
            raise RuntimeError("boom")
        return real_draw(class_index, rng, width, height)

    monkeypatch.setattr(synth, "draw", flaky)
    out = tmp_path / "generated"
    with pytest.raises(RuntimeError, match="boom"):
        generate.run(SMALL, seed=0, out_dir=out)
    assert len(calls) == 20
    assert list(tmp_path.iterdir()) == []


def test_failure_keeps_previous_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "generated"
    small = SMALL.model_copy(update={"images_per_class": 2})
    generate.run(small, seed=0, out_dir=out)
    before = tree(out)
    monkeypatch.setattr(synth, "draw", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        generate.run(small, seed=1, out_dir=out)
    assert tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["generated"]


def test_skip_when_data_source_is_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    generated = tmp_path / "data" / "generated"
    generated.mkdir(parents=True)
    (generated / "stale.png").write_bytes(b"old")
    for name in ("cat", "dog"):  # the generate stage checks the folder before anything else
        (tmp_path / "mine" / name).mkdir(parents=True)
    params = Params().model_copy(
        update={
            "paths": Params().paths.model_copy(update={"generated": generated}),
            "data": Params().data.model_copy(update={"source": tmp_path / "mine", "test_source": generated}),
        }
    )
    monkeypatch.setattr(generate, "run", lambda *a, **k: pytest.fail("run() must not be called"))
    caplog.set_level("INFO")
    generate._main(params)
    assert [p.name for p in generated.iterdir()] == ["SKIPPED.txt"]
    assert str(tmp_path / "mine") in (generated / "SKIPPED.txt").read_text()
    assert "skipping generation" in caplog.text


def test_main_generates_when_source_is_the_default(tmp_path: Path) -> None:
    generated = tmp_path / "generated"
    params = Params().model_copy(
        update={
            "seed": 5,
            "paths": Params().paths.model_copy(update={"generated": generated}),
            "data": Params().data.model_copy(update={"source": generated, "test_source": generated}),
            "generate": SMALL.model_copy(update={"num_classes": 2, "images_per_class": 3}),
        }
    )
    generate._main(params)
    assert sorted(p.name for p in generated.iterdir()) == list(synth.CLASS_NAMES[:2])
    assert len(list(generated.rglob("*.*"))) == 6
    assert not (generated / "SKIPPED.txt").exists()


def test_refuses_to_replace_a_source_inside_the_generated_folder(tmp_path: Path) -> None:
    generated = tmp_path / "generated"
    (generated / "mine").mkdir(parents=True)
    params = Params().model_copy(
        update={
            "paths": Params().paths.model_copy(update={"generated": generated}),
            "data": Params().data.model_copy(update={"source": generated / "mine"}),
        }
    )
    with pytest.raises(StageError, match="inside"):
        generate._main(params)
    assert (generated / "mine").is_dir()
