"""`make reload`: POST /reload to the server params.yaml's `serve` section names (after `make promote`).

Prints the server's answer (the model now serving and the one before); one `error:` line and exit 1 when the
server cannot be reached or refuses the new model (it then goes on serving the previous one)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the project's packages
from tasks.core.params import ParamsError, load_params  # noqa: E402


def main() -> int:
    try:
        serve = load_params().serve
    except (ParamsError, OSError) as exc:
        print(f"error: {'; '.join(line.strip() for line in str(exc).splitlines())}", file=sys.stderr)
        return 2
    host = "127.0.0.1" if serve.host in ("0.0.0.0", "::") else serve.host  # the route answers loopback clients only
    url = f"http://{host}:{serve.port}/reload"
    try:
        response = httpx.post(url, timeout=300)
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the server at {url} ({type(exc).__name__}: {exc}); is `make serve` running?",
              file=sys.stderr)  # fmt: skip
        return 1
    if response.status_code != 200:
        print(f"error: {url} answered {response.status_code}: {response.text[:500]}", file=sys.stderr)
        return 1
    print(response.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
