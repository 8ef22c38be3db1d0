#!/usr/bin/env bash
# Aggregated serving without speculation: NATS (started, or reused via $NATS_SERVER), one
# frontend on :$HTTP_PORT and one vLLM worker. MODEL, HTTP_PORT, WORKER_ARGS, FRONTEND_ARGS
# as in agg_spec_decoding.sh.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ensure_nats
start frontend "$PYTHON" -m dynamo.frontend --http-port "$HTTP_PORT" --namespace "$NAMESPACE" \
  "${FRONTEND_FLAGS[@]}"
# shellcheck disable=SC2086
start_supervised worker "$PYTHON" -m dynamo.vllm --model "$MODEL" --namespace "$NAMESPACE" \
  --enforce-eager --block-size 32 --max-model-len "${MAX_MODEL_LEN:-4096}" ${WORKER_ARGS:-}
SERVED=${SERVED_MODEL_NAME:-$(basename "$MODEL")}
wait_for_model "$SERVED"
print_usage_hint "$SERVED"
wait_children
