"""Fixtures for the worker configuration tests (see `vllm_config_support`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_config_support import TINY_DEEPSEEK_V3, TINY_LLAMA, speculators_config, write_config

from dynamo.vllm.config.args import parse_worker_args


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    """A Llama target with 8 layers (Eagle3's default aux layers need more than 4)."""
    return write_config(tmp_path / "tiny-llama", TINY_LLAMA)


@pytest.fixture
def eagle3_draft(tmp_path: Path) -> Path:
    """An Eagle3 draft: named like any directory, recognised by its config alone."""
    config = {
        **TINY_LLAMA,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": 500,
        "target_hidden_size": 64,
    }
    return write_config(tmp_path / "draft-a", config)


@pytest.fixture
def eagle1_draft(tmp_path: Path) -> Path:
    """An Eagle(1) draft: a one-layer copy of the target's architecture."""
    return write_config(tmp_path / "draft-b", {**TINY_LLAMA, "num_hidden_layers": 1})


@pytest.fixture
def speculators_checkpoint(tmp_path: Path, tiny_model: Path) -> Path:
    """A speculators checkpoint whose verifier is `tiny_model`, named relative to it."""
    return write_config(tmp_path / "spec-ckpt", speculators_config("../tiny-llama"))


@pytest.fixture
def tiny_mtp_model(tmp_path: Path) -> Path:
    """A DeepSeek-V3-shaped target with one MTP layer."""
    return write_config(tmp_path / "tiny-dsv3", TINY_DEEPSEEK_V3)


@pytest.fixture
def write_yaml(tmp_path: Path):
    """Write YAML text to a file in tmp_path and return its path."""

    def write(text: str, name: str = "engine.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture
def parse(tiny_model: Path):
    """parse_worker_args with the tiny model and --dry-run (nothing is ever prepared)."""

    def run(*argv: str):
        return parse_worker_args(["--model", str(tiny_model), "--dry-run", *argv])

    return run
