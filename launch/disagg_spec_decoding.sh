#!/usr/bin/env bash
# Disaggregated serving with speculative decoding on the decode worker: as disagg.sh, with
# DECODE_SPEC_CONFIG (default n-gram, K=3) on the decode worker. Speculation only matters
# where tokens are generated, so the prefill worker runs without it.
export DECODE_SPEC_CONFIG=${DECODE_SPEC_CONFIG:-${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'}}
exec "$(dirname "${BASH_SOURCE[0]}")/disagg.sh"
