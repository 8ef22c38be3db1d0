#!/usr/bin/env bash
# SLA-planned serving: NATS (started, or reused via $NATS_SERVER), one frontend on
# :$HTTP_PORT in `--router-mode kv`, and `python -m dynamo.planner --connector local`, which
# starts and stops the workers itself (each pool between MIN_WORKERS and MAX_WORKERS, as
# many as the traffic needs to meet the TTFT and ITL targets). Worker logs are under
# $LOG_DIR/workers, one per worker (<pool>-<index>.log); the planner's own in planner.log.
#
#   TOPOLOGY            aggregated | disaggregated (a prefill and a decode pool); default aggregated
#   WORKER              mocker | vllm (default mocker: simulated workers, no engine)
#   TTFT_MS, ITL_MS     targets: time to first token (default 1000), inter-token latency (default 100)
#   MIN_WORKERS         fewest workers per pool (default 1)
#   MAX_WORKERS         most workers per pool (default 4)
#   MOCKER_ARGS         extra mocker flags, after the timing fitted to the embedded model
#   WORKER_ARGS         extra vLLM flags for every pool (WORKER=vllm)
#   PREFILL_ARGS, DECODE_ARGS   extra flags for the workers of one pool only
#   PROFILE             the decode engine's speculation profile the planner's model reads
#                       (default: the embedded model's, engine_configs/profiles/smollm2-135m-instruct/eagle3.profile.json)
#   PLANNER_METRICS_PORT the planner's /metrics (default 9400, what deploy/prometheus scrapes)
#   PLANNER_ARGS        extra planner flags, e.g. "--interval 5 --speculation adaptive"
#   MODEL, HTTP_PORT, NAMESPACE, FRONTEND_ARGS, MAX_MODEL_LEN   as in the other scripts
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

TOPOLOGY=${TOPOLOGY:-aggregated}
WORKER=${WORKER:-mocker}
TTFT_MS=${TTFT_MS:-1000}
ITL_MS=${ITL_MS:-100}
MIN_WORKERS=${MIN_WORKERS:-1}
MAX_WORKERS=${MAX_WORKERS:-4}
SERVED=${SERVED_MODEL_NAME:-$(basename "$MODEL")}

PROFILE=${PROFILE:-$ROOT/engine_configs/profiles/smollm2-135m-instruct/eagle3.profile.json}

case "$TOPOLOGY" in
  aggregated | disaggregated) ;;
  *) log "TOPOLOGY must be aggregated or disaggregated, not '$TOPOLOGY'"; exit 2 ;;
esac
case "$WORKER" in
  # The mocker steps as the profiled engine does (its timing fitted to the profile), so a
  # simulated fleet needs as many workers as a real one would.
  mocker) BASE_WORKER_ARGS="$("$PYTHON" -m dynamo.planner.fit_mocker "$PROFILE") ${MOCKER_ARGS:-}" || exit 2 ;;
  vllm) BASE_WORKER_ARGS="--enforce-eager --block-size 32 --max-model-len ${MAX_MODEL_LEN:-4096} ${WORKER_ARGS:-}" ;;
  *) log "WORKER must be mocker or vllm, not '$WORKER'"; exit 2 ;;
esac

# The aggregated pool is sized with the decode flags; a prefill pool only exists disaggregated.
POOL_FLAGS=(--min-decode-workers "$MIN_WORKERS" --max-decode-workers "$MAX_WORKERS"
            --decode-worker-args "$BASE_WORKER_ARGS ${DECODE_ARGS:-}")
if [[ "$TOPOLOGY" == disaggregated ]]; then
  POOL_FLAGS+=(--min-prefill-workers "$MIN_WORKERS" --max-prefill-workers "$MAX_WORKERS"
               --prefill-worker-args "$BASE_WORKER_ARGS ${PREFILL_ARGS:-}")
  # vLLM on CPU hands the KV cache over through files both workers reach (launch/disagg.sh).
  export DYN_KV_SHARED_STORAGE_PATH=${DYN_KV_SHARED_STORAGE_PATH:-$LOG_DIR/kv-transfer}
fi

ensure_nats
start frontend "$PYTHON" -m dynamo.frontend --http-port "$HTTP_PORT" --namespace "$NAMESPACE" \
  "${FRONTEND_FLAGS[@]}" --router-mode kv
# The planner reads the NATS URL from $NATS_SERVER (exported by ensure_nats), as the
# frontend does: a URL with credentials never shows in the process list.
# shellcheck disable=SC2086
start planner "$PYTHON" -m dynamo.planner --connector local --topology "$TOPOLOGY" \
  --worker-kind "$WORKER" --model "$MODEL" --served-model-name "$SERVED" \
  --namespace "$NAMESPACE" --frontend-url "http://127.0.0.1:$HTTP_PORT" \
  --ttft-ms "$TTFT_MS" --itl-ms "$ITL_MS" "${POOL_FLAGS[@]}" --profile "$PROFILE" \
  --metrics-port "${PLANNER_METRICS_PORT:-9400}" --log-dir "$LOG_DIR/workers" ${PLANNER_ARGS:-}
wait_for_model "$SERVED"
print_usage_hint "$SERVED"
log "the planner starts and stops workers: tail -f $LOG_DIR/planner.log"
wait_children
