"""McNemar's exact test: are two classifiers equal on the same images? One copy for every paired comparison of
the project (the gate's candidate against its baseline, tasks/release; the mirror check's fit with and without
mirror images, tasks/training).

Only the images the two disagree on count: b = right by the reference and wrong by the candidate (losses),
c = the reverse (gains). Under "equal", each of the b + c is a fair coin, so p = P(X >= b) for
X ~ Binomial(b + c, 1/2) (1 when b + c = 0).
"""

from __future__ import annotations

import numpy as np


def discordant(reference_right: np.ndarray, candidate_right: np.ndarray) -> tuple[int, int]:
    """(losses, gains) of two boolean arrays over the same images (True: classified right): the images the
    reference got right and the candidate wrong, and the images the candidate got right and the reference wrong."""
    reference, candidate = np.asarray(reference_right, dtype=bool), np.asarray(candidate_right, dtype=bool)
    return int(np.sum(reference & ~candidate)), int(np.sum(candidate & ~reference))


def mcnemar_p(losses: int, gains: int, *, two_sided: bool = False) -> float:
    """McNemar's exact test: P(X >= losses) for X ~ Binomial(losses + gains, 1/2), the chance that models equal
    on these images disagree at least this much against the candidate (two-sided: in either direction, which for
    a fair coin is 2 P(X >= max(losses, gains)), at most 1: scipy's binomtest to 1e-14)."""
    if losses + gains == 0:
        return 1.0
    # here: importing scipy costs every no-op repro; bdtrc(k - 1, n, 1/2) = P(X >= k), a ufunc (binomtest's
    # p-value without its half a millisecond of overhead, which a gate of 1,000 classes pays 2,000 times)
    from scipy.special import bdtrc

    k = max(losses, gains) if two_sided else losses
    if k == 0:
        return 1.0
    p = float(bdtrc(k - 1, losses + gains, 0.5))
    return min(1.0, 2 * p) if two_sided else p
