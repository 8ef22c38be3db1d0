"""`python -m dynamo.vllm` as a process: --dry-run, bad configuration, --help.

Each run imports vLLM (about 10 s on two cores), so the claims are grouped into three runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from dynamo.testing.module_runs import OFFLINE, run_module

CONFIG_DIR = Path(__file__).resolve().parents[3] / "engine_configs"


def run_worker(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_module("dynamo.vllm", *argv, env=OFFLINE, unset=("DYN_SYSTEM_PORT",), timeout=180)


def test_dry_run_prints_resolved_yaml_and_exits_0(tiny_model: Path) -> None:
    # tiny_model has a config.json and no weights: a dry run that loaded anything would fail.
    result = run_worker(
        "--model",
        str(tiny_model),
        "--extra-engine-args",
        str(CONFIG_DIR / "ngram.yaml"),
        "--max-model-len",
        "1024",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    document = yaml.safe_load(result.stdout)
    assert document["worker"]["served_model_name"] == "tiny-llama"
    assert document["engine"]["speculative_config"] == {
        "num_speculative_tokens": 3,
        "method": "ngram",
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    assert document["engine"]["max_model_len"] == 1024
    assert document["sources"]["max_model_len"] == "cli"
    assert document["sources"]["max_num_seqs"] == "extra-engine-args (max_batch_size)"


def test_prefill_and_decode_together_exit_2_with_a_clear_message(tiny_model: Path) -> None:
    result = run_worker(
        "--model", str(tiny_model), "--is-prefill-worker", "--is-decode-worker", "--dry-run"
    )
    assert result.returncode == 2
    assert "--is-prefill-worker and --is-decode-worker are mutually exclusive" in result.stderr
    assert result.stdout == ""


def test_help_explains_runtime_flags_and_precedence() -> None:
    result = run_worker("--help")
    assert result.returncode == 0
    text = result.stdout
    for flag in (
        "--namespace",
        "--component",
        "--endpoint",
        "--is-prefill-worker",
        "--is-decode-worker",
        "--disaggregation-mode",
        "--extra-engine-args",
        "--migration-limit",
        "--system-port",
        "--kv-events-port",
        "--nats-server",
        "--lease-ttl",
        "--drain-timeout",
        "--dry-run",
    ):
        assert flag in text, flag
    assert "lowest precedence first" in text
    assert "--help=all" in text
    assert "SpeculativeConfig" in text or "VllmConfig" in text  # vLLM's groups are listed
