"""Growth at photo scale: the first preprocess of N photos, then N/100 more merged with `make add-data INTO=`.

For each N (default 4,000): a copy of the project as a git + DVC repository (tests/helpers/project.py), N
photo-like JPEGs of 500 x 375 (bench/photos.py) brought in with `make add-data NAME=photos`, preprocess at --size
(224: the pretrained backbones' input) by `dvc repro preprocess` (the environment stage it depends on included);
then N/100 new photos merged with `make add-data INTO=photos` and `dvc repro preprocess` again. Then a rebuild from
nothing (`rm -rf data/shards; dvc repro -f preprocess`) whose shards hash must equal the incremental run's.
Prints one table row per N: the times, the DVC cache's growth against the shard set, the storage per image, the
peak RSS of the preprocess run (the largest process DVC waited for), and whether the rebuild gave the same hash.

    .venv/bin/python -m bench.bench_growth [--counts 4000 16000 40000] [--size 224] [--keep DIR]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.photos import make_photos  # noqa: E402
from tests.helpers.project import env_with_venv, make_command, make_project  # noqa: E402


def du(path: Path) -> int:
    """Bytes of the files under `path`, each inode once (hard links share their bytes)."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def timed(command: list[str], cwd: Path) -> tuple[float, int]:
    """Wall seconds, and the peak RSS (MB) of the largest process it waited for."""
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, env=env_with_venv(), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024


def shards_hash(repo: Path) -> str:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return next(o["md5"] for o in lock["stages"]["preprocess"]["outs"] if o["path"] == "data/shards")


def one(n: int, size: int, work: Path) -> dict[str, object]:
    repo = make_project(work / f"project-{n}", {"preprocess": {"image_size": size, "workers": 2}})
    photos, more = make_photos(work / f"photos-{n}", n), make_photos(work / f"more-{n}", n // 100, start=n)
    raw = du(photos)
    timed(make_command("add-data", f"SRC={photos}", "NAME=photos"), repo)
    dvc = [sys.executable, "-m", "dvc"]
    first, rss_first = timed([*dvc, "repro", "preprocess"], repo)
    cache_before, shards = du(repo / ".dvc/cache"), du(repo / "data/shards")
    timed(make_command("add-data", f"SRC={more}", "INTO=photos"), repo)
    cache_merged = du(repo / ".dvc/cache")
    second, rss_second = timed([*dvc, "repro", "preprocess"], repo)
    grown = du(repo / ".dvc/cache") - cache_merged
    incremental = shards_hash(repo)
    shutil.rmtree(repo / "data/shards")
    rebuild, _ = timed([*dvc, "repro", "-f", "preprocess"], repo)
    return {
        "images": n, "added": n // 100, "first_s": first, "second_s": second, "ratio": second / first,
        "rebuild_s": rebuild, "cache_growth_mb": grown / 1e6, "shards_mb": shards / 1e6,
        "growth_share": grown / shards, "raw_kb": raw / n / 1e3, "shard_kb": shards / n / 1e3,
        "cache_first_mb": cache_before / 1e6, "rss_mb": max(rss_first, rss_second),
        "same_hash": incremental == shards_hash(repo),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[4000])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="growth-"))
    rows = [one(n, args.size, work) for n in args.counts]
    print(f"photos 500x375 JPEG q90 at {args.size} px; +1% merged with make add-data INTO=")
    print(
        "| images | first preprocess | +1% preprocess | ratio | rebuild | same hash | cache growth / shard set "
        "| raw per image | shards per image | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        growth = f"{r['cache_growth_mb']:.1f} MB / {r['shards_mb']:.0f} MB ({100 * r['growth_share']:.1f}%)"
        print(f"| {r['images']:,} | {r['first_s']:.1f} s | {r['second_s']:.1f} s | {r['ratio']:.2f} | "
              f"{r['rebuild_s']:.1f} s | {r['same_hash']} | {growth} | {r['raw_kb']:.0f} KB | {r['shard_kb']:.0f} KB "
              f"| {r['rss_mb']} MB |")  # fmt: skip
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
