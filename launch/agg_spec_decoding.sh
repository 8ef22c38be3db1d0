#!/usr/bin/env bash
# Aggregated serving with speculative decoding: NATS (started, or reused via $NATS_SERVER),
# one frontend on :$HTTP_PORT and one vLLM worker on the embedded model.
#
#   SPEC_CONFIG   vLLM --speculative-config JSON (default: n-gram, K=3)
#   MODEL         model name or directory (default: smollm2-135m-instruct)
#   HTTP_PORT     frontend port (default 8000)
#   WORKER_ARGS   extra worker flags, e.g. "--extra-engine-args engine_configs/ngram.yaml"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SPEC_CONFIG=${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'}

ensure_nats
start frontend "$PYTHON" -m dynamo.frontend --http-port "$HTTP_PORT" --namespace "$NAMESPACE"
# shellcheck disable=SC2086
start worker "$PYTHON" -m dynamo.vllm --model "$MODEL" --namespace "$NAMESPACE" \
  --enforce-eager --block-size 32 --max-model-len "${MAX_MODEL_LEN:-4096}" \
  --speculative-config "$SPEC_CONFIG" ${WORKER_ARGS:-}
SERVED=${SERVED_MODEL_NAME:-$(basename "$MODEL")}
wait_for_model "$SERVED"
print_usage_hint "$SERVED"
wait_children
