"""`make reload`: POST /reload, with the server's token, to the server params.yaml's `serve` section names (after
`make promote`), from the serving venv (standard library only beside the project's own modules).

Prints the server's answer (the model every worker now serves, the one before, how many workers serve which hash);
one `error:` line and exit 1 when the server cannot be reached, refuses the new model (it then goes on serving the
previous one) or not every worker swapped in time; exit 2 on bad params or arguments."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the project's packages
from serving.runtime import TOKEN, runtime_folder  # noqa: E402
from tasks.core.params import ParamsError, load_params  # noqa: E402


def server_url(host: str, port: int) -> str:
    """Where to reach a server bound to `host`: a wildcard bind is reached on loopback, an address as it is."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wait", type=float, help="seconds the server waits for every worker (default: its own, 120)")
    args = parser.parse_args(argv)
    try:
        params = load_params()
    except (ParamsError, OSError) as exc:
        print(f"error: {'; '.join(line.strip() for line in str(exc).splitlines())}", file=sys.stderr)
        return 2
    serve = params.serve
    url = f"{server_url(serve.host, serve.port)}/reload" + (f"?wait={args.wait:g}" if args.wait is not None else "")
    token_file = runtime_folder(params.paths, serve.port) / TOKEN
    try:
        token = token_file.read_text().strip()
    except FileNotFoundError:
        print(f"error: {token_file} is missing: no server runs on serve.port {serve.port} from this folder "
              "(start it with make serve)", file=sys.stderr)  # fmt: skip
        return 1
    except OSError as exc:
        print(f"error: cannot read {token_file} ({type(exc).__name__}): run make reload as the user running "
              "make serve", file=sys.stderr)  # fmt: skip
        return 1
    request = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=(args.wait or 600) + 60) as response:
            print(response.read().decode())
        return 0
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            said = json.loads(body)["detail"]
        except (ValueError, KeyError, TypeError):
            said = body[:500].replace("\n", " ")
        print(f"error: {url} answered {exc.code}: {said}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"error: cannot reach the server at {url} ({type(reason).__name__}: {reason}); is `make serve` "
              "running?", file=sys.stderr)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main())
