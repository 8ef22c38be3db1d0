"""`--generation-config`: the worker reads the model's sampling defaults through vLLM's own
`ModelConfig.get_diff_sampling_param()` and turns them into the card's `SamplingDefaults`.

Claims: `auto` (the default) reads the model directory's generation_config.json, `vllm`
ignores it, a directory reads that directory's file, `--override-generation-config` adds to
it, and `max_new_tokens` becomes `max_tokens`; a directory that does not exist or holds no
generation_config.json is refused before anything loads (vLLM would serve silently without
defaults); a value of the wrong type is dropped, not fatal. The ModelConfig is vLLM's real
one, built from a config-only model directory (no weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.llm.protocols import ModelCard, SamplingDefaults, decode, encode
from dynamo.vllm.config.args import ConfigError, parse_worker_args
from dynamo.vllm.config.sampling_defaults import check_generation_config, sampling_defaults_from


def write_generation_config(directory: Path, **values: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return directory


def card_defaults(model: Path, *argv: str) -> SamplingDefaults | None:
    """What the worker would advertise for `--model model argv...`."""
    cfg = parse_worker_args(["--model", str(model), *argv])
    diff = cfg.engine_args.create_model_config().get_diff_sampling_param()
    return sampling_defaults_from(diff)


def test_generation_config_modes_follow_vllm_serve(tiny_model: Path, tmp_path: Path) -> None:
    write_generation_config(tiny_model, do_sample=True, temperature=0.3, top_p=0.8, top_k=20)
    other = write_generation_config(tmp_path / "other", do_sample=True, temperature=0.7)

    assert card_defaults(tiny_model) == SamplingDefaults(temperature=0.3, top_p=0.8, top_k=20)
    assert card_defaults(tiny_model, "--generation-config", "vllm") is None
    assert card_defaults(tiny_model, "--generation-config", str(other)) == SamplingDefaults(
        temperature=0.7
    )
    overridden = card_defaults(
        tiny_model, "--override-generation-config", '{"temperature": 0.1, "max_new_tokens": 64}'
    )
    assert overridden == SamplingDefaults(temperature=0.1, top_p=0.8, top_k=20, max_tokens=64)


def test_bad_generation_config_directory_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        parse_worker_args(["--model", str(tiny_model), "--generation-config", str(tmp_path / "x")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"no generation_config\.json"):
        parse_worker_args(["--model", str(tiny_model), "--generation-config", str(empty)])
    for keyword in ("auto", "vllm", None):
        check_generation_config(keyword)


def test_values_of_the_wrong_type_are_dropped_not_fatal() -> None:
    defaults = sampling_defaults_from({"temperature": "hot", "top_p": 0.9, "top_k": 1.5})
    assert defaults == SamplingDefaults(top_p=0.9)
    assert sampling_defaults_from({}) is None


def test_defaults_travel_on_the_card_and_are_omitted_when_absent() -> None:
    card = ModelCard(
        name="m",
        namespace="n",
        component="c",
        endpoint="e",
        instance_id=1,
        sampling_defaults=SamplingDefaults(temperature=0.2, top_p=0.9),
    )
    assert decode(encode(card), ModelCard).sampling_defaults == card.sampling_defaults
    bare = ModelCard(name="m", namespace="n", component="c", endpoint="e", instance_id=1)
    assert b"sampling_defaults" not in encode(bare)
    assert b"top_k" not in encode(card)  # omit_defaults: unset fields do not travel
