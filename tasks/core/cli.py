"""`stage_main`: the one way every entry point under tasks/ starts (`python -m tasks.<name>`).

It logs as `[name] message`, loads and validates params.yaml before any work, calls `body(params)`,
turns a known error (bad params, a StageError) into one line on stderr and exit status 2, and exits
with the status `body` returns (check_regression: 1 on a regression).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from tasks.core.errors import StageError
from tasks.core.params import PARAMS_FILE, Params, ParamsError, load_params


def stage_main(name: str, body: Callable[[Params], int | None]) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(message)s", stream=sys.stdout)
    try:
        params = load_params(PARAMS_FILE)
        status = body(params)
    except (ParamsError, StageError) as exc:
        print(f"[{name}] error: {exc}", file=sys.stderr)
        sys.exit(2)
    if status:
        sys.exit(status)
