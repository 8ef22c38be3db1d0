#!/usr/bin/env bash
# Runs every benchmark in sequence and prints each one's summary (`make bench`).
#
#   benchmarks/run_all.sh           full runs (about 45 minutes on 2 cores), results in
#                                   benchmarks/results/
#   QUICK=1 benchmarks/run_all.sh   quick smoke runs (about 20 minutes), results in
#                                   benchmarks/results/quick/ (full results stay untouched)
#
# Order: runtime (NATS), kv indexer (alone), overhead (vLLM direct vs dynamo), scale (the
# stack on nearly free mockers vs ai-dynamo 1.6.1), kv routing (kv vs round-robin, two
# workers), kv tiers (mockers without and with a host tier), the busy queue (a burst on
# two mockers), disaggregation (1 prefill + 1 decode
# vs 1 worker), once with both engines on all cores (as launch/disagg.sh) and once with
# split cores, conditional vs always-remote prefill, structured output, beam search (vLLM's server vs this stack), speculative decoding.
# Each benchmark's whole console output goes to <results>/<name>.log as well. A benchmark
# that fails does not stop the others; the script exits 1 at the end if any failed.
# Run it on a quiet machine: the serving benchmarks measure wall-clock latencies.
# PYTHON overrides the interpreter (default: .venv/bin/python).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-.venv/bin/python}
if [[ ! -x "$PY" ]]; then
  echo "run_all.sh: no Python at $PY; run 'make setup' first (or set PYTHON)" >&2
  exit 1
fi

QUICK=${QUICK:-0}
if [[ "$QUICK" == 1 ]]; then
  OUT=benchmarks/results/quick
  MODE="quick"
  RUNTIME_ARGS=(--requests 200 --items 10000)
  INDEXER_ARGS=(--blocks 100000 --workers 16 --queries 2000)
  SERVING_ARGS=(--quick)
else
  OUT=benchmarks/results
  MODE="full"
  RUNTIME_ARGS=()
  INDEXER_ARGS=()
  SERVING_ARGS=()
fi
mkdir -p "$OUT"

NAMES=()
FAILED=()
declare -A MARKERS=()

# run NAME SUMMARY_REGEX CMD...: run CMD with its output shown and saved to $OUT/NAME.log;
# the summary is the log from the first line matching SUMMARY_REGEX to the end.
run() {
  local name=$1 marker=$2
  shift 2
  local log="$OUT/$name.log" started=$SECONDS
  NAMES+=("$name")
  MARKERS[$name]=$marker
  printf '\n=== %s (%s): %s\n' "$name" "$MODE" "$*"
  if "$@" 2>&1 | tee "$log"; then
    printf '=== %s done in %ds\n' "$name" $((SECONDS - started))
  else
    printf '=== %s FAILED after %ds (log: %s)\n' "$name" $((SECONDS - started)) "$log"
    FAILED+=("$name")
  fi
}

# serving NAME SUMMARY_REGEX SCRIPT RESULT_FLAG [ARGS...]: `run` the serving benchmark
# benchmarks/SCRIPT with the mode's SERVING_ARGS and ARGS, its JSON written to
# $OUT/NAME.json (RESULT_FLAG names that file to SCRIPT: --json or --out).
serving() {
  local name=$1 marker=$2 script=$3 result_flag=$4
  shift 4
  run "$name" "$marker" \
    "$PY" "benchmarks/$script" "${SERVING_ARGS[@]}" "$@" "$result_flag" "$OUT/$name.json"
}

summary() {
  local name=$1
  printf '\n--- %s\n' "$name"
  if [[ " ${FAILED[*]-} " == *" $name "* ]]; then
    echo "FAILED; last lines of $OUT/$name.log:"
    tail -n 15 "$OUT/$name.log"
  else
    sed -n "/${MARKERS[$name]}/,\$p" "$OUT/$name.log"
  fi
}

run runtime '^runtime benchmark' \
  "$PY" benchmarks/runtime_bench.py "${RUNTIME_ARGS[@]}"
# runtime_bench.py writes no JSON: its console output is the result.
cp "$OUT/runtime.log" "$OUT/runtime.txt"
run kv_indexer '^KV indexer' \
  "$PY" benchmarks/kv_indexer_bench.py "${INDEXER_ARGS[@]}" --output "$OUT/kv_indexer.json"
serving overhead '^metric ' overhead_bench.py --json
# The stack's own cost on nearly free mockers, against ai-dynamo 1.6.1 when it installs.
serving scale '^scale bench results' scale_bench.py --json
serving kv_routing '^kv vs round-robin' kv_routing_bench.py --out
# A burst of 3x the capacity of two simulated workers: the busy queue against a 503.
serving queue '^busy queue vs' queue_bench.py --json
# The same with two requests in flight: the router now trades cache hits for load balance.
serving kv_routing_c2 '^kv vs round-robin' kv_routing_bench.py --out --concurrency 2
# A working set larger than the mockers' device tiers: without and with a host tier.
serving kv_tier '^kv tiers:' kv_tier_bench.py --json
serving disagg '^disaggregated vs aggregated' disagg_bench.py --json
# The same with the prefill and decode engines on separate halves of the cores.
serving disagg_split '^disaggregated vs aggregated' disagg_bench.py --json --split-cores
# Always-remote vs conditional prefill on a mocker fleet and on 1 prefill + 1 decode vLLM,
# and TTFT against prompt length (the default --disagg-local-prefill-tokens).
serving disagg_conditional '^== mocker: always-remote' conditional_disagg_bench.py --json --sweep
# The SLA planner against fleets sized for the trace's mean and peak (mocker workers fitted
# to the embedded model's profile); 4-minute traces here, docs/benchmarks.md's are longer.
serving planner '^topology  *setup' planner_bench.py --json --minutes 4 --speculation-minutes 3
serving structured_output '^structured output vs' structured_output_bench.py --json
serving beam_search '^beam search: this stack' beam_search_bench.py --json
serving spec_decode '^speculative decoding vs none' spec_decode_bench.py --json
# None vs static K vs the profiled K schedule at c=1..32 (profiles first, once, when
# engine_configs/profiles/smollm2-135m-instruct/eagle3.profile.json is missing).
serving spec_dynamic '^dynamic speculation' spec_decode_bench.py --json --dynamic

printf '\n=================== summaries (%s runs, %s cores, load average %s)\n' \
  "$MODE" "$(nproc)" "$(cut -d' ' -f1-3 /proc/loadavg)"
for name in "${NAMES[@]}"; do
  summary "$name"
done
printf '\nresults and logs: %s/\n' "$OUT"
echo "what each benchmark measures, the commands and the targets: docs/benchmarks.md"
if ((${#FAILED[@]})); then
  echo "FAILED: ${FAILED[*]}" >&2
  exit 1
fi
