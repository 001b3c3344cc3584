"""`python -m serving` (make serve): params.yaml `serve` -> uvicorn running serving.app on serve.host:port.

A params.yaml that does not validate stops it with one line naming the key, before uvicorn starts."""

from __future__ import annotations

import sys

import uvicorn

from tasks.core.params import ParamsError, load_params


def main() -> None:
    try:
        serve = load_params().serve
    except (ParamsError, OSError) as exc:
        print(f"[serve] error: {'; '.join(line.strip() for line in str(exc).splitlines())}", file=sys.stderr)
        sys.exit(2)
    uvicorn.run(
        "serving.app:app_from_params", factory=True, host=serve.host, port=serve.port, workers=serve.workers,
        # Closes idle keep-alive sockets so slow or abandoned clients cannot pin memory; beyond
        # max_connections open connections and requests, uvicorn answers 503 instead of queueing them.
        # uvicorn counts the connection asking too: +1, so that max_connections of them are served.
        timeout_keep_alive=5, limit_concurrency=serve.max_connections + 1, log_level="info",
    )  # fmt: skip


if __name__ == "__main__":
    main()
