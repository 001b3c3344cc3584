"""`python -m serving` (make serve): params.yaml `serve` -> uvicorn running serving.app on serve.host:port.

It makes the server's runtime folder (serving/runtime.py: the reload token its workers and `make reload` share)
before uvicorn starts and removes it at exit. A params.yaml that does not validate, or a folder another server
holds, stops it with one line, before uvicorn starts."""

from __future__ import annotations

import os
import signal
import sys

import uvicorn

from serving.runtime import MULTIPROCESS_ENV, RUNTIME_ENV, RuntimeFolderError, ServerRuntime, runtime_folder
from tasks.core.params import ParamsError, load_params


class _Terminated(BaseException):
    """SIGTERM: uvicorn shuts down on it, then raises it again (one worker); the folder goes before the process."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def main() -> None:
    try:
        params = load_params()
        runtime = ServerRuntime.start(runtime_folder(params.paths, params.serve.port))
    except (ParamsError, RuntimeFolderError, OSError) as exc:
        print(f"[serve] error: {'; '.join(line.strip() for line in str(exc).splitlines())}", file=sys.stderr)
        sys.exit(2)
    serve = params.serve
    os.environ[RUNTIME_ENV] = str(runtime.folder)  # the workers (spawned: they inherit the environment) attach it
    # prometheus_client's multiprocess folder, empty (start() emptied the runtime folder): each worker's metric
    # files, summed by /metrics. Set before any worker imports prometheus_client, which reads it then.
    runtime.metrics.mkdir()
    os.environ[MULTIPROCESS_ENV] = str(runtime.metrics)
    print(f"[serve] runtime folder {runtime.folder} (POST /reload takes its token; make reload sends it)",
          file=sys.stderr)  # fmt: skip
    signal.signal(signal.SIGTERM, _terminated)
    try:
        uvicorn.run(
            "serving.app:app_from_params", factory=True, host=serve.host, port=serve.port, workers=serve.workers,
            # Closes idle keep-alive sockets so slow or abandoned clients cannot pin memory; beyond
            # max_connections open connections and requests, uvicorn answers 503 instead of queueing them.
            # uvicorn counts the connection asking too: +1, so that max_connections of them are served.
            timeout_keep_alive=5, limit_concurrency=serve.max_connections + 1, log_level="info",
        )  # fmt: skip
    except _Terminated:
        runtime.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # ends as a SIGTERM-ed server always has, for whoever waits on it
    finally:
        runtime.close()


if __name__ == "__main__":
    main()
