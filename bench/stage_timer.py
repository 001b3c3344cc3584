"""Time one run of the preprocess stage in a fresh interpreter, as `python -m tasks.preprocess` runs it.

bench_data imports torch and torchvision for its loader half; the stage does not (see
tests/stages/test_preprocess.py), and its decoders fork from its process, so it is timed here, apart.
Prints one JSON object: images per second of wall time, CPU of the stage's process and of its
decoders.

    .venv/bin/python -m bench.stage_timer --params '{"workers": 2}' --images DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from tasks import preprocess
from tasks.core.params import PreprocessParams


def cpu(before: resource.struct_rusage, after: resource.struct_rusage) -> float:
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", required=True, help="preprocess params as JSON")
    parser.add_argument("--images", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    params = PreprocessParams.model_validate_json(args.params)
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    seen = preprocess.run(params, seed=args.seed, source=args.images, out_dir=args.out).counts["seen"]
    wall = time.perf_counter() - start
    report = {
        "rate": seen / wall,
        "main_cpu": cpu(own, resource.getrusage(resource.RUSAGE_SELF)),
        "decoder_cpu": cpu(children, resource.getrusage(resource.RUSAGE_CHILDREN)),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
