"""`python -m serving` (make serve): params.yaml `serve` -> uvicorn running serving.app on serve.host:port."""

from __future__ import annotations

import uvicorn

from tasks.core.params import load_params


def main() -> None:
    serve = load_params().serve
    uvicorn.run(
        "serving.app:app_from_params", factory=True, host=serve.host, port=serve.port, workers=serve.workers,
        # Closes idle keep-alive sockets so slow or abandoned clients cannot pin memory.
        timeout_keep_alive=5, log_level="info",
    )  # fmt: skip


if __name__ == "__main__":
    main()
