#!/usr/bin/env bash
# Disaggregated serving with speculative decoding: as disagg.sh, with DECODE_SPEC_CONFIG
# (default n-gram, K=3) on the decode worker, where tokens are generated. The prefill worker
# gets the same config (PREFILL_SPEC_CONFIG overrides it): harmless for n-gram, and needed
# for MTP, Eagle and draft models, whose draft layers keep KV that must be handed over too.
export DECODE_SPEC_CONFIG=${DECODE_SPEC_CONFIG:-${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'}}
exec "$(dirname "${BASH_SOURCE[0]}")/disagg.sh"
