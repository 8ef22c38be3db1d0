"""`python -m dynamo.mocker` flags: parsing, help, and the engine config they build."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from dynamo.mocker.acceptance import acceptance_at
from dynamo.mocker.args import build_parser, float_list, parse_args
from dynamo.mocker.main import main
from dynamo.mocker.model_info import ModelInfo


def test_every_flag_is_explained() -> None:
    parser = build_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 25
    for action in flags:
        assert action.help and len(action.help) > 15, action.option_strings


def test_defaults_and_flags_reach_the_engine_config() -> None:
    args = parse_args(
        [
            "--num-workers",
            "3",
            "--block-size",
            "32",
            "--num-gpu-blocks",
            "1000",
            "--max-model-len",
            "2048",
            "--num-speculative-tokens",
            "3",
            "--acceptance-rate",
            "0.9,0.8,0.5",
            "--speed-up",
            "10",
            "--step-quantum-ms",
            "0",
            "--no-enable-prefix-caching",
            "--no-kv-events",
        ]
    )
    assert args.num_workers == 3 and not args.worker.publish_kv_events
    model = ModelInfo(Path("."), 500, (2,), frozenset({0, 1, 2}), 8192)
    cfg = args.engine.engine_config(model)
    assert (cfg.block_size, cfg.num_gpu_blocks, cfg.max_model_len) == (32, 1000, 2048)
    assert cfg.num_speculative_tokens == 3 and not cfg.enable_prefix_caching
    assert cfg.acceptance_model.per_position_rates() == pytest.approx([0.9, 0.72, 0.36])
    assert cfg.timing.speed_up == 10 and cfg.timing.quantum_ms == 0
    assert parse_args([]).engine.engine_config(model).timing.quantum_ms == 1.0
    assert (cfg.vocab_size, cfg.eos_token_ids, cfg.special_token_ids) == (500, (2,), {0, 1, 2})
    # Without --max-model-len the model's context length applies.
    assert parse_args([]).engine.engine_config(model).max_model_len == 8192


def test_acceptance_distribution_and_rates_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--acceptance-rate", "0.5", "--acceptance-distribution", "1,1"])
    args = parse_args(["--num-speculative-tokens", "1", "--acceptance-distribution", "1,3"])
    model = ModelInfo(Path("."), 500, (), frozenset(), None)
    assert args.engine.engine_config(model).acceptance_model.probabilities == (0.25, 0.75)


@pytest.mark.parametrize(
    "argv",
    [
        ["--speed-up", "0"],
        ["--step-quantum-ms", "-1"],
        ["--num-speculative-tokens", "2", "--acceptance-rate", "0.1,0.2,0.3"],
        ["--num-gpu-blocks", "4"],
    ],
)
def test_unusable_values_exit_with_code_2(
    argv: list[str], embedded_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--model", str(embedded_model)]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-workers", "0"],
        ["--lease-ttl", "0"],
        ["--system-port", "70000"],
        ["--drain-timeout", "-1"],
        ["--acceptance-rate", "high"],
    ],
)
def test_malformed_numbers_are_rejected_by_the_parser(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit code 2 with argparse's one-line `error: argument --flag: ...`."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert f"error: argument {argv[0]}" in capsys.readouterr().err


def test_acceptance_changes_over_time_follow_the_flags() -> None:
    args = parse_args(
        [
            "--num-speculative-tokens", "2", "--acceptance-rate", "0.9",
            "--acceptance-rate-after", "300:0.2", "--acceptance-rate-after", "60:0.5,0.4",
        ]
    )  # fmt: skip
    cfg = args.engine.engine_config(ModelInfo(Path("."), 500, (), frozenset(), None))
    assert [c.after_s for c in cfg.acceptance_changes] == [60.0, 300.0]  # in time order
    rates = [
        acceptance_at(cfg.acceptance_model, cfg.acceptance_changes, t).per_position_rates()
        for t in (0.0, 59.9, 60.0, 299.0, 301.0)
    ]
    assert rates == [
        pytest.approx([0.9, 0.81]), pytest.approx([0.9, 0.81]), pytest.approx([0.5, 0.2]),
        pytest.approx([0.5, 0.2]), pytest.approx([0.2, 0.04]),
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args(["--acceptance-rate-after", "0.3"])  # no time
    assert cfg.acceptance_epoch is None  # counted from the worker's start
    args = parse_args(["--acceptance-rate-after", "5:0.2", "--acceptance-clock-start", "1.7e9"])
    model = ModelInfo(Path("."), 500, (), frozenset(), None)
    assert args.engine.engine_config(model).acceptance_epoch == 1.7e9


def test_float_list_needs_a_number() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        float_list(",")


def test_model_info_of_the_embedded_model(embedded_model: Path) -> None:
    info = ModelInfo.load(embedded_model)
    assert info.vocab_size == 49152
    assert info.eos_token_ids == (2,)
    assert {0, 1, 2} <= info.special_token_ids
    assert info.max_position_embeddings == 8192


def test_model_info_without_config_uses_the_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(
        json.dumps(
            {
                "model": {"vocab": {"a": 0, "b": 1, "c": 7}},
                "added_tokens": [{"id": 9, "content": "<s>", "special": True}],
            }
        )
    )
    info = ModelInfo.load(tmp_path)
    assert (info.vocab_size, info.special_token_ids, info.eos_token_ids) == (10, {9}, ())
    with pytest.raises(ValueError):
        ModelInfo.load(tmp_path / "missing")


def test_unknown_model_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "/nonexistent/model-dir"]) == 2
    assert "--model" in capsys.readouterr().err
