"""Aspect ratios of a folder's images -> a summary a user can read, and `preprocess.resize: auto`'s choice.

A centre crop keeps 1/r of an image whose longer side is r times its shorter one: all of a square image,
half of a 2:1 one. When nearly every image is close to square, crop loses little and keeps the subject at
full scale; otherwise it cuts off what lies off-centre, and squash keeps every pixel of every image.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NEAR_SQUARE = 4 / 3  # a crop keeps at least 75% of an image within this ratio
CROP_SHARE = 0.9  # auto crops when at least this share of the images is near square


@dataclass(frozen=True)
class Aspect:
    count: int
    wide: int  # width / height above NEAR_SQUARE
    tall: int  # height / width above NEAR_SQUARE
    median: float  # of longer side / shorter side
    p90: float
    max: float

    @property
    def near_square(self) -> int:
        return self.count - self.wide - self.tall

    @classmethod
    def of(cls, shapes: Sequence[tuple[int, int]]) -> Aspect:
        """`shapes`: (width, height) per image."""
        if not shapes:
            return cls(0, 0, 0, 1.0, 1.0, 1.0)
        sides = np.asarray(shapes, dtype=np.float64)
        ratio = sides.max(axis=1) / sides.min(axis=1)
        width_over_height = sides[:, 0] / sides[:, 1]
        return cls(
            count=len(sides),
            wide=int((width_over_height > NEAR_SQUARE).sum()),
            tall=int((1 / width_over_height > NEAR_SQUARE).sum()),
            median=round(float(np.median(ratio)), 3),
            p90=round(float(np.quantile(ratio, 0.9)), 3),
            max=round(float(ratio.max()), 3),
        )

    def summary(self) -> str:
        """e.g. "1800 images: 61% near square (within 4:3), 20% wide, 19% tall; longer/shorter side median 1.4,
        90th percentile 3.1, max 6"."""
        if not self.count:
            return "no images measured"
        share = lambda n: f"{100 * n / self.count:.0f}%"  # noqa: E731
        return (
            f"{self.count} images: {share(self.near_square)} near square (within 4:3), {share(self.wide)} wide, "
            f"{share(self.tall)} tall; longer/shorter side median {self.median:g}, 90th percentile {self.p90:g}, "
            f"max {self.max:g}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count, "near_square": self.near_square, "wide": self.wide, "tall": self.tall,
            "ratio_median": self.median, "ratio_p90": self.p90, "ratio_max": self.max, "summary": self.summary(),
        }  # fmt: skip


def choose_resize(aspect: Aspect) -> tuple[str, str]:
    """`preprocess.resize: auto` -> (mode, why)."""
    if not aspect.count or aspect.near_square >= CROP_SHARE * aspect.count:
        return "crop", (
            f"{aspect.near_square} of {aspect.count} images are within 4:3, so a centre crop keeps at least 75% "
            "of each and the subject at full scale"
        )
    off = aspect.count - aspect.near_square
    return "squash", (
        f"{off} of {aspect.count} images ({100 * off / aspect.count:.0f}%) are wider or taller than 4:3 (up to "
        f"{aspect.max:g}:1): a centre crop would keep as little as {100 / aspect.max:.0f}% of one and cut off what "
        "lies off-centre, squash keeps all of every image"
    )
