#!/usr/bin/env bash
# Simulated workers behind the KV-aware router: NATS (started, or reused via $NATS_SERVER),
# one frontend on :$HTTP_PORT (`--router-mode kv` unless ROUTER_MODE says otherwise) and one
# `python -m dynamo.mocker` process running $NUM_WORKERS simulated workers (default 4).
# No engine, no GPU: the mockers simulate KV blocks, prefix caching, batching, step times
# and speculative decoding, and publish KV events and load like vLLM workers, so this
# is the cheap way to exercise the router and the frontend at scale (docs/mocker.md).
#
#   NUM_WORKERS         simulated workers in the mocker process (default 4)
#   ROUTER_MODE         kv | round-robin | random (default kv)
#   MODEL               tokenizer source: embedded model name or directory (default: smollm2-135m-instruct)
#   MOCKER_ARGS         extra mocker flags, e.g. "--num-speculative-tokens 3 --speed-up 10"
#   KV_OVERLAP_SCORE_WEIGHT, ROUTER_TEMPERATURE   as in agg_router.sh
#   HTTP_PORT           frontend port (default 8000)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NUM_WORKERS=${NUM_WORKERS:-4}
ROUTER_MODE=${ROUTER_MODE:-kv}
SERVED=${SERVED_MODEL_NAME:-$(basename "$MODEL")}
READY_TIMEOUT=${READY_TIMEOUT:-60}

ensure_nats
start frontend "$PYTHON" -m dynamo.frontend --http-port "$HTTP_PORT" --namespace "$NAMESPACE" \
  "${FRONTEND_FLAGS[@]}" \
  --router-mode "$ROUTER_MODE" --kv-overlap-score-weight "${KV_OVERLAP_SCORE_WEIGHT:-1.0}" \
  --router-temperature "${ROUTER_TEMPERATURE:-0.0}"
# shellcheck disable=SC2086
start_supervised mocker "$PYTHON" -m dynamo.mocker --model "$MODEL" --served-model-name "$SERVED" \
  --namespace "$NAMESPACE" --num-workers "$NUM_WORKERS" ${MOCKER_ARGS:-}
wait_for_model "$SERVED"
wait_for_instances "$NUM_WORKERS"
print_usage_hint "$SERVED"
if [[ "$ROUTER_MODE" == kv ]]; then log "router state: curl localhost:$HTTP_PORT/debug/kv"; fi
wait_children
