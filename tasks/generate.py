"""Generate stage: GenerateParams + seed -> the embedded default ImageFolder at paths.generated.

out_dir/<class>/<class>_<index:05d>.png|.jpg, drawn by tasks.images.synth; every image depends only on
(seed, class, index), so the bytes are the same for any worker count.
"""

from __future__ import annotations

import io
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tasks.core.cli import stage_main
from tasks.core.errors import StageError
from tasks.core.io import atomic_dir
from tasks.core.params import GenerateParams, Params, derive_seed
from tasks.images import synth
from tasks.images.layout import check_data_folders
from tasks.images.validation import unversioned_source

log = logging.getLogger(__name__)

JPEG_QUALITY = (70, 95)
CHUNK = 50  # images per worker task: large enough to amortise IPC, small enough for the bar


@dataclass(frozen=True)
class GenerateResult:
    num_images: int
    class_names: tuple[str, ...]
    out_dir: Path


def render(params: GenerateParams, seed: int, class_index: int, index: int) -> tuple[str, bytes]:
    """One image: its path relative to the dataset root and its encoded bytes."""
    name = synth.CLASS_NAMES[class_index]
    rng = np.random.default_rng(derive_seed(seed, "generate", name, index))
    width = int(rng.integers(params.min_side, params.max_side + 1))
    height = int(rng.integers(params.min_side, params.max_side + 1))
    grayscale = rng.random() < params.grayscale_fraction
    png = rng.random() < params.png_fraction
    quality = int(rng.integers(JPEG_QUALITY[0], JPEG_QUALITY[1] + 1))
    img = synth.draw(class_index, rng, width, height)
    if grayscale:
        img = img.convert("L")
    buffer = io.BytesIO()
    # No metadata is passed, so the encoders write no timestamps and the bytes are reproducible.
    # zlib level 3 encodes grainy images ~3x faster than the default 6 for ~10% larger files.
    if png:
        img.save(buffer, "PNG", compress_level=3)
    else:
        img.save(buffer, "JPEG", quality=quality)
    return f"{name}/{name}_{index:05d}.{'png' if png else 'jpg'}", buffer.getvalue()


def _write_chunk(params: GenerateParams, seed: int, root: Path, jobs: list[tuple[int, int]]) -> int:
    for class_index, index in jobs:
        relative, data = render(params, seed, class_index, index)
        (root / relative).write_bytes(data)
    return len(jobs)


def run(params: GenerateParams, *, seed: int, out_dir: Path) -> GenerateResult:
    """Draw num_classes x images_per_class images into out_dir, replacing it atomically."""
    names = synth.CLASS_NAMES[: params.num_classes]
    jobs = [(c, i) for c in range(len(names)) for i in range(params.images_per_class)]
    chunks = [jobs[start : start + CHUNK] for start in range(0, len(jobs), CHUNK)]
    with atomic_dir(Path(out_dir)) as tmp, tqdm(total=len(jobs), desc="generate", unit="img") as bar:
        for name in names:
            (tmp / name).mkdir()
        if params.workers == 1:
            for chunk in chunks:
                bar.update(_write_chunk(params, seed, tmp, chunk))
        else:
            with ProcessPoolExecutor(params.workers) as pool:
                futures = [pool.submit(_write_chunk, params, seed, tmp, chunk) for chunk in chunks]
                try:
                    for future in futures:
                        bar.update(future.result())
                except BaseException:
                    for future in futures:  # fail fast instead of drawing the rest first
                        future.cancel()
                    raise
    return GenerateResult(num_images=len(jobs), class_names=names, out_dir=Path(out_dir))


def _main(params: Params) -> None:
    """Generate the default dataset, or only a SKIPPED.txt marker when data.source is elsewhere."""
    source, generated = params.data.source, params.paths.generated
    if generated.resolve() in source.resolve().parents:
        raise StageError(f"data.source ({source}) lies inside paths.generated ({generated})")
    check_data_folders(params.data, generated)  # the first stage: a mistyped folder stops the run here
    warning = unversioned_source(params.data, generated)
    if warning:
        log.warning("%s", warning)
    if source.resolve() != generated.resolve():
        log.info("using your data at %s; skipping generation", source)
        # DVC needs the declared output to exist, so leave a marker saying which data is used.
        with atomic_dir(generated) as tmp:
            (tmp / "SKIPPED.txt").write_text(f"Generation skipped: data.source is {source}, not {generated}.\n")
        return
    start = time.perf_counter()
    result = run(params.generate, seed=params.seed, out_dir=generated)
    seconds = time.perf_counter() - start
    log.info("%d images, %d classes -> %s in %.1f s", result.num_images, len(result.class_names), generated, seconds)


def main() -> None:
    stage_main("generate", _main)


if __name__ == "__main__":
    main()
