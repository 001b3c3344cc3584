"""`make reproduce [REV=HEAD]`: recompute a committed run from its inputs and compare it with its record.

    .venv/bin/python scripts/reproduce.py [REV] [--keep]

What "reproduce a teammate's run" means, done in a scratch copy so this workspace is never touched:
1. a git worktree of REV in a temporary folder (removed at the end, on an error and on Ctrl-C);
2. only the inputs there: the files REV's .dvc files track (your raw data, pretrained weights, the promoted
   baseline), taken from this workspace's DVC cache where it has them, else pulled from the DVC remote.
   No stage output is fetched;
3. every stage run from those inputs, with DVC's run cache off: `dvc repro --force --no-run-cache`;
4. the run compared with REV's record by scripts/lock_diff.py: identical, reproduced within tolerance in
   another environment (named, field by field), or not reproduced (named, by stage and file).
It prints how long it took and exits with the comparison's status: 0 reproduced, 1 not, 2 could not try.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the project's packages

from flows.scratch import ProcessGroup, cache_dir, checkpoints_outside, copy_local_config  # noqa: E402
from flows.shell import NOT_INHERITED, stage_env  # noqa: E402
from tasks.core.private_api import dvc_remotes  # noqa: E402

LOCK_DIFF = Path(__file__).resolve().parent / "lock_diff.py"
CACHE_REMOTE = "workspace-cache"  # this workspace's DVC cache, read as a remote: DVC 3 lays both out alike
DVC = [sys.executable, "-m", "dvc"]


class Refusal(Exception):
    """Why the run could not be tried: one line."""


def run(
    args: list[str], cwd: Path, *, capture: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=capture, text=True, env=env)


def dvc(
    *args: str, cwd: Path, capture: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run([*DVC, *args], cwd, capture=capture, env=env)


def resolve(rev: str, root: Path) -> str:
    proc = run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], root)
    if proc.returncode != 0:
        raise Refusal(f"REV={rev} is not a commit of this repository (git rev-parse found none); give a commit, "
                      "branch or tag: make reproduce REV=HEAD~1")  # fmt: skip
    commit = proc.stdout.strip()
    if run(["git", "cat-file", "-e", f"{commit}:dvc.lock"], root).returncode != 0:
        raise Refusal(f"REV={rev} ({commit[:12]}) has no dvc.lock: no run was recorded there to reproduce")
    return commit


def inputs(tree: Path) -> dict[str, str]:
    """The files REV's .dvc files track: .dvc file -> the path it brings (relative to the worktree)."""
    listed = run(["git", "ls-files", "*.dvc"], tree).stdout.split()
    found = {}
    for name in listed:
        try:
            outs = yaml.safe_load((tree / name).read_text()).get("outs") or []
        except (OSError, yaml.YAMLError, AttributeError) as exc:
            raise Refusal(f"{name} at REV: not a DVC file ({type(exc).__name__}: {exc})") from None
        for out in outs:
            found[name] = (Path(name).parent / out["path"]).as_posix()
    return found


def fetch_inputs(root: Path, tree: Path) -> list[str]:
    """Bring REV's inputs into the worktree: this workspace's cache first, then the default DVC remote.
    Returns the input paths; a Refusal names those found nowhere and how to push them."""
    wanted = inputs(tree)
    if not wanted:
        return []
    copy_local_config(root, tree)
    dvc("remote", "add", "--local", "-f", CACHE_REMOTE, str(cache_dir(root)), cwd=tree)
    targets = list(wanted)
    dvc("fetch", "-q", "-r", CACHE_REMOTE, *targets, cwd=tree)  # what the cache lacks is fetched below
    dvc("checkout", "-q", *targets, cwd=tree)
    missing = [dvc_file for dvc_file, path in wanted.items() if not (tree / path).exists()]
    if not missing:
        return list(wanted.values())
    remotes, default = dvc_remotes(tree)
    remotes.pop(CACHE_REMOTE, None)
    names = ", ".join(wanted[m] for m in missing)
    if default in (None, CACHE_REMOTE) or default not in remotes:
        raise Refusal(f"inputs not in this workspace's DVC cache and no DVC remote to pull them from: {names}; on "
                      "the machine that has them, `dvc remote add -d storage <url>`, commit .dvc/config and "
                      f"`dvc push {' '.join(missing)}`")  # fmt: skip
    pulled = dvc("pull", "-q", "-r", default, *missing, cwd=tree)
    still = [m for m in missing if not (tree / wanted[m]).exists()]
    if pulled.returncode != 0 or still:
        names = ", ".join(wanted[m] for m in still or missing)
        raise Refusal(f"inputs missing from the DVC remote '{default}' ({remotes[default]}): {names}; push them "
                      f"from the machine that has them: `dvc push {' '.join(still or missing)}`")  # fmt: skip
    return list(wanted.values())


def checkpoints_inside(tree: Path) -> None:
    """A rerun must train, not take a finished run's checkpoint from storage shared with the machine that made it."""
    params_file = tree / "params.yaml"
    params = (yaml.safe_load(params_file.read_text()) if params_file.is_file() else None) or {}
    folder = checkpoints_outside(params, tree)
    if folder is not None:
        raise Refusal(f"paths.checkpoints at REV is {folder}, outside the checkout: the rerun could resume a "
                      "finished run from there instead of training; reproduce a commit whose paths.checkpoints "
                      "is inside the project (the default, runs/checkpoints)")  # fmt: skip


def reproduce(rev: str, root: Path, scratch: Path) -> int:
    commit = resolve(rev, root)
    tree = scratch / "repo"
    print(f"reproduce: REV={rev} ({commit[:12]}) in a scratch worktree, {tree}", flush=True)
    added = run(["git", "worktree", "add", "--detach", "-q", str(tree), commit], root)
    if added.returncode != 0:
        raise Refusal(f"git worktree add failed: {added.stderr.strip() or added.stdout.strip()}")
    checkpoints_inside(tree)
    brought = fetch_inputs(root, tree)
    print(f"reproduce: inputs: {', '.join(brought) if brought else 'none tracked by .dvc files (generated data)'}; "
          "every stage now runs from them: dvc repro --force --no-run-cache", flush=True)  # fmt: skip
    # dvc and the stages it starts are one process group: Ctrl-C or SIGTERM of this script stops all of them
    # before the worktree goes, so no train process writes on into a removed folder
    with ProcessGroup([*DVC, "repro", "--force", "--no-run-cache"], cwd=tree, env=stage_env(NOT_INHERITED)) as repro:
        code = repro.wait()
    if code != 0:
        print(f"not reproduced: `dvc repro` failed at REV={rev} (exit {code}); its output is above")
        return 1
    compared = run([sys.executable, str(LOCK_DIFF), "HEAD"], tree, env=stage_env(NOT_INHERITED))  # HEAD there: REV
    sys.stdout.write(compared.stdout)
    sys.stderr.write(compared.stderr)
    return compared.returncode


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rev", nargs="?", default="HEAD")
    parser.add_argument("--keep", action="store_true", help="keep the scratch worktree (its path is printed)")
    args = parser.parse_args()
    top = run(["git", "rev-parse", "--show-toplevel"], Path.cwd())
    if top.returncode != 0:
        print("error: make reproduce runs in the project's git checkout", file=sys.stderr)
        return 2
    root = Path(top.stdout.strip())
    signal.signal(signal.SIGTERM, _interrupted)
    # Ctrl-C cleans up too where this process was started with SIGINT ignored (a shell's background job, a CI
    # runner): Python installs its handler only when SIGINT is not ignored at startup
    signal.signal(signal.SIGINT, signal.default_int_handler)
    scratch = Path(tempfile.mkdtemp(prefix="imagepipe-reproduce-"))
    started = time.monotonic()
    status = 2
    try:
        status = reproduce(args.rev, root, scratch)
    except Refusal as exc:
        print(f"error: make reproduce: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("reproduce: interrupted; the scratch worktree is removed and nothing in this workspace changed",
              file=sys.stderr)  # fmt: skip
        status = 130
    finally:
        if args.keep and status != 130:
            print(
                f"reproduce: kept {scratch / 'repo'}; remove it with `git worktree remove --force {scratch / 'repo'}`"
            )
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not leave half a cleanup
            run(["git", "worktree", "remove", "--force", str(scratch / "repo")], root)
            shutil.rmtree(scratch, ignore_errors=True)
            run(["git", "worktree", "prune"], root)
    minutes, seconds = divmod(time.monotonic() - started, 60)
    print(f"reproduce: took {int(minutes)} min {seconds:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
