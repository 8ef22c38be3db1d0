#!/usr/bin/env bash
# One-command, idempotent setup: virtualenv, the right vLLM build, the embedded model.
# Called by `make setup` (and so by `make run` / `make test`). A second run is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.dynamo-setup"
MODEL=${DYN_DEFAULT_MODEL:-smollm2-135m-instruct}
# The Eagle3 head shipped for the default model (dynamo/llm/models/heads), prepared beside it.
HEAD=smollm2-135m-instruct-eagle3
# The Eagle3 checkpoint format and training utilities. Installed without their declared
# dependencies: speculators asks for torchvision/torchaudio (CUDA builds that break
# `import transformers` beside the +cpu torch) and hs-connectors for a CUDA torch; what they
# import besides (datasets, transformers) comes with the project's extras.
SPECULATORS="speculators==0.9.0 hs-connectors==0.9.0"

step_start=$(date +%s)
say() { printf '[setup %4ss] %s\n' "$(( $(date +%s) - step_start ))" "$*"; }

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  say "error: Python 3.11 or newer is needed ($PYTHON is $("$PYTHON" --version 2>&1 | head -n 1)); run with PYTHON=python3.11 (or newer)" >&2
  exit 1
fi

# The extra follows the hardware: the CUDA build where an NVIDIA GPU is visible, else CPU.
if [[ -n "${DYN_EXTRA:-}" ]]; then
  extra=$DYN_EXTRA
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi

# What the installed environment must match: dependency spec + extra + interpreter.
want="$(sha256sum pyproject.toml | cut -c1-16) extra=$extra py=$($PYTHON -c 'import sys; print("%d.%d" % sys.version_info[:2])') $SPECULATORS"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
   && "$VENV/bin/python" -m dynamo.llm.models path "$MODEL" >/dev/null 2>&1 \
   && { [[ "$MODEL" != smollm2-135m-instruct ]] || "$VENV/bin/python" -m dynamo.llm.models path "$HEAD" >/dev/null 2>&1; }; then
  say "ready: $VENV ($extra build) and model $MODEL already prepared; nothing to do"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating virtualenv $VENV with $($PYTHON --version)"
  $PYTHON -m venv "$VENV"
fi

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  say "installing the project with extras [$extra,dev] (vLLM, torch, NATS, ...): this takes a few minutes"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip 'setuptools>=70' wheel
  pip_log="$VENV/setup-pip.log"
  "$VENV/bin/python" -m pip install --progress-bar off -e ".[$extra,dev]" >"$pip_log" 2>&1 &
  pip_pid=$!
  while kill -0 "$pip_pid" 2>/dev/null; do
    sleep 20
    kill -0 "$pip_pid" 2>/dev/null && say "still installing ($(grep -c '^\(Collecting\|Processing\)' "$pip_log" || true) packages resolved so far)"
  done
  if ! wait "$pip_pid"; then
    tail -n 30 "$pip_log" >&2
    say "error: pip install failed; full log in $pip_log" >&2
    exit 1
  fi
  say "$(grep -o '^Successfully installed.*' "$pip_log" | wc -w | awk '{print $1 - 2}') packages installed (log: $pip_log)"
  if ! "$VENV/bin/python" -c 'import vllm, nats, msgspec' 2>/dev/null; then
    say "error: the install did not complete (import vllm/nats/msgspec failed); see $pip_log" >&2
    exit 1
  fi
  if [[ "$extra" == cpu ]]; then
    # PyPI's torchvision/torchaudio/torchcodec are built against the CUDA torch and break
    # `import transformers` beside a +cpu torch ("operator torchvision::nms does not exist").
    say "removing torchvision/torchaudio/torchcodec (incompatible with the +cpu torch)"
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  say "installing $SPECULATORS (--no-deps)"
  # shellcheck disable=SC2086  # two requirement words
  "$VENV/bin/python" -m pip install --quiet --no-deps $SPECULATORS >>"$pip_log" 2>&1 \
    || { tail -n 20 "$pip_log" >&2; say "error: installing $SPECULATORS failed; see $pip_log" >&2; exit 1; }
  "$VENV/bin/python" -c 'from speculators.models.eagle3 import Eagle3SpeculatorConfig' \
    || { say "error: speculators does not import" >&2; exit 1; }
  "$VENV/bin/python" -c 'import dynamo.runtime, dynamo.llm, dynamo.vllm, dynamo.frontend' \
    || { say "error: project packages do not import" >&2; exit 1; }
  say "installed"
fi

say "preparing the embedded model $MODEL"
"$VENV/bin/python" -m dynamo.llm.models prepare "$MODEL"
if [[ "$MODEL" == smollm2-135m-instruct ]]; then
  say "preparing its Eagle3 head $HEAD"
  "$VENV/bin/python" -m dynamo.llm.models prepare "$HEAD"
fi

echo "$want" > "$STAMP"
say "setup complete"
