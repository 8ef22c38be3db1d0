#!/usr/bin/env bash
# Aggregated serving with speculative decoding: NATS (started, or reused via $NATS_SERVER),
# one frontend on :$HTTP_PORT and one vLLM worker on the embedded model.
#
#   SPEC          ngram (default: prompt lookup, K=3) or eagle3 (the Eagle3 head shipped
#                 for the embedded model, K=3; `make setup` prepares it)
#   SPEC_CONFIG   vLLM --speculative-config JSON (overrides SPEC, and runs it as given: no
#                 profile, no adaptation)
#   SPEC_ADAPT    full (default), acceptance or off: how the preset's worker chooses K each
#                 step, starting from the profile shipped for the embedded model
#                 (engine_configs/profiles/smollm2-135m-instruct/<SPEC>.profile.json):
#                 full follows measured acceptance and step times, so speculation backs off
#                 to K=0 where it does not pay (under load); off runs the profile's
#                 batch-size schedule as it is (docs/speculative_decoding.md)
#   MODEL         model name or directory (default: smollm2-135m-instruct)
#   HTTP_PORT     frontend port (default 8000)
#   WORKER_ARGS   extra worker flags, e.g. "--extra-engine-args engine_configs/ngram.yaml"
#   FRONTEND_ARGS frontend flags (default for the embedded model: its tools-capable chat
#                 template and `--tool-call-parser hermes`, so `tools` work out of the box;
#                 FRONTEND_ARGS="" keeps the model's own template)
#   SUPERVISE     1 (default): the worker runs under python -m dynamo.runtime.supervise and is
#                 started again after a back-off when it dies; 0: unsupervised
#   SUPERVISE_ARGS extra supervisor flags, e.g. "--max-restarts 5"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SPEC=${SPEC:-ngram}
case "$SPEC" in
  ngram) preset='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}' ;;
  eagle3)
    if [[ "$(basename "$MODEL")" != smollm2-135m-instruct ]]; then
      echo "SPEC=eagle3 uses the head trained for smollm2-135m-instruct, not $MODEL;" \
        "train one (python -m dynamo.vllm.train_eagle3) and pass it in SPEC_CONFIG" >&2
      exit 2
    fi
    preset='{"method": "eagle3", "model": "smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3}' ;;
  *) echo "SPEC must be ngram or eagle3, not '$SPEC' (or set SPEC_CONFIG)" >&2; exit 2 ;;
esac
SPEC_ARGS=()
if [[ -z "${SPEC_CONFIG:-}" ]]; then
  SPEC_CONFIG=$preset
  # The shipped profiles are measured on the embedded model: another model gets the preset's
  # static K (profile it with python -m dynamo.vllm.profile_spec to adapt).
  profile="$ROOT/engine_configs/profiles/smollm2-135m-instruct/$SPEC.profile.json"
  if [[ "$(basename "$MODEL")" == smollm2-135m-instruct ]]; then
    SPEC_ARGS=(--speculation-profile "$profile" --speculation-adapt "${SPEC_ADAPT:-full}")
  fi
fi

ensure_nats
start frontend "$PYTHON" -m dynamo.frontend --http-port "$HTTP_PORT" --namespace "$NAMESPACE" \
  "${FRONTEND_FLAGS[@]}"
# shellcheck disable=SC2086
start_supervised worker "$PYTHON" -m dynamo.vllm --model "$MODEL" --namespace "$NAMESPACE" \
  --enforce-eager --block-size 32 --max-model-len "${MAX_MODEL_LEN:-4096}" \
  --speculative-config "$SPEC_CONFIG" "${SPEC_ARGS[@]}" ${WORKER_ARGS:-}
SERVED=${SERVED_MODEL_NAME:-$(basename "$MODEL")}
wait_for_model "$SERVED"
print_usage_hint "$SERVED"
wait_children
