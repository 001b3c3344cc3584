"""Git for placement: commands that fail with the repository and git's own words, the checks of a remote's
name and a commit on its branches, and what a checkout holds or has changed (tracked files, the files a
pipeline run writes, the .dvc files in a stage's dependency folders, the inputs that travel by DVC).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from flows.placement.protocol import ENVIRONMENT, SENT, PlacementError, check_commit
from tasks.core.dag import Stage
from tasks.core.git import changed_files
from tasks.core.params import PARAMS_FILE, load_params


def git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    return git_bytes(repo, *args, env=env).decode().strip()


def git_bytes(repo: Path, *args: str, env: dict[str, str] | None = None) -> bytes:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, env=env)
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).decode(errors="replace").strip()[-500:]
        raise PlacementError(f"`git {' '.join(args)}` in {repo} failed: {said}")
    return proc.stdout


def check_git_remote(repo: Path, name: str) -> str:
    """`name` when it is one of the checkout's configured git remotes; anything else (a URL, an option,
    a path) is refused, so a flow parameter never reaches git as anything but a remote's name."""
    remotes = git(repo, "remote").split()
    if not isinstance(name, str) or name not in remotes:
        raise PlacementError(
            f"git_remote {name!r} is not a git remote of {repo} (configured: {', '.join(remotes) or 'none'}): the "
            "flow takes a configured remote's name, never a URL, a path or an option"
        )
    return name


def on_remote_branch(repo: Path, commit: str, git_remote: str) -> bool:
    """After a fetch from `git_remote`: is `commit` on one of its branches (not only somewhere in this clone)?"""
    check_commit(commit)  # hex only, before git sees it
    git(repo, "fetch", "--quiet", "--prune", "--", git_remote)  # a branch deleted there is gone here too
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo).returncode != 0:
        return False
    return bool(git(repo, "branch", "--remotes", "--contains", commit, "--list", f"{git_remote}/*"))


def written_by_runs(repo: Path, stages: dict[str, Stage]) -> set[str]:
    """What a pipeline run itself changes in a checkout: dvc.lock, the uncached outputs, params.yaml
    (`dvc exp run -S`), the .gitignore files DVC keeps for the cached ones, and train-flow's manifest."""
    outs = {path for stage in stages.values() for path in stage.uncached}
    ignores = {str(Path(path).parent / ".gitignore") for stage in stages.values() for path in stage.outs}
    manifest = str(load_params(repo / PARAMS_FILE).paths.run_manifest)
    return {*SENT, *outs, *ignores, ".gitignore", manifest}


def changed_by_hand(repo: Path, stages: dict[str, Stage]) -> list[str]:
    """Tracked files that differ from HEAD for another reason than a run writing them."""
    return sorted(set(changed_files(repo)) - written_by_runs(repo, stages))


def inputs_to_send(repo: Path, stage: str, stages: dict[str, Stage]) -> list[str]:
    """What `dvc push` here and `dvc pull` there move: the upstream stages' cached outputs, and the files that
    .dvc files in the stage's dependency folders track. The environment stage is run on each machine instead."""
    return [*sorted(stages[stage].upstream - {ENVIRONMENT}), *dvc_files_in_deps(repo, stage, stages)]


def tracked_files(repo: Path, stages: dict[str, Stage]) -> set[str]:
    return set(git(repo, "ls-files", "-z").split("\0")) - (written_by_runs(repo, stages) - {"params.yaml"})


def dvc_files_in_deps(repo: Path, stage: str, stages: dict[str, Stage]) -> list[str]:
    """The commit's .dvc files inside the stage's dependency folders (train's models/pretrained): the files
    they track reach the other machine through the DVC remote, `dvc push` here and `dvc pull` there."""
    folders = [dep.rstrip("/") + "/" for dep in stages[stage].deps if (repo / dep).is_dir()]
    return sorted(
        path for path in tracked_files(repo, stages) if path.endswith(".dvc") and path.startswith(tuple(folders))
    )


def has_config(repo: Path, key: str) -> bool:
    return subprocess.run(["git", "config", key], cwd=repo, capture_output=True).returncode == 0
