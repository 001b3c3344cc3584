"""train.pretrained for timm's models (train.arch timm/<name>): the weights timm publishes for a pretrained tag
(`e2400_r224_in1k`, or DEFAULT: timm's default tag) on the Hugging Face hub, as a file DVC tracks.

The file is the hub's `model.safetensors` of the tag's repository (`timm/<name>.<tag>`), kept in paths.pretrained
as `<name>.<tag>-<sha256[:16]>.safetensors`: like torch hub's names it carries the start of its hash, so a file
that is not the one added is refused before it is loaded. `make add-weights ARCH=timm/<name> [WEIGHTS=<tag>]`
downloads it with huggingface_hub (its cache and revision; the hub stores each file as a blob named by its
sha256, which the download is checked against), or takes SRC=<a copy>; a second machine gets it with `dvc pull`.
The tag's mean, std and input size come from timm's pretrained config and are checked against the shards.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

from tasks.core.errors import StageError
from tasks.core.io import sha256_file
from tasks.core.params import TIMM_PREFIX

HUB_FILE = "model.safetensors"
PREFIX_LENGTH = 16
SHA256 = re.compile(r"[0-9a-f]{64}")


def tag_config(arch: str, tag: str) -> tuple[str, object]:
    """(the tag, resolved from DEFAULT) and timm's pretrained config for it; one line listing the valid tags."""
    import timm
    from timm.models import get_pretrained_cfg

    name = arch.removeprefix(TIMM_PREFIX)
    valid = [t.split(".", 1)[1] for t in timm.list_pretrained(f"{name}.*") if t.split(".", 1)[0] == name]
    default = get_pretrained_cfg(name)
    if tag == "DEFAULT" and default is not None and default.tag:
        tag = default.tag
    if tag not in valid:
        raise StageError(f"train.pretrained {tag!r}: timm publishes no such weights for {name}; valid: {valid}")
    cfg = get_pretrained_cfg(f"{name}.{tag}")
    if not cfg.hf_hub_id:
        raise StageError(f"train.pretrained {tag!r}: timm's {name}.{tag} is not on the Hugging Face hub; bring a copy "
                         f"with SRC=")  # fmt: skip
    return tag, cfg


def stem(arch: str, tag: str) -> str:
    return f"{arch.removeprefix(TIMM_PREFIX)}.{tag}-"


def weights_path(folder: Path, arch: str, tag: str) -> Path:
    """The tag's file in `folder` (or the one its .dvc file names, not pulled yet); a placeholder name when none is
    added."""
    pattern = glob.escape(str(Path(folder) / stem(arch, tag)))
    records = sorted(glob.glob(f"{pattern}*.safetensors.dvc"))
    found = sorted(glob.glob(f"{pattern}*.safetensors")) or [p.removesuffix(".dvc") for p in records]
    return Path(found[0]) if found else Path(folder) / f"{stem(arch, tag)}<sha256>.safetensors"


def named_file(folder: Path, arch: str, tag: str, sha256: str) -> Path:
    return Path(folder) / f"{stem(arch, tag)}{sha256[:PREFIX_LENGTH]}.safetensors"


def download(hub_id: str, revision: str | None) -> tuple[Path, str]:
    """The hub's file (huggingface_hub: from its cache when there, else downloaded) and the commit it is at,
    checked against the sha256 the hub names its blob by."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = Path(hf_hub_download(repo_id=hub_id, filename=HUB_FILE, revision=revision))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise StageError(f"{hub_id}/{HUB_FILE}: not downloaded ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                         "no internet here? then SRC=/path/to/model.safetensors") from None  # fmt: skip
    blob = Path(path).resolve().name
    if SHA256.fullmatch(blob) and sha256_file(path) != blob:
        raise StageError(f"{path}: its sha256 is not {blob[:16]}..., the hash the hub stores it under (a damaged "
                         "cache: delete it and download again); nothing was added")  # fmt: skip
    return path, path.parent.name
