"""How pixels could be stored in the Arrow shards (issue 57, part 3): raw uint8, as the project does now, against
compressed images in a binary column. Prints one markdown table per image size; asserts nothing.

Images: `--count` photo-like JPEGs of 500 x 375 (bench/photos.py), made into (3, S, S) uint8 arrays by the
project's own function (tasks.images.imaging.load_array: DCT-scaled decode, crop), at S = 64 and 224. Each mode
writes the arrays to one Arrow IPC file in a temporary directory:
- raw: `image: fixed_size_list<uint8>[3*S*S]` (tasks/images/shards.py's schema), memory-mapped, rows gathered
  by tasks.images.shards.ShardSplit.take;
- jpeg / png / webp: `image: binary` (Pillow's encoder), memory-mapped, each row decoded on read by Pillow
  (HWC -> CHW) or by torchvision.io.decode_image (CHW), both shown.
Per mode: bytes per image (the Arrow file's size / images), encode + write images/s, a loader pass on one core
(torch threads 1, DataLoader batch 64, num_workers 0, shuffled; decode to uint8 (3, S, S), then the training
augmentation, tasks.training.augment.Augment, for the default recipe (reflect-pad crop + flip) and for
random-resized-crop + flip, as bench/bench_data.py builds them; normalisation is the step's and not counted),
and the mean / max absolute pixel error of the Pillow decode against raw (0-255 scale). Then a resnet18 step
(forward + backward + SGD, batch 32, the precision and memory format the train stage resolves here) on 1 and
2 threads, so that "loader cores per training core" says whether decoding could be the bottleneck.
Accuracy is not measured (no model is trained): the pixel error stands in for it.

    .venv/bin/python -m bench.bench_storage [--count 400] [--sizes 64 224] [--repeats 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import PIL
import pyarrow as pa
import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_image

from bench.bench_data import best_rate
from bench.photos import make_photos
from tasks.core.params import AugmentParams
from tasks.images.imaging import PreprocessSpec, load_array
from tasks.images.shards import BATCH_BYTES, ShardSplit, shard_schema
from tasks.training.augment import Augment
from tasks.training.models import build_model
from tasks.training.precision import resolve_precision

BATCH = 64  # the loader's batch, as bench_data
TRAIN_BATCH = 32
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Mode:
    name: str
    format: str | None  # Pillow's format name; None: raw uint8
    options: dict = field(default_factory=dict)


MODES = (
    Mode("raw uint8 (now)", None),
    Mode("jpeg q90 4:2:0", "JPEG", {"quality": 90}),  # Pillow's default subsampling
    Mode("jpeg q90 4:4:4", "JPEG", {"quality": 90, "subsampling": 0}),
    Mode("jpeg q95 4:2:0", "JPEG", {"quality": 95}),
    Mode("jpeg q95 4:4:4", "JPEG", {"quality": 95, "subsampling": 0}),
    Mode("png (level 6)", "PNG", {"compress_level": 6}),  # Pillow's default level
    Mode("webp q90 (4:2:0)", "WEBP", {"quality": 90}),
    Mode("webp lossless", "WEBP", {"lossless": True}),
)


def preprocess(photos: Path, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every photo as the model's input, (N, 3, S, S) uint8, and its label (class folder index)."""
    classes = sorted(p.name for p in photos.iterdir() if p.is_dir())
    spec = PreprocessSpec(image_size=size, resize="crop", decode="dct_scaled", mean=MEAN, std=STD,
                          class_names=tuple(classes))  # fmt: skip
    files = [(path, label) for label, name in enumerate(classes) for path in sorted((photos / name).iterdir())]
    images = np.stack([load_array(path.read_bytes(), spec) for path, _ in files])
    return images, np.array([label for _, label in files], dtype=np.int16)


def encode(image: np.ndarray, mode: Mode) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0))).save(out, mode.format, **mode.options)
    return out.getvalue()


def write(path: Path, images: np.ndarray, labels: np.ndarray, mode: Mode) -> None:
    """One Arrow IPC file in record batches of about BATCH_BYTES of pixels, as tasks/images/shards.py writes."""
    size = images.shape[-1]
    rows = max(1, BATCH_BYTES // (3 * size * size))
    if mode.format is None:
        schema = shard_schema(size)
    else:
        schema = pa.schema([pa.field("image", pa.binary()), pa.field("label", pa.int16())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for start in range(0, len(images), rows):
            block, block_labels = images[start : start + rows], pa.array(labels[start : start + rows], pa.int16())
            if mode.format is None:
                flat = pa.array(np.ascontiguousarray(block).reshape(-1), type=pa.uint8())
                column = pa.FixedSizeListArray.from_arrays(flat, 3 * size * size)
            else:
                column = pa.array([encode(image, mode) for image in block], type=pa.binary())
            writer.write_batch(pa.RecordBatch.from_arrays([column, block_labels], schema=schema))


class Stored(Dataset):
    """One stored file, memory-mapped; `__getitems__` as tasks.training.dataset.ShardDataset's: one gather (raw)
    or one decode per row, then one batched augmentation."""

    def __init__(self, path: Path, size: int, *, encoded: bool, decoder: str = "pil", augment: Augment | None = None):
        self.size, self.encoded, self.decoder, self.augment = size, encoded, decoder, augment
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        self.labels = np.concatenate([b.column(1).to_numpy() for b in batches]).astype(np.int64)
        if encoded:  # (data buffer, row offsets) per record batch: a row is a zero-copy slice of the map
            self.blocks = []
            for b in batches:
                column = b.column(0)
                _, offsets, data = column.buffers()
                offsets = np.frombuffer(offsets, np.int32)[column.offset : column.offset + len(column) + 1]
                with warnings.catch_warnings():  # the map is read-only, and so is every decode's input
                    warnings.simplefilter("ignore", UserWarning)
                    tensor = torch.frombuffer(memoryview(data), dtype=torch.uint8)
                self.blocks.append((memoryview(data), tensor, offsets))
            self.offsets = np.cumsum([0, *(len(b) for b in batches)])
        else:
            views = [b.column(0).flatten().to_numpy(zero_copy_only=True).reshape(-1, 3, size, size) for b in batches]
            self.split = ShardSplit(images=views, labels=self.labels, class_names=(),
                                    offsets=np.cumsum([0, *(len(v) for v in views)]))  # fmt: skip

    def __len__(self) -> int:
        return len(self.labels)

    def decode(self, index: int) -> torch.Tensor:
        block = int(np.searchsorted(self.offsets, index, side="right")) - 1
        view, tensor, offsets = self.blocks[block]
        row = index - self.offsets[block]
        start, stop = int(offsets[row]), int(offsets[row + 1])
        if self.decoder == "torchvision":
            return decode_image(tensor[start:stop], mode=ImageReadMode.RGB)
        with Image.open(io.BytesIO(view[start:stop])) as image:
            return torch.from_numpy(np.array(image if image.mode == "RGB" else image.convert("RGB"))).permute(2, 0, 1)

    def take(self, indices: Sequence[int]) -> torch.Tensor:
        if not self.encoded:
            return torch.from_numpy(self.split.take(indices))
        return torch.stack([self.decode(int(i)) for i in indices])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        images = self.take(indices)
        if self.augment is not None:
            images = self.augment.batch(images, [(42, 0, int(i)) for i in indices])
        return list(zip(images.unbind(0), self.labels[list(indices)].tolist(), strict=True))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([index])[0]


def loader_rate(dataset: Stored, repeats: int) -> float:
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip

    def one_pass() -> int:
        count = 0
        for images, _ in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, dataset.size, dataset.size)
            count += len(images)
        return count

    return best_rate(one_pass, repeats)


def pixel_error(dataset: Stored, raw: np.ndarray) -> tuple[float, int]:
    total, worst = 0.0, 0
    for i in range(len(dataset)):
        diff = np.abs(dataset.decode(i).numpy().astype(np.int16) - raw[i].astype(np.int16))
        total += float(diff.mean())
        worst = max(worst, int(diff.max()))
    return total / len(dataset), worst


def train_rate(size: int, threads: int, steps: int, arch: str = "resnet18") -> tuple[float, str]:
    """img/s of a bare `arch` step (forward, loss, backward, SGD step) on one synthetic batch, after 1 warm-up, in the
    precision and memory format the train stage would use for it."""
    torch.set_num_threads(threads)
    built = build_model(arch, 10).train()
    precision = resolve_precision("auto", torch.device("cpu"), "auto", model=built)
    model = precision.place(built)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = precision.place(torch.randn(TRAIN_BATCH, 3, size, size))
    y = torch.randint(0, 10, (TRAIN_BATCH,))

    def step() -> int:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return TRAIN_BATCH

    step()
    start = time.perf_counter()
    count = sum(step() for _ in range(steps))
    return count / (time.perf_counter() - start), f"{precision.name}, {precision.memory_format}"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_size(photos: Path, size: int, scratch: Path, repeats: int, steps: int) -> None:
    images, labels = preprocess(photos, size)
    count = len(images)
    pad = Augment(AugmentParams(hflip=True))  # the default recipe (reflect-pad crop) with the flip, as bench_data
    rrc = Augment(AugmentParams(crop="random_resized", hflip=True))
    torch.set_num_threads(1)
    rows = []
    for number, mode in enumerate(MODES):
        path = scratch / f"{size}-{number}.arrow"
        write(scratch / "warm-up.arrow", images[:8], labels[:8], mode)  # first-call costs out of the timing
        seconds = timed(lambda mode=mode, path=path: write(path, images, labels, mode))
        encoded = mode.format is not None
        rates = {}
        for decoder in ("pil", "torchvision") if encoded else ("raw",):
            for name, augment in (("pad", pad), ("rrc", rrc)):
                dataset = Stored(path, size, encoded=encoded, decoder=decoder, augment=augment)
                rates[decoder, name] = loader_rate(dataset, repeats)
        error = pixel_error(Stored(path, size, encoded=True), images) if encoded else (0.0, 0)
        rows.append((mode, path.stat().st_size / count, count / seconds, rates, error))
        print(f"  {size}px {mode.name}: done", file=sys.stderr, flush=True)

    train = {threads: train_rate(size, threads, steps) for threads in (1, 2)}
    torch.set_num_threads(1)
    raw_bytes = rows[0][1]
    print(f"\n### {size} x {size} px, {count} images (photos 500x375 -> load_array, dct_scaled, crop)\n")
    print("| mode | bytes/image | vs raw | encode+write img/s | default aug img/s (PIL / tv.io) "
          "| RRC+flip img/s (PIL / tv.io) | loader cores per train core | mean abs err | max abs err |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, per_image, write_rate, rates, (mean_err, max_err) in rows:
        if mode.format is None:
            pad_cell, rrc_cell = f"{rates['raw', 'pad']:,.0f}", f"{rates['raw', 'rrc']:,.0f}"
            fastest = rates["raw", "pad"]
        else:
            pad_cell = f"{rates['pil', 'pad']:,.0f} / {rates['torchvision', 'pad']:,.0f}"
            rrc_cell = f"{rates['pil', 'rrc']:,.0f} / {rates['torchvision', 'rrc']:,.0f}"
            fastest = max(rates["pil", "pad"], rates["torchvision", "pad"])
        share = train[1][0] / fastest
        print(f"| {mode.name} | {per_image:,.0f} | {per_image / raw_bytes:.3f} | {write_rate:,.0f} | {pad_cell} "
              f"| {rrc_cell} | {share:.3f} | {mean_err:.2f} | {max_err} |")  # fmt: skip
    for threads, (rate, how) in train.items():
        print(f"\nresnet18 train step, batch {TRAIN_BATCH}, {how}, {threads} thread{'s' * (threads > 1)}: "
              f"{rate:.1f} img/s", end="")  # fmt: skip
    print(
        "\n\nloader cores per train core = train img/s on 1 thread / default-aug loader img/s on 1 core "
        "(faster decoder): the share of a core that feeds one training core; below 1, decoding is not the bottleneck."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=400, help="photos to make (500 x 375 JPEGs, 10 classes)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224], help="model input sides")
    parser.add_argument("--repeats", type=int, default=2, help="loader passes per measurement; the best is kept")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps after one warm-up")
    args = parser.parse_args()

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_storage_") as tmp:
        scratch = Path(tmp)
        photos = make_photos(scratch / "photos", args.count)
        for size in args.sizes:
            bench_size(photos, size, scratch, args.repeats, args.steps)
    load = os.getloadavg()
    print(
        f"\nmachine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; torch "
        f"{torch.__version__}, torchvision {torchvision.__version__}, Pillow {PIL.__version__}, pyarrow "
        f"{pa.__version__}; accuracy not measured (no model trained); {time.perf_counter() - started:.0f} s"
    )
    print(f"command: .venv/bin/python -m bench.bench_storage {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
