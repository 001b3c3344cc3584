#!/usr/bin/env bash
# This project's local Prefect: scripts/prefect.sh server|pool|deploy|worker|stop|status
#   server   start `prefect server start` on 127.0.0.1 in the background; wait until it answers
#   pool     create the work pools that prefect.yaml's deployments use (local-process, gpu)
#   deploy   `prefect deploy --all` (train-flow/prod, run-stage/gpu, regression-flow/nightly) + the crash automation
#   worker   start a worker on pool $POOL (default local-process) in the background, in this checkout
#   run      run <flow>/<deployment> [-p key=value]: start a flow run, wait, print its final state and message
#   stop     stop the worker (SIGINT: it ignores SIGTERM), then the server
#   status   what is running, and where
# Settings come from scripts/prefect-env.sh; logs and pid files go to $PREFECT_HOME.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prefect-env.sh"
cd "$IMAGEPIPE_ROOT"

POOL="${POOL:-local-process}" # the worker's pool; a placed stage's machine runs POOL=gpu
PYTHON="$IMAGEPIPE_VENV/bin/python"
mkdir -p "$PREFECT_HOME"

pid_of() { # pid of a background service we started, if it still runs
  local file="$PREFECT_HOME/$1.pid"
  [ -f "$file" ] && kill -0 "$(cat "$file")" 2>/dev/null && cat "$file"
}

healthy() {
  "$PYTHON" - "$PREFECT_API_URL" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).read()
except Exception:
    sys.exit(1)
PY
}

require_server() { # the one-line fix instead of prefect's connection traceback
  healthy && return 0
  echo "error: no Prefect server answers at $PREFECT_API_URL: start it with \`make prefect-server\`" >&2
  exit 2
}

start_background() { # name, command...: own session (Ctrl-C in this terminal doesn't reach it), logs to a file
  local name=$1
  shift
  # A background job of a script starts with SIGINT ignored, and the worker stops only on SIGINT:
  # restore its default, then exec the command as the leader of a new session (same pid).
  "$PYTHON" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])' \
    "$@" >"$PREFECT_HOME/$name.log" 2>&1 </dev/null &
  echo $! >"$PREFECT_HOME/$name.pid"
}

wait_for() { # name, seconds, test command...
  local name=$1 seconds=$2
  shift 2
  for _ in $(seq "$seconds"); do
    "$@" && return 0
    if ! pid_of "$name" >/dev/null; then
      echo "error: the $name exited; last lines of $PREFECT_HOME/$name.log:" >&2
      tail -n 30 "$PREFECT_HOME/$name.log" >&2
      return 1
    fi
    sleep 1
  done
  echo "error: the $name did not come up within $seconds s; see $PREFECT_HOME/$name.log" >&2
  return 1
}

stop_service() { # name, signal, seconds
  local name=$1 signal=$2 seconds=$3 pid
  pid=$(pid_of "$name") || { echo "$name: not running"; rm -f "$PREFECT_HOME/$name.pid"; return 0; }
  # The whole process group: `prefect server start` runs the API in a child process.
  kill "-$signal" -- "-$pid" 2>/dev/null || kill "-$signal" "$pid"
  for _ in $(seq "$seconds"); do
    kill -0 "$pid" 2>/dev/null || { echo "$name stopped"; rm -f "$PREFECT_HOME/$name.pid"; return 0; }
    sleep 1
  done
  echo "$name (pid $pid) ignored SIG$signal for $seconds s: killing it" >&2
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PREFECT_HOME/$name.pid"
}

case "${1:-}" in
server)
  if healthy; then
    echo "a Prefect server already answers at $PREFECT_API_URL"
    exit 0
  fi
  start_background server prefect server start --host "$PREFECT_SERVER_API_HOST" --port "$PREFECT_SERVER_API_PORT"
  wait_for server 120 healthy
  echo "Prefect server: API $PREFECT_API_URL, UI http://$PREFECT_SERVER_API_HOST:$PREFECT_SERVER_API_PORT"
  echo "  (database: ${PREFECT_API_DATABASE_CONNECTION_URL:-SQLite in $PREFECT_HOME}; log: $PREFECT_HOME/server.log)"
  ;;
pool)
  require_server
  for pool in $("$PYTHON" -c 'import yaml; print(*sorted({d["work_pool"]["name"] for d in yaml.safe_load(open("prefect.yaml"))["deployments"]}))'); do
    # The pools' base job template (flows/process_pool_template.json) fixes the command, the environment and
    # the working directory: a flow run's job variables cannot override them (the server refuses the run).
    if prefect work-pool inspect "$pool" >/dev/null 2>&1; then
      prefect work-pool update "$pool" --base-job-template flows/process_pool_template.json >/dev/null
      echo "work pool $pool exists: base job template set (flows/process_pool_template.json)"
    else
      prefect work-pool create "$pool" --type process --base-job-template flows/process_pool_template.json
    fi
  done
  ;;
deploy)
  require_server
  # PWD is what prefect.yaml's pull step records as the working directory of every run.
  # IMAGEPIPE_CHECKOUT stays unset, so run-stage's pull step resolves it on the worker, at run time.
  PWD="$IMAGEPIPE_ROOT" env -u IMAGEPIPE_CHECKOUT prefect --no-prompt deploy --all
  # IMAGEPIPE_DRIFT_NOTIFY=<block-type-slug>/<name> (a notification block on this server): nightly runs that
  # find drift notify it (docs/watching.md).
  "$PYTHON" -m flows.automations --within "$IMAGEPIPE_CRASH_AFTER_S" \
    ${IMAGEPIPE_DRIFT_NOTIFY:+--drift-notify "$IMAGEPIPE_DRIFT_NOTIFY"}
  if [ -z "${IMAGEPIPE_DRIFT_NOTIFY:-}" ]; then
    echo "no drift automation: IMAGEPIPE_DRIFT_NOTIFY=<block-type-slug>/<block> names the notification block it sends to"
  fi
  ;;
worker)
  require_server
  if pid=$(pid_of worker); then
    echo "a worker already runs (pid $pid)"
    exit 0
  fi
  export IMAGEPIPE_CHECKOUT="$IMAGEPIPE_ROOT" # where run-stage runs (prefect.yaml's pull step)
  # LIMIT=n: at most n flow runs at once on this worker (a sweep's trials: LIMIT=1, one per machine)
  start_background worker prefect worker start --pool "$POOL" --type process ${LIMIT:+--limit "$LIMIT"}
  wait_for worker 60 grep -q "started" "$PREFECT_HOME/worker.log"
  echo "worker on pool $POOL (pid $(cat "$PREFECT_HOME/worker.pid"); log: $PREFECT_HOME/worker.log)"
  ;;
run)
  # run <flow>/<deployment> [-p key=value ...]: start a run, wait for it, print its final state and message
  shift
  exec "$PYTHON" -m flows.launch "$@"
  ;;
stop)
  stop_service worker INT 60
  stop_service server TERM 30
  ;;
status)
  for name in server worker; do
    if pid=$(pid_of "$name"); then echo "$name: running (pid $pid)"; else echo "$name: not running"; fi
  done
  if healthy; then echo "API: $PREFECT_API_URL answers"; else echo "API: $PREFECT_API_URL does not answer"; fi
  ;;
*)
  sed -n '2,10p' "$0" >&2
  exit 2
  ;;
esac
