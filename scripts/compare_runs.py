"""Two checkouts' pipeline outputs, compared file by file: images and shards by md5, model.pt tensor by
tensor, the JSON reports field by field, the ONNX graph and its metadata keys.

    .venv/bin/python scripts/compare_runs.py BEFORE_CHECKOUT AFTER_CHECKOUT

What a refactor must leave alone (issue 13 used it: everything identical but the ONNX `code_sha256`
and the hashes of the files that carry it). Prints; exits 0.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the project's packages

from tasks.core.nested import flatten  # noqa: E402

REPORTS = [
    *(f"reports/{name}.json" for name in ("metrics", "confusion", "train_history", "train_run", "export")),
    *(f"reports/{name}.json" for name in ("regression", "gate")),
    "data/shards/manifest.json",
]


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def diff(x: Any, y: Any) -> list[str]:
    a, b = flatten(x), flatten(y)
    return [f"{key}: {str(a.get(key, '<absent>'))[:70]} -> {str(b.get(key, '<absent>'))[:70]}"
            for key in sorted(set(a) | set(b)) if a.get(key, "<absent>") != b.get(key, "<absent>")]  # fmt: skip


def main(a: Path, b: Path) -> None:
    for folder in ("data/generated", "data/shards"):
        fa, fb = files(a / folder), files(b / folder)
        same = fa == fb and all(md5(a / folder / f) == md5(b / folder / f) for f in fa)
        print(f"{folder}: {len(fa)} files, byte-identical: {same}")
    ma = torch.load(a / "models/model.pt", weights_only=True)
    mb = torch.load(b / "models/model.pt", weights_only=True)
    sa, sb = ma["state_dict"], mb["state_dict"]
    print(
        "model.pt tensors:",
        len(sa),
        "identical:",
        sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa),
    )
    print("model.pt other keys equal:", {k: ma[k] == mb[k] for k in ma if k != "state_dict"})
    print("model.pt bytes identical:", md5(a / "models/model.pt") == md5(b / "models/model.pt"))
    for name in REPORTS:
        d = diff(json.loads((a / name).read_text()), json.loads((b / name).read_text()))
        print(f"{name}: {'identical' if not d else 'differs: ' + '; '.join(d)}")
    oa, ob = onnx.load(str(a / "models/model.onnx")), onnx.load(str(b / "models/model.onnx"))
    print("onnx graph identical:", oa.graph.SerializeToString() == ob.graph.SerializeToString())
    pa = {p.key: p.value for p in oa.metadata_props}
    pb = {p.key: p.value for p in ob.metadata_props}
    print("onnx metadata differing keys:", sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k)))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
