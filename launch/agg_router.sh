#!/usr/bin/env bash
# Aggregated serving with the KV-aware router: NATS (started, or reused via $NATS_SERVER),
# one frontend on :$HTTP_PORT in `--router-mode kv` and $NUM_WORKERS vLLM workers (default
# 2). Each worker publishes its KV-cache events (ZMQ port picked by the worker) and load to
# NATS; requests sharing a prefix go to the worker that caches it. `GET /debug/kv` on the
# frontend shows what the router believes.
#
#   MODEL, HTTP_PORT, WORKER_ARGS          as in agg_spec_decoding.sh
#   NUM_WORKERS                            workers to start (default 2)
#   KV_OVERLAP_SCORE_WEIGHT                cache hits vs load balance (default 1.0)
#   ROUTER_TEMPERATURE                     0 = cheapest worker (default 0.0)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NUM_WORKERS=${NUM_WORKERS:-2}

ensure_nats
start frontend "$PYTHON" -m dynamo.frontend --http-port "$HTTP_PORT" --namespace "$NAMESPACE" \
  "${FRONTEND_FLAGS[@]}" \
  --router-mode kv --kv-overlap-score-weight "${KV_OVERLAP_SCORE_WEIGHT:-1.0}" \
  --router-temperature "${ROUTER_TEMPERATURE:-0.0}"
for i in $(seq 1 "$NUM_WORKERS"); do
  # shellcheck disable=SC2086
  start_supervised "worker$i" "$PYTHON" -m dynamo.vllm --model "$MODEL" --namespace "$NAMESPACE" \
    --enforce-eager --block-size 32 --max-model-len "${MAX_MODEL_LEN:-4096}" ${WORKER_ARGS:-}
done
SERVED=${SERVED_MODEL_NAME:-$(basename "$MODEL")}
wait_for_model "$SERVED"
wait_for_instances "$NUM_WORKERS"
print_usage_hint "$SERVED"
log "router state: curl localhost:$HTTP_PORT/debug/kv"
wait_children
