"""A messy ImageFolder with every case users really have: each file ends accepted (right pixels),
quarantined (right reason) or ignored, the accounting balances, and the raw files are unchanged."""

from __future__ import annotations

import io
import logging
import os
import signal
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks import preprocess
from tasks.core.io import read_json
from tasks.core.params import PreprocessParams
from tasks.images.shards import ShardSplit
from tasks.images.workpool import isolated_map
from tests.helpers.folders import make_imagefolder

pytestmark = pytest.mark.fast  # unit-level: make test-fast

PARAMS = PreprocessParams(
    image_size=16, workers=2, shard_size=32, val_fraction=0.1, test_fraction=0.2, min_side=16, max_pixels=50_000
)
RED, GREEN, BLUE, WHITE = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)


def encode(img: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def png(width: int, height: int, bit_depth: int, color_type: int, raw: bytes) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(raw))
        + png_chunk(b"IEND", b"")
    )


def rgb16_png(value: tuple[int, int, int], side: int = 24) -> bytes:
    """16-bit-per-channel RGB PNG (Pillow cannot write one)."""
    row = b"\x00" + np.tile(np.array(value, dtype=">u2"), side).tobytes()
    return png(side, side, 16, 2, row * side)


def solid(mode: str, value: object, size: tuple[int, int] = (32, 32)) -> Image.Image:
    return Image.new(mode, size, value)  # type: ignore[arg-type]


def frames(fmt: str, colours: list[tuple[int, int, int]], **kwargs: object) -> bytes:
    images = [solid("RGB", c) for c in colours]
    return encode(images[0], fmt, save_all=True, append_images=images[1:], **kwargs)


def exif_rotated_jpeg() -> bytes:
    """40x20 stored, left half red, right half blue; orientation 6 means 'rotate 90° clockwise to view'."""
    img = solid("RGB", BLUE, (40, 20))
    img.paste(RED, (0, 0, 20, 20))
    exif = img.getexif()
    exif[0x0112] = 6
    return encode(img, "JPEG", quality=95, exif=exif.tobytes())


def palette_with_transparency() -> bytes:
    img = Image.new("P", (32, 32), 0)
    img.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    return encode(img, "PNG", transparency=0)


def cases() -> dict[str, tuple[bytes | None, str, object]]:
    """relative path -> (bytes, expected outcome, expected RGB or check). None bytes: made below."""
    jpeg = encode(solid("RGB", (200, 30, 40)), "JPEG", quality=95)
    noisy = encode(Image.fromarray(np.random.default_rng(3).integers(0, 255, (40, 40, 3), dtype=np.uint8)), "PNG")
    gray16 = Image.fromarray(np.full((24, 24), 40000, dtype=np.uint16))
    conflict = encode(solid("RGB", (1, 2, 3)), "PNG")
    dup = encode(solid("RGB", (9, 99, 199)), "PNG")
    return {
        # accepted, normalised to RGB uint8
        "class_0/mode_L.png": (encode(solid("L", 77), "PNG"), "accepted", (77, 77, 77)),
        "class_0/mode_1.png": (encode(solid("1", 1), "PNG"), "accepted", WHITE),
        "class_0/mode_LA_clear.png": (encode(solid("LA", (100, 0)), "PNG"), "accepted", WHITE),
        "class_0/mode_LA_opaque.png": (encode(solid("LA", (100, 255)), "PNG"), "accepted", (100, 100, 100)),
        "class_0/mode_RGB.jpg": (jpeg, "accepted", ("near", (200, 30, 40))),
        "class_0/mode_RGBA.png": (encode(solid("RGBA", (10, 20, 30, 255)), "PNG"), "accepted", (10, 20, 30)),
        "class_0/mode_RGBA_half.png": (encode(solid("RGBA", (0, 0, 0, 128)), "PNG"), "accepted", (127, 127, 127)),
        "class_0/mode_P_transparent.png": (palette_with_transparency(), "accepted", WHITE),
        "class_0/cmyk.tif": (encode(solid("CMYK", (0, 255, 0, 0)), "TIFF"), "accepted", (255, 0, 255)),
        "class_0/cmyk.jpg": (encode(solid("CMYK", (0, 255, 0, 0)), "JPEG", quality=95), "accepted",
                             ("near", (255, 0, 255))),
        "class_0/gray16.png": (encode(gray16, "PNG"), "accepted", (156, 156, 156)),  # 40000/257, not clipped to 255
        "class_0/gray16.tif": (encode(gray16, "TIFF"), "accepted", (156, 156, 156)),
        "class_0/gray16.pgm": (encode(gray16, "PPM"), "accepted", (156, 156, 156)),
        "class_0/rgb16.png": (rgb16_png((65535, 32768, 0)), "accepted", (255, 128, 0)),
        "class_0/exif_rotated.jpg": (exif_rotated_jpeg(), "accepted", "red_top_blue_bottom"),
        "class_0/animated.gif": (frames("GIF", [RED, GREEN, BLUE]), "accepted", RED),
        "class_0/animated.png": (frames("PNG", [BLUE, RED]), "accepted", BLUE),
        "class_0/multipage.tif": (frames("TIFF", [GREEN, RED]), "accepted", GREEN),
        "class_0/png_named.jpg": (encode(solid("RGB", (5, 6, 7)), "PNG"), "accepted", (5, 6, 7)),
        "class_1/sub/deep.png": (noisy, "accepted", None),
        "class_0/dup_a.png": (dup, "accepted", (9, 99, 199)),
        # quarantined, with a reason
        "class_0/sub/dup_b.png": (dup, "quarantined:duplicate", None),
        "class_0/conflict.png": (conflict, "quarantined:conflicting_duplicate", None),
        "class_1/conflict.png": (conflict, "quarantined:conflicting_duplicate", None),
        "class_1/empty.jpg": (b"", "quarantined:empty_file", None),
        "class_1/text.png": (b"hello, I am not a PNG\n", "quarantined:not_an_image", None),
        "class_1/truncated.jpg": (noisy_jpeg()[:600], "quarantined:truncated", None),
        "class_1/truncated_copy.jpg": (noisy_jpeg()[:600], "quarantined:truncated", None),
        "class_1/truncated.png": (noisy[: len(noisy) // 2], "quarantined:truncated", None),
        "class_1/bomb.png": (png(50_000, 50_000, 8, 0, b"\x00" * 64), "quarantined:decompression_bomb", None),
        "class_1/too_many_pixels.png": (encode(solid("RGB", RED, (300, 200)), "PNG"),
                                        "quarantined:decompression_bomb", None),
        "class_1/tiny.png": (encode(solid("RGB", RED, (10, 30)), "PNG"), "quarantined:too_small", None),
        # ignored, counted
        ".DS_Store": (b"\x00\x00\x00\x01Bud1", "ignored:hidden", None),
        "README.md": (b"# my images\n", "ignored:outside_class_folder", None),
        "class_0/.DS_Store": (b"\x00\x00\x00\x01Bud1", "ignored:hidden", None),
        "class_0/Thumbs.db": (b"\xd0\xcf\x11\xe0", "ignored:not_image_name", None),
        "class_1/notes.txt": (b"shot on a phone\n", "ignored:not_image_name", None),
        "class_0/.hidden.jpg": (jpeg, "ignored:hidden", None),
        "class_1/.thumbnails/t.png": (dup, "ignored:hidden", None),
    }  # fmt: skip


def noisy_jpeg() -> bytes:
    pixels = np.random.default_rng(4).integers(0, 255, (48, 48, 3), dtype=np.uint8)
    return encode(Image.fromarray(pixels), "JPEG", quality=90)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def messy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict, object]:
    root = tmp_path_factory.mktemp("messy")
    data = make_imagefolder(root / "data", classes=2, per_class=30, seed=11)  # enough for every split
    table = cases()
    for rel, (content, _, _) in table.items():
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(content)
    before = tree_bytes(data)
    result = preprocess.run(PARAMS, seed=3, source=data, out_dir=root / "shards")
    assert tree_bytes(data) == before, "the raw data was modified"
    return data, root / "shards", table, result


def outcome_of(report: dict, manifest: dict) -> dict[str, str]:
    out = {f["path"]: "accepted" for f in manifest["files"]}
    out |= {q["path"]: f"quarantined:{q['reason']}" for q in report["quarantined"]}
    out |= {i["path"]: f"ignored:{i['reason']}" for i in report["ignored"]}
    return out


def test_every_file_has_the_expected_outcome(messy: tuple) -> None:
    data, shards, table, result = messy
    report, manifest = read_json(shards / "quarantine.json"), read_json(shards / "manifest.json")
    outcomes = outcome_of(report, manifest)
    assert {rel: outcomes[rel] for rel in table} == {rel: expected for rel, (_, expected, _) in table.items()}
    # Every file on disk is accounted for exactly once, and the counts balance.
    assert sorted(outcomes) == sorted(tree_bytes(data))
    counts = report["counts"]
    assert counts == manifest["counts"] == result.counts
    assert counts["seen"] == len(tree_bytes(data)) == counts["accepted"] + counts["quarantined"] + counts["ignored"]
    assert counts["accepted"] == 60 + sum(1 for _, e, _ in table.values() if e == "accepted")
    assert all(q["detail"] and q["root"] == "source" for q in report["quarantined"])
    assert "same bytes as source:class_1/truncated.jpg" in next(
        q["detail"] for q in report["quarantined"] if q["path"] == "class_1/truncated_copy.jpg"
    )
    assert str(data) not in (shards / "quarantine.json").read_text()


def test_accepted_files_are_normalised_to_rgb(messy: tuple) -> None:
    _, shards, table, _ = messy
    manifest = read_json(shards / "manifest.json")
    where = {f["path"]: (f["split"], f["index"]) for f in manifest["files"]}
    splits = {name: ShardSplit.open(shards, name) for name in ("train", "val", "test")}
    for rel, (_, outcome, expected) in table.items():
        if outcome != "accepted" or expected is None:
            continue
        split, index = where[rel]
        image = splits[split].image(index).astype(int)  # (3, 16, 16)
        assert image.shape == (3, 16, 16)
        if expected == "red_top_blue_bottom":  # EXIF orientation applied: the red left half is now on top
            assert image[:, 2, 8].tolist() == pytest.approx(list(RED), abs=12), rel
            assert image[:, 13, 8].tolist() == pytest.approx(list(BLUE), abs=12), rel
        elif isinstance(expected, tuple) and expected[0] == "near":  # lossy JPEG
            assert image[:, 8, 8].tolist() == pytest.approx(list(expected[1]), abs=6), rel
        else:
            assert (image == np.array(expected)[:, None, None]).all(), (rel, image[:, 8, 8].tolist(), expected)


def test_duplicates_are_reported_and_kept_once(messy: tuple) -> None:
    _, shards, _, _ = messy
    report = read_json(shards / "quarantine.json")
    groups = {tuple(f["path"] for f in g["files"]): g for g in report["duplicates"]}
    kept = groups[("class_0/dup_a.png", "class_0/sub/dup_b.png")]
    assert kept["outcome"] == "kept_one" and kept["kept"]["path"] == "class_0/dup_a.png"
    conflict = groups[("class_0/conflict.png", "class_1/conflict.png")]
    assert conflict["outcome"] == "conflicting_duplicate" and conflict["kept"] is None
    hashes = [f["sha256"] for f in read_json(shards / "manifest.json")["files"]]
    assert len(hashes) == len(set(hashes)), "the same bytes are in the shards twice"


def test_summary_line_per_reason(messy: tuple, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    data = messy[0]
    with caplog.at_level(logging.INFO, logger="tasks"):
        preprocess.run(PARAMS.model_copy(update={"workers": 1}), seed=3, source=data, out_dir=tmp_path / "again")
    assert "quarantined 3 file(s): truncated" in caplog.text
    assert "quarantined 2 file(s): decompression_bomb" in caplog.text
    assert "ignored 4 file(s): hidden" in caplog.text
    # One worker or two: the same bytes.
    assert tree_bytes(tmp_path / "again") == tree_bytes(messy[1])


def test_limits_are_params(messy: tuple, tmp_path: Path) -> None:
    data = messy[0]
    loose = PARAMS.model_copy(update={"max_pixels": 10**6, "min_side": 8})
    preprocess.run(loose, seed=3, source=data, out_dir=tmp_path / "loose")
    outcomes = outcome_of(
        read_json(tmp_path / "loose" / "quarantine.json"), read_json(tmp_path / "loose" / "manifest.json")
    )
    assert outcomes["class_1/too_many_pixels.png"] == "accepted"
    assert outcomes["class_1/tiny.png"] == "accepted"
    assert outcomes["class_1/bomb.png"] == "quarantined:decompression_bomb"  # 2.5 gigapixels, never decoded


def _die_on_seven(item: int) -> int:
    if item == 7:
        os.kill(os.getpid(), signal.SIGKILL)  # what a segfaulting decoder looks like from outside
    return item * 10


def test_a_dying_worker_costs_one_item_not_the_run() -> None:
    results = list(isolated_map(_die_on_seven, list(range(20)), workers=2, chunksize=3, crashed=lambda i, why: -i))
    assert results == [-7 if i == 7 else i * 10 for i in range(20)]
