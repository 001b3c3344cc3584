"""The label-error ranking's probabilities are the served ones (softmax of logits / T), its order the margin's."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.core.analysis import label_error_ranking


def _rank(logits: np.ndarray, labels: list[int], temperature: float) -> list[dict]:
    entries = [{"split": "val", "index": i, "label": label, "path": f"c/{i}.png", "root": "r", "sha256": f"{i:064x}"}
               for i, label in enumerate(labels)]  # fmt: skip
    return label_error_ranking(logits, entries, ("a", "b", "c"), {"r": "data"}, len(labels),
                               train_aum=np.zeros(0), train_p_given=np.zeros(0), times_trained=np.zeros(0, np.int64),
                               temperature=temperature)  # fmt: skip


def test_candidate_probabilities_are_on_the_served_scale_and_the_order_stays() -> None:
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(0, 3, (12, 3)), rng.integers(0, 3, 12).tolist()
    raw, served = _rank(logits, labels, 1.0), _rank(logits, labels, 2.5)
    assert [e["sha256"] for e in raw] == [e["sha256"] for e in served]  # the margin ranks, whatever T
    for entry in served:
        row = logits[int(entry["sha256"], 16)] / 2.5
        probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        given, suggested = ("a", "b", "c").index(entry["given"]), ("a", "b", "c").index(entry["suggested"])
        assert entry["p_given"] == pytest.approx(probs[given], abs=1e-4)
        assert entry["p_suggested"] == pytest.approx(probs[suggested], abs=1e-4)
        assert entry["p_predicted"] == pytest.approx(probs.max(), abs=1e-4)
    # T > 1 softens: the predicted class's probability falls for every image
    assert all(s["p_predicted"] < r["p_predicted"] for r, s in zip(raw, served, strict=True))
