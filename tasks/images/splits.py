"""Content-hash splits and duplicate handling: (candidates, their sha256) -> what to decode, what to refuse.

A file's split is a function of its bytes and the seed alone, so adding files never moves an
existing one. Files with the same bytes form a group: one copy is kept (a fixed-test-folder copy
first, then a val folder's, then the first path), the others are quarantined as `duplicate`; a group whose copies sit
in different classes is quarantined whole as `conflicting_duplicate`, since its label is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.core.params import derive_seed
from tasks.images.validation import TEST_SOURCE, VAL_SOURCE, Candidate, Hashed


def split_of(
    file_sha256: str, seed: int, val_fraction: float, test_fraction: float, *, fixed: frozenset[str] = frozenset()
) -> str:
    """train/val/test from the file's hash and params.yaml's `seed` alone, for a file of the train (or only) folder:
    the one place the split's seed is derived (preprocess and the take-in's merge plan both call this).

    A uniform number u in [0, 1) drawn from (seed, hash): u < test_fraction is test, the next
    val_fraction is val, the rest train. A split that a folder fixes (`fixed`: a test folder, a val
    folder) gets none of these files: its range goes to train, so switching `data.test_source` on or
    off never moves an image in or out of val.
    """
    u = derive_seed(derive_seed(seed, "preprocess"), "split", file_sha256) / 2**63
    split = "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"
    return "train" if split in fixed else split


@dataclass
class Plan:
    """What pass 2 decodes (one representative per distinct content), and what is already decided."""

    decode: list[tuple[Candidate, str]] = field(default_factory=list)  # (representative, sha256 or "")
    copies: dict[str, list[Candidate]] = field(default_factory=dict)  # sha256 -> the other copies
    refused: list[dict[str, str]] = field(default_factory=list)  # quarantine entries
    duplicates: list[dict[str, object]] = field(default_factory=list)  # report, one entry per group


def _name(item: Candidate) -> str:
    return f"{item.root}:{item.path}"


def plan(candidates: list[Candidate], hashes: list[Hashed], class_names: tuple[str, ...]) -> Plan:
    out = Plan()
    groups: dict[str, list[Candidate]] = {}
    for item, hashed in zip(candidates, hashes, strict=True):
        if hashed.error:
            out.refused.append({**item.where(), "reason": "unreadable", "detail": hashed.error})
        elif hashed.size == 0:
            out.refused.append({**item.where(), "reason": "empty_file", "detail": "zero bytes"})
        elif not hashed.digest:  # a size no other file has: no copies possible, hashed when decoded
            out.decode.append((item, ""))
        else:
            groups.setdefault(hashed.digest, []).append(item)
    for digest, members in groups.items():
        members = sorted(members, key=lambda m: (m.root != TEST_SOURCE, m.root != VAL_SOURCE, m.root, m.path))
        if len(members) == 1:
            out.decode.append((members[0], digest))
            continue
        labels = sorted({m.label for m in members})
        report: dict[str, object] = {"sha256": digest, "files": [m.where() for m in members]}
        if len(labels) > 1:
            detail = f"same bytes in classes {', '.join(class_names[i] for i in labels)}: " + ", ".join(
                _name(m) for m in members
            )
            out.refused.extend({**m.where(), "reason": "conflicting_duplicate", "detail": detail} for m in members)
            out.duplicates.append({**report, "outcome": "conflicting_duplicate", "kept": None})
        else:
            out.decode.append((members[0], digest))
            out.copies[digest] = members[1:]
            out.duplicates.append({**report, "outcome": "kept_one", "kept": members[0].where()})
    out.decode.sort(key=lambda pair: (pair[0].root, pair[0].path))
    return out
