"""Bad configuration stops `python -m dynamo.vllm` before anything is loaded.

Claims: a missing or malformed `--extra-engine-args` file, a `--speculative-config` that
is not a JSON object (or not JSON), a draft length that is not positive, a draft path
that does not exist, and a value vLLM's own configuration rejects each end the process
with exit code 2 and ONE `error:` line naming the source and the key, no traceback, and no
engine: the runs use a model directory holding only a `config.json`, so an engine start
would fail differently (exit 1, a traceback), and no engine-core output may appear.

The process runs are real starts (no `--dry-run`). Each imports vLLM, 7-14 s on two
cores. They are not timed: the exit code, the one line and the absent engine output
already tell a stop before loading from an engine start, and a time bound failed once
where three test processes shared the two cores.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest
from vllm_config_support import speculators_config, write_config

from dynamo.testing.module_runs import OFFLINE, run_module
from dynamo.vllm.config.args import ConfigError, parse_worker_args

ENGINE_MARKERS = ("Loading weights", "EngineCore", "Traceback", "Initializing a V1 LLM engine")


def start_worker(model: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run a real worker start (no --dry-run)."""
    return run_module(
        "dynamo.vllm",
        *("--model", str(model), "--block-size", "32", *argv),
        env=OFFLINE,
        unset=("DYN_SYSTEM_PORT",),
        timeout=300,
    )


def the_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single `error:` line, which must also be the last line on stderr."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert lines[-1] == errors[0], f"lines after the error:\n{result.stderr[-3000:]}"
    return errors[0]


def _bad_cases(tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (extra argv, substrings the error line must contain)."""
    broken = tmp / "broken.yaml"
    broken.write_text("max_model_len: 512\nspeculative_config: {method: ngram\n")
    k_zero = tmp / "k0.yaml"
    k_zero.write_text(
        "speculative_config:\n  method: ngram\n  num_speculative_tokens: 0\n"
        "  prompt_lookup_max: 3\n"
    )
    missing_draft = tmp / "no-such-draft"
    return {
        "missing-file": (
            ["--extra-engine-args", str(tmp / "absent.yaml")],
            [f"--extra-engine-args {tmp / 'absent.yaml'}", "No such file"],
        ),
        "malformed-yaml": (
            ["--extra-engine-args", str(broken)],
            [f"--extra-engine-args {broken}", "not valid YAML", "line 3"],
        ),
        "json-not-an-object": (
            ["--speculative-config", "[1, 2]"],
            ["--speculative-config", "must be a JSON object"],
        ),
        "json-not-json": (
            ["--speculative-config", "{method: ngram}"],
            ["--speculative-config", "not valid JSON"],
        ),
        "k-zero-in-file": (
            ["--extra-engine-args", str(k_zero)],
            [f"--extra-engine-args {k_zero}", "speculative_config.num_speculative_tokens", "got 0"],
        ),
        "k-negative-in-json": (
            ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": -1})],
            ["--speculative-config", "num_speculative_tokens", "positive integer", "got -1"],
        ),
        "draft-path-missing": (
            [
                "--speculative-config",
                json.dumps(
                    {"method": "eagle3", "model": str(missing_draft), "num_speculative_tokens": 3}
                ),
            ],
            ["speculative_config.model", "--speculative-config", str(missing_draft), "not exist"],
        ),
        "rejected-by-vllm": (  # tiny_model's max_position_embeddings is 4096
            ["--max-model-len", "100000"],
            ["vLLM rejected the configuration", "max_model_len", "100000"],
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing-file",
        "malformed-yaml",
        "json-not-an-object",
        "json-not-json",
        "k-zero-in-file",
        "k-negative-in-json",
        "draft-path-missing",
        "rejected-by-vllm",
    ],
)
def test_bad_input_exits_2_with_one_line_before_loading(
    case: str, tiny_model: Path, tmp_path: Path
) -> None:
    argv, expected = _bad_cases(tmp_path)[case]
    result = start_worker(tiny_model, *argv)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    line = the_error_line(result)
    for text in expected:
        assert text in line, f"{text!r} not in {line!r}"
    for marker in ENGINE_MARKERS:
        assert marker not in output, f"{marker!r} in the output:\n{output[-3000:]}"


# --------------------------------------------------------------------------- in process


def test_every_spelling_of_the_draft_length_is_checked(tmp_path: Path, tiny_model: Path) -> None:
    def start(*argv: str) -> None:
        parse_worker_args(["--model", str(tiny_model), *argv])

    trt = tmp_path / "trt.yaml"
    trt.write_text("speculative_config: {decoding_type: NGram, max_draft_len: 0}\n")
    with pytest.raises(ConfigError, match=rf"{trt} speculative_config: max_draft_len must be"):
        start("--extra-engine-args", str(trt))
    mtp = tmp_path / "mtp.yaml"
    mtp.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: -2}\n")
    with pytest.raises(ConfigError, match="num_nextn_predict_layers must be a positive integer"):
        start("--extra-engine-args", str(mtp))
    with pytest.raises(ConfigError, match="--spec-tokens must be a positive integer, got 0"):
        start("--spec-method", "ngram", "--spec-tokens", "0")
    with pytest.raises(ConfigError, match="num_speculative_tokens must be a positive integer"):
        start("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2.5}')
    checkpoint = write_config(tmp_path / "ckpt", speculators_config(str(tiny_model), tokens=0))
    with pytest.raises(ConfigError, match=r"proposal_methods\[\]\.speculative_tokens must be"):
        parse_worker_args(["--model", str(checkpoint)])


def test_draft_paths_and_hub_ids(
    tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def start(model: str, *extra: str):
        spec = {"method": "eagle3", "model": model, "num_speculative_tokens": 3}
        return parse_worker_args(
            ["--model", str(tiny_model), "--speculative-config", json.dumps(spec), *extra]
        )

    a_file = tmp_path / "draft.safetensors"
    a_file.write_bytes(b"")
    with pytest.raises(ConfigError, match="is not a directory"):
        start(str(a_file))
    with pytest.raises(ConfigError, match="does not exist"):
        start("./relative/draft")
    # A dry run shows what a template resolves to before its draft exists: a warning.
    with caplog.at_level(logging.WARNING, logger="dynamo.vllm"):
        cfg = start("/models/EAGLE3-draft", "--dry-run")
    assert cfg.speculative_config["model"] == "/models/EAGLE3-draft"
    assert any("a real start refuses it" in r.getMessage() for r in caplog.records)
    # A hub id may sit in the Hugging Face cache: left to vLLM, with a warning.
    cfg = start("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert cfg.speculative_config["model"] == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
