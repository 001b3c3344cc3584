"""The few lines every stage's `main()` shares: load params.yaml, run, turn known errors into exit 2."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from tasks.params import PARAMS_FILE, Params, ParamsError, load_params


class StageError(RuntimeError):
    """A failure the user can act on; printed without a traceback."""


def stage_main(name: str, body: Callable[[Params], object]) -> None:
    """Load and validate params.yaml before any work, then call `body(params)`."""
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(message)s", stream=sys.stdout)
    try:
        params = load_params(PARAMS_FILE)
        body(params)
    except (ParamsError, StageError) as exc:
        print(f"[{name}] error: {exc}", file=sys.stderr)
        sys.exit(2)
