"""`make prefect-run DEPLOYMENT=train-flow/prod`: start a deployment's run, follow it, end with its verdict.

deployment name + `-p key=value` parameters -> a flow run on the deployment's work pool -> its final
state and state message on one line (exit 0 only when it Completed). Before anything it checks that
the Prefect API answers, so a stopped server is one line naming the URL and `make prefect-server`,
not prefect's 78-line `httpx.ConnectError` traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL


def api_url() -> str:
    return PREFECT_API_URL.value() or ""


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def require_api(url: str) -> None:
    """Exit 2, naming the URL and the fix, unless a Prefect API answers at `url`."""
    if not url:
        _fail("error: PREFECT_API_URL is not set: `source scripts/prefect-env.sh` (and `make prefect-server`)")
    try:
        urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5).read()
    except OSError as exc:  # URLError, connection refused, timeouts
        reason = getattr(exc, "reason", exc)
        _fail(f"error: no Prefect server answers at {url} ({reason}): start it with `make prefect-server`")


def parse_parameter(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("deployment", help="<flow name>/<deployment name>, e.g. train-flow/prod")
    parser.add_argument("-p", "--param", type=parse_parameter, action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    require_api(api_url())
    try:
        run = run_deployment(args.deployment, parameters=dict(args.param), timeout=0, as_subflow=False)
    except ObjectNotFound:
        _fail(f"error: no deployment {args.deployment!r} on {api_url()}: deploy it with `make prefect-deploy`")
    print(f"flow run {run.name} ({run.id}) of {args.deployment}: waiting for a worker of its pool to run it")
    print(f"  follow it in the UI: {api_url().removesuffix('/api')}/runs/flow-run/{run.id}")
    final = wait_until_final(run.id)
    state = final.state
    name, message = (state.name, state.message or "") if state is not None else ("Unknown", "")
    print(f"{args.deployment}: {name}" + (f": {message}" if message else ""))
    sys.exit(0 if state is not None and state.is_completed() else 1)


def wait_until_final(flow_run_id: UUID, poll_s: float = 3.0) -> FlowRun:
    """The flow run once it reached a final state (Completed, Failed, Crashed, Cancelled)."""
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(poll_s)


if __name__ == "__main__":
    main()
