# Shared helpers for the launch scripts (sourced, not run).
#
# Every script: reuses the NATS server at $NATS_SERVER when one answers there, else starts
# one; starts its processes in the background with logs under $LOG_DIR (workers under a
# supervisor that starts a failed worker again, see start_supervised); waits until the
# frontend lists the model; prints a curl line; and on exit (Ctrl-C, error, or a child
# dying for good) stops every process it started. Every background process is started through
# `python -m dynamo.runtime.parent_death`, so it gets SIGTERM when this script dies, even
# by SIGKILL (which no trap sees), and nothing is left behind holding ports or memory.
#
# NATS security: the components read NATS_USER/NATS_PASSWORD, NATS_TOKEN, NATS_CREDS,
# NATS_NKEY_SEED and NATS_TLS_CA/_CERT/_KEY from the environment they inherit; a NATS
# server started here requires the same NATS_USER/NATS_PASSWORD or NATS_TOKEN, and speaks
# TLS with NATS_SERVER_TLS_CERT/NATS_SERVER_TLS_KEY (docs/runtime.md, Securing NATS).

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$( [[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || command -v python3 )}
HTTP_PORT=${HTTP_PORT:-8000}
NAMESPACE=${NAMESPACE:-dynamo}
MODEL=${MODEL:-smollm2-135m-instruct}
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/dynamo-launch.XXXXXX")}
READY_TIMEOUT=${READY_TIMEOUT:-300}
# Frontend flags: FRONTEND_ARGS (split on spaces) when set, else the defaults for $MODEL.
# The embedded model's own chat template has no tools section, so it is served with the
# tools-capable template the repository ships and vLLM's `hermes` tool parser (the call
# format that template teaches): a first request with `tools` works. FRONTEND_ARGS=""
# serves the model's own template (tools then get a 400 saying why).
if [[ -n "${FRONTEND_ARGS+set}" ]]; then
  read -r -a FRONTEND_FLAGS <<<"$FRONTEND_ARGS"
elif [[ "$(basename "$MODEL")" == smollm2-135m-instruct ]]; then
  FRONTEND_FLAGS=(--chat-template "$ROOT/examples/chat_templates/smollm2_tools.jinja"
    --tool-call-parser hermes)
else
  FRONTEND_FLAGS=()
fi
# CPU-friendly engine defaults; override in the environment.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

CHILDREN=()

log() { printf '[launch %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if ((${#CHILDREN[@]})); then
    log "stopping ${#CHILDREN[@]} processes"
    for pid in "${CHILDREN[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    local deadline=$((SECONDS + 30))
    for pid in "${CHILDREN[@]}"; do
      while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
      kill -KILL "$pid" 2>/dev/null || true
    done
  fi
  log "logs are in $LOG_DIR"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# redact URL: the URL with any credentials in it masked, for log lines
# (up to the last @ of each server's authority, where nats-py splits user information)
redact() { sed -E 's#^(([A-Za-z][A-Za-z0-9+.-]*://)?)[^/?#,]*@#\1***@#; s#,(([A-Za-z][A-Za-z0-9+.-]*://)?)[^/?#,]*@#,\1***@#g' <<<"$1"; }

# start NAME CMD...: run CMD in the background, output to $LOG_DIR/NAME.log; CMD gets
# SIGTERM when this script dies, however it dies
start() {
  local name=$1; shift
  "$PYTHON" -m dynamo.runtime.parent_death --parent-pid $$ -- "$@" >"$LOG_DIR/$name.log" 2>&1 &
  CHILDREN+=($!)
  log "started $name (pid $!): $*"
}

# start_supervised NAME CMD...: `start`, with CMD run under `python -m
# dynamo.runtime.supervise`: a worker that fails (its engine died) is started again after a
# back-off (1 s doubling to 30 s) instead of being lost; SUPERVISE_ARGS adds flags
# (e.g. "--max-restarts 5"), SUPERVISE=0 starts the worker unsupervised.
start_supervised() {
  local name=$1; shift
  if [[ "${SUPERVISE:-1}" == 0 ]]; then
    start "$name" "$@"
  else
    # shellcheck disable=SC2086
    start "$name" "$PYTHON" -m dynamo.runtime.supervise ${SUPERVISE_ARGS:-} -- "$@"
  fi
}

nats_reachable() {
  "$PYTHON" -c 'import sys; from dynamo.runtime.nats_address import is_reachable; sys.exit(0 if is_reachable(sys.argv[1]) else 1)' "$1"
}

# Sets and exports NATS_SERVER: the reachable one, or a new one we start.
ensure_nats() {
  if [[ -n "${NATS_SERVER:-}" ]] && nats_reachable "$NATS_SERVER"; then
    log "reusing NATS at $(redact "$NATS_SERVER")"
  else
    local port scheme=nats
    port=$("$PYTHON" -c 'from dynamo.runtime.ports import free_port; print(free_port())')
    [[ -n "${NATS_SERVER_TLS_CERT:-}" ]] && scheme=tls
    start nats "$PYTHON" -m dynamo.nats_server --port "$port"
    export NATS_SERVER="$scheme://127.0.0.1:$port"
    local deadline=$((SECONDS + 15))
    until nats_reachable "$NATS_SERVER"; do
      ((SECONDS < deadline)) || { log "nats-server did not start; see $LOG_DIR/nats.log"; exit 1; }
      sleep 0.2
    done
    log "NATS ready at $NATS_SERVER"
  fi
}

# wait_for_model NAME: until the frontend lists NAME (dies if a child exits first)
wait_for_model() {
  local model=$1 deadline=$((SECONDS + READY_TIMEOUT))
  log "waiting for model $model on http://127.0.0.1:$HTTP_PORT (engines take ~30-60 s to load)"
  until curl -sf "http://127.0.0.1:$HTTP_PORT/v1/models" 2>/dev/null | grep -q "\"$model\""; do
    for pid in "${CHILDREN[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        log "a process exited early; last lines of the logs:"
        tail -n 20 "$LOG_DIR"/*.log >&2 || true
        exit 1
      fi
    done
    ((SECONDS < deadline)) || { log "model not ready after ${READY_TIMEOUT}s; logs in $LOG_DIR"; exit 1; }
    sleep 1
  done
}

# wait_for_instances N: until the frontend's /health lists N instances of the model
wait_for_instances() {
  local want=$1 deadline=$((SECONDS + READY_TIMEOUT))
  log "waiting for $want workers behind the frontend"
  until curl -sf "http://127.0.0.1:$HTTP_PORT/health" 2>/dev/null | "$PYTHON" -c '
import json, sys
models = json.load(sys.stdin)["models"].values()
sys.exit(0 if max((len(m["instances"]) for m in models), default=0) >= int(sys.argv[1]) else 1)
' "$want"; do
    for pid in "${CHILDREN[@]}"; do
      kill -0 "$pid" 2>/dev/null || { log "a process exited early"; tail -n 20 "$LOG_DIR"/*.log >&2; exit 1; }
    done
    ((SECONDS < deadline)) || { log "workers not ready after ${READY_TIMEOUT}s; logs in $LOG_DIR"; exit 1; }
    sleep 1
  done
}

print_usage_hint() {
  local model=$1
  cat >&2 <<HINT

Ready. Try:
  curl localhost:$HTTP_PORT/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "$model", "messages": [{"role": "user", "content": "What is the capital of Japan?"}], "max_tokens": 32}'

Logs: $LOG_DIR   (Ctrl-C stops everything)
HINT
}

# Block until Ctrl-C or until any child exits (then clean up everything).
wait_children() {
  while true; do
    for pid in "${CHILDREN[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        log "process $pid exited; stopping the rest"
        exit 1
      fi
    done
    sleep 1
  done
}
