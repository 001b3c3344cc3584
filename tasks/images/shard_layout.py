"""Where each accepted image goes: (split, generation, path) order, cut into shards at content-chosen places.

Within a split, images are grouped by generation (tasks/images/history.py: the merge that added them) and kept in
their folders' path order. A shard ends after an image whose sha256 falls in a 1/shard_size range (content-defined
chunking, as rsync and restic cut files), or when it reaches MAX_FACTOR x shard_size images. So adding images
writes new shards, a removal rewrites the shard that held the image (and its neighbour when that image was the
cut), and a relabel (a move to another class folder) the shard it left and the one it joined; the rest keep their
bytes. A shard's name is its split, generation and
first image, so an unchanged shard keeps its name too. Everything here is a function of the final accepted images,
their labels and their generations: a rebuild from scratch gives the same shards as a run that grew them.
"""

from __future__ import annotations

MAX_FACTOR = 4  # a run of images with no cut (probability e^-4 at this length) is cut by count
RULE = (
    "per split, by generation (the dataset .dvc file's meta.merges[k].images: generation k + 1; other images 0), "
    "then by path; a shard ends after an image whose sha256's first 16 hex digits are 0 mod preprocess.shard_size, "
    f"or at {MAX_FACTOR} x shard_size images"
)


def ends_shard(digest: str, shard_size: int) -> bool:
    """Does a shard end after the image with this sha256 (1 in shard_size images, by content)?"""
    return int(digest[:16], 16) % shard_size == 0


def shard_name(split: str, generation: int, first: str) -> str:
    return f"{split}-g{generation:04d}-{first[:16]}.arrow"


class Cutter:
    """Feeds accepted images in layout order; says when the open shard ends."""

    def __init__(self, shard_size: int) -> None:
        self.shard_size, self.cap = shard_size, MAX_FACTOR * shard_size
        self.group: tuple[str, int] | None = None
        self.count = 0

    def starts_new(self, split: str, generation: int) -> bool:
        """True when this image cannot join the open shard (another split or generation)."""
        if self.group != (split, generation):
            self.group, self.count = (split, generation), 0
            return True
        return False

    def add(self, digest: str) -> bool:
        """Count the image in; True when the shard ends after it."""
        self.count += 1
        if ends_shard(digest, self.shard_size) or self.count >= self.cap:
            self.count = 0
            return True
        return False
