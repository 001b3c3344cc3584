# shellcheck shell=bash
# The environment of this project's Prefect server, worker and CLI. Sourced by scripts/prefect.sh;
# source it yourself before using the prefect CLI by hand:  source scripts/prefect-env.sh
# Every value below is a default: export your own value first to override it.

IMAGEPIPE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export IMAGEPIPE_ROOT
export IMAGEPIPE_VENV="${IMAGEPIPE_VENV:-$IMAGEPIPE_ROOT/.venv}" # made by `make setup`
export PATH="$IMAGEPIPE_VENV/bin:$PATH"

# Server state (SQLite database, logs, pid files) stays inside the checkout, in .prefect/ (git-ignored).
# PostgreSQL instead of SQLite:  export PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://user:pass@host:5432/prefect
export PREFECT_HOME="${PREFECT_HOME:-$IMAGEPIPE_ROOT/.prefect}"

# Listen on the loopback interface only: nothing outside this machine can reach the API or the UI.
export PREFECT_SERVER_API_HOST="${PREFECT_SERVER_API_HOST:-127.0.0.1}"
export PREFECT_SERVER_API_PORT="${PREFECT_SERVER_API_PORT:-4200}"
export PREFECT_API_URL="${PREFECT_API_URL:-http://$PREFECT_SERVER_API_HOST:$PREFECT_SERVER_API_PORT/api}"

# State-changing API calls need a CSRF token (the prefect client and the UI fetch one themselves).
export PREFECT_SERVER_CSRF_PROTECTION_ENABLED="${PREFECT_SERVER_CSRF_PROTECTION_ENABLED:-true}"

# Basic auth, off unless you set it: one `user:password` string, the same for server and clients.
# Setting either variable sets the other, so `export PREFECT_API_AUTH_STRING=admin:secret` is enough.
if [ -n "${PREFECT_API_AUTH_STRING:-}" ] && [ -z "${PREFECT_SERVER_API_AUTH_STRING:-}" ]; then
  export PREFECT_SERVER_API_AUTH_STRING="$PREFECT_API_AUTH_STRING"
elif [ -n "${PREFECT_SERVER_API_AUTH_STRING:-}" ] && [ -z "${PREFECT_API_AUTH_STRING:-}" ]; then
  export PREFECT_API_AUTH_STRING="$PREFECT_SERVER_API_AUTH_STRING"
fi

# Offline and quiet: no telemetry from Prefect or DVC, no promotional content in the UI.
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT=false
export DO_NOT_TRACK=1
export DVC_NO_ANALYTICS=1
export PYTHONUNBUFFERED=1

# How long a flow run may stay silent (no heartbeat, no state change) before it is marked Crashed.
export IMAGEPIPE_CRASH_AFTER_S="${IMAGEPIPE_CRASH_AFTER_S:-90}"
