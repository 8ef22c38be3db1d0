"""The profiler's command line: what it accepts, what it refuses and how it says so."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import pytest

from dynamo.llm.speculation_profile import SpeculationProfile, StepTimes
from dynamo.runtime.cli import ConfigError
from dynamo.vllm import profile_spec
from dynamo.vllm.speculative.profile_plot import plot_profile

NGRAM = '{"method": "ngram", "prompt_lookup_max": 3}'


def parse(*extra: str) -> argparse.Namespace:
    base = ["--model", "m", "--speculative-config", NGRAM, "--out", "p.json"]
    return profile_spec.build_parser().parse_args([*base, *extra])


def test_defaults_sweep_the_issue_batch_sizes_up_to_k5() -> None:
    args = parse()
    assert args.batch_sizes == [1, 2, 4, 8, 16, 32]
    assert args.max_k == 5
    assert args.speculative_config == {"method": "ngram", "prompt_lookup_max": 3}
    profile_spec.check_args(args)


def test_batch_sizes_are_sorted_and_deduplicated() -> None:
    assert parse("--batch-sizes", "8,1,4,4").batch_sizes == [1, 4, 8]


@pytest.mark.parametrize("text", ["1,x", "0,4", ""])
def test_bad_batch_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        profile_spec.parse_batch_sizes(text)


@pytest.mark.parametrize("text", ["{", "[1]", '{"model": "x"}'])
def test_speculative_config_must_be_an_object_with_a_method(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        profile_spec.parse_spec_config(text)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-k", "0"], "--max-k must be at least 1"),
        (["--output-tokens", "1"], "--output-tokens must be at least 2"),
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
        (["--prompts", "/nonexistent/prompts.jsonl"], "is not a file"),
    ],
)
def test_check_args_refuses_what_cannot_be_measured(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        profile_spec.check_args(parse(*argv))


def test_k_in_the_config_is_refused_because_k_is_what_is_swept() -> None:
    args = profile_spec.build_parser().parse_args(
        ["--model", "m", "--out", "p.json", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3}']
    )  # fmt: skip
    with pytest.raises(ConfigError, match="leave num_speculative_tokens out"):
        profile_spec.check_args(args)


def test_k_zero_is_the_speculating_engine_drafting_nothing() -> None:
    spec = {"method": "eagle3", "model": "/heads/e3"}
    assert profile_spec.spec_for_k(spec, 2, 32) == {**spec, "num_speculative_tokens": 2}
    assert profile_spec.spec_for_k(spec, 0, 32) == {
        **spec, "num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, 32, 0]]
    }  # fmt: skip


def test_a_plain_engine_is_measured_first_for_every_method() -> None:
    assert profile_spec.planned_runs(2) == [None, 0, 1, 2]


def test_bundled_prompts_are_cycled_to_the_number_needed() -> None:
    prompts, source = profile_spec.load_prompts(None, 100)
    assert len(prompts) == 100 and "bundled" in source
    assert prompts[0] == prompts[profile_spec.BUNDLED_PROMPTS]
    assert prompts[0][0]["role"] == "user"


def test_user_prompts_are_read_and_bad_lines_named(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "yo"}]}) + "\n")  # fmt: skip
    prompts, source = profile_spec.load_prompts(good, 3)
    assert [p[-1]["content"] for p in prompts] == ["hi", "yo", "hi"] and source == str(good)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1"):
        profile_spec.load_prompts(bad, 1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        profile_spec.load_prompts(empty, 1)


def test_summary_marks_the_winner_and_the_plot_is_written(tmp_path: Path) -> None:
    profile = SpeculationProfile(
        model="m", method="ngram", speculative_config={"method": "ngram"}, batch_sizes=[1, 8],
        acceptance_per_position=[0.5], schedule=[[1, 4, 1], [5, 8, 0]], max_batch_size=8,
        step_times=[StepTimes(k=0, step_ms=[10.0, 20.0]), StepTimes(k=1, step_ms=[12.0, 40.0])],
    )  # fmt: skip
    text = profile_spec.summary(profile)
    assert "[[1, 4, 1], [5, 8, 0]]" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()[:1].isdigit()}
    assert lines["1"].split()[1:] == ["100.0", "125.0*", "100.0"]  # K=1 wins at batch 1
    assert lines["8"].split()[1:] == ["400.0*", "300.0", "400.0"]  # K=0 at batch 8
    assert "note:" not in text
    # A drafter that costs at K=0: the summary says where the schedule trails a plain engine.
    costly = msgspec.structs.replace(profile, no_speculation_step_ms=[9.0, 16.0])
    assert "note: at batch 8 the schedule reaches 0.80x" in profile_spec.summary(costly)
    assert plot_profile(profile, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert msgspec.json.decode(msgspec.json.encode(profile), type=SpeculationProfile) == profile


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        profile_spec.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--speculative-config", "--batch-sizes", "--max-k", "--prompts",
                 "--output-tokens", "--max-batch-size", "--out", "--no-plot"):  # fmt: skip
        assert flag in text
