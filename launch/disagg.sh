#!/usr/bin/env bash
# Disaggregated serving: NATS (started, or reused via $NATS_SERVER), a frontend on
# :$HTTP_PORT, one prefill worker and one decode worker on the embedded model. The KV cache
# moves through vLLM's KV connector: NIXL on GPU; on CPU the DiskKvConnector over
# $DYN_KV_SHARED_STORAGE_PATH (a directory both workers share; default under $LOG_DIR).
#
#   MODEL, HTTP_PORT as in agg.sh; PREFILL_ARGS / DECODE_ARGS add worker flags;
#   DECODE_SPEC_CONFIG: --speculative-config JSON for the decode worker (none by default);
#   PREFILL_SPEC_CONFIG: the prefill worker's, by default the decode worker's: a drafter
#     with KV layers of its own (MTP, Eagle, a draft model) must run on both, so that its
#     KV moves with the target's (a decode worker refuses KV laid out unlike its own);
#   ROUTER_MODE (round-robin|random|kv) for the frontend.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

export DYN_KV_SHARED_STORAGE_PATH=${DYN_KV_SHARED_STORAGE_PATH:-$LOG_DIR/kv-transfer}
ENGINE_ARGS=(--model "$MODEL" --namespace "$NAMESPACE" --enforce-eager --block-size 32
             --max-model-len "${MAX_MODEL_LEN:-4096}")

ensure_nats
start frontend "$PYTHON" -m dynamo.frontend --http-port "$HTTP_PORT" --namespace "$NAMESPACE" \
  "${FRONTEND_FLAGS[@]}" \
  --router-mode "${ROUTER_MODE:-round-robin}"
PREFILL_SPEC_CONFIG=${PREFILL_SPEC_CONFIG-${DECODE_SPEC_CONFIG:-}}
PREFILL_SPEC=()
[[ -n "$PREFILL_SPEC_CONFIG" ]] && PREFILL_SPEC=(--speculative-config "$PREFILL_SPEC_CONFIG")
# shellcheck disable=SC2086
start_supervised prefill "$PYTHON" -m dynamo.vllm --is-prefill-worker "${ENGINE_ARGS[@]}" "${PREFILL_SPEC[@]}" ${PREFILL_ARGS:-}
DECODE_SPEC=()
[[ -n "${DECODE_SPEC_CONFIG:-}" ]] && DECODE_SPEC=(--speculative-config "$DECODE_SPEC_CONFIG")
# shellcheck disable=SC2086
start_supervised decode "$PYTHON" -m dynamo.vllm --is-decode-worker "${ENGINE_ARGS[@]}" "${DECODE_SPEC[@]}" ${DECODE_ARGS:-}
SERVED=${SERVED_MODEL_NAME:-$(basename "$MODEL")}
wait_for_model "$SERVED"
print_usage_hint "$SERVED"
wait_children
