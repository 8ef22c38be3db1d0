"""The example files in engine_configs/: each parses, translates and resolves; each
TensorRT-LLM file means the same engine as its native twin; each says what it is for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod
from vllm.engine.arg_utils import AsyncEngineArgs

from dynamo.llm.models import model_dir
from dynamo.vllm.config.args import parse_worker_args
from dynamo.vllm.config.speculative_resolution import SRC_PREFIX_DEFAULT, keep_whole_prefix_hit
from dynamo.vllm.speculative import config_sources as sc

CONFIG_DIR = Path(__file__).resolve().parents[3] / "engine_configs"
ALL_FILES = sorted(CONFIG_DIR.rglob("*.yaml"))
ENGINE_FIELDS = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
SPEC_FIELDS = {f.name for f in dataclasses.fields(SpeculativeConfig)}

# TensorRT-LLM form -> native vLLM form of the same engine.
TWINS = {
    "ngram.yaml": "native/ngram.yaml",
    "draft_target.yaml": "native/draft_model.yaml",
    "eagle3_agg.yaml": "native/eagle3_agg.yaml",
    "eagle_prefill.yaml": "native/eagle_prefill.yaml",
    "eagle_decode.yaml": "native/eagle_decode.yaml",
    "mtp_decode.yaml": "native/mtp_decode.yaml",
    "eagle3_smollm2.yaml": "native/eagle3_smollm2.yaml",
}


def translate(path: Path) -> sc.EngineFileConfig:
    return sc.translate_engine_config(
        sc.load_engine_file(path), ENGINE_FIELDS, speculative_fields=SPEC_FIELDS
    )


def test_the_promised_examples_exist() -> None:
    names = {str(p.relative_to(CONFIG_DIR)) for p in ALL_FILES}
    assert set(TWINS) | set(TWINS.values()) <= names


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_file_translates_to_a_vllm_method(path: Path) -> None:
    out = translate(path)
    assert out.speculative is not None
    assert out.speculative["method"] in set(SpeculativeMethod.__args__)
    assert set(out.speculative) <= SPEC_FIELDS
    assert out.form == ("native" if path.parent.name == "native" else "tensorrt-llm")


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_file_resolves_into_a_worker_config(path: Path, tiny_model: Path) -> None:
    mode = next((m for m in ("prefill", "decode") if m in path.stem), "agg")
    cfg = parse_worker_args(
        [
            "--model",
            str(tiny_model),
            "--extra-engine-args",
            str(path),
            "--disaggregation-mode",
            mode,
            "--dry-run",
        ]
    )
    assert cfg.disaggregation_mode == mode
    expected, resolved = translate(path).speculative, cfg.speculative_config
    if keep_whole_prefix_hit(expected):  # the worker's default for Eagle, on top of the file
        assert cfg.sources["speculative_config.disable_eagle_block_drop"] == SRC_PREFIX_DEFAULT
    assert {k: v for k, v in resolved.items() if k != "model"} == {
        k: v for k, v in expected.items() if k != "model"
    }
    if "model" in expected:  # embedded model names become their directory
        assert resolved["model"] in (expected["model"], str(model_dir(expected["model"])))


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_file_says_what_it_is_for(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 20


@pytest.mark.parametrize(("trtllm", "native"), sorted(TWINS.items()))
def test_trtllm_file_means_the_same_engine_as_its_native_twin(trtllm: str, native: str) -> None:
    ours, theirs = translate(CONFIG_DIR / trtllm), translate(CONFIG_DIR / native)
    assert ours.engine == theirs.engine
    assert ours.speculative == theirs.speculative
    assert theirs.ignored == []


def test_files_that_need_no_draft_checkpoint_use_no_path_outside_the_repo() -> None:
    for name in (
        "ngram.yaml",
        "draft_target.yaml",
        "native/ngram.yaml",
        "native/ngram_dynamic.yaml",
        "native/draft_model.yaml",
    ):
        spec = translate(CONFIG_DIR / name).speculative
        assert spec.get("model") in (None, "smollm2-135m-instruct"), name
