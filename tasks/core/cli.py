"""`stage_main`: the one way every entry point under tasks/ starts (`python -m tasks.<name>`).

It logs as `[name] message`, loads and validates params.yaml before any work, calls `body(params)`,
turns a known error (bad params, a StageError) into one line on stderr and exit status 2, and exits
with the status `body` returns (check_regression: 1 on a regression).

For a stage of dvc.yaml it also holds the stage to what DVC watches (tasks/core/provenance.py): the
project code it loaded must be in its deps, checked before `body` and again after it (a lazy import),
and a run that ends well appends its outputs' digests to the local run ledger (`ledger=False`: a process
that writes no outputs of its own, such as a node that joins another's training).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable

from tasks.core import provenance
from tasks.core.dag import DagError, load_stages
from tasks.core.errors import StageError
from tasks.core.params import PARAMS_FILE, Params, ParamsError, load_params


def _declared_stage(name: str) -> bool:
    """Is `name` a stage of the dvc.yaml beside this code (not a tool such as sanity or promote)?"""
    try:
        return name in load_stages(provenance.project_root())
    except DagError:
        return False


def _check_code(name: str, when: str) -> None:
    try:
        refusal = provenance.undeclared_refusal(name, provenance.project_root(), when)
    except provenance.ProvenanceError as exc:
        raise StageError(str(exc)) from None
    if refusal:
        raise StageError(refusal)


def stage_main(name: str, body: Callable[[Params], int | None], *, ledger: bool = True) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(message)s", stream=sys.stdout)
    stage = _declared_stage(name)
    try:
        params = load_params(PARAMS_FILE)
        if stage:
            _check_code(name, "before any work")
        status = body(params)
        if stage:
            _check_code(name, "while it ran")
    except (ParamsError, StageError) as exc:
        print(f"[{name}] error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        print(f"[{name}] error: {disk_full_line(exc)}", file=sys.stderr)
        sys.exit(2)
    if status:
        sys.exit(status)
    if stage and ledger and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 writes the outputs
        provenance.record_run(name, provenance.project_root())


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC (or a quota), from Python's own I/O or from a library that only says it in words (pyarrow)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc)


def disk_full_line(exc: OSError) -> str:
    """One line for a full disk: where, and that the outputs that were there are as they were."""
    where = f" writing {exc.filename}" if exc.filename else ""
    return (
        f"no space left on the device{where} ({exc.strerror or str(exc).splitlines()[0]}); outputs are written "
        "beside the previous ones and renamed in only when complete, so those are as they were: free space and "
        "run it again"
    )
