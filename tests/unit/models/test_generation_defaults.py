"""The embedded model's generation_config.json carries its authors' sampling defaults, and
a cache prepared before the recipe had them is upgraded in place by `prepare`.

Claims: the recipe recommends a low temperature and top_p below 1 (SmolLM2's model card:
0.2 and 0.9); `prepare_model` on a valid cache whose generation_config.json lacks them
merges them in (bos/eos/pad ids kept) without converting again (the stand-in weights stay
byte for byte), refreshes the manifest so the full check passes, and is a no-op after.
The cache is a stand-in directory with a real manifest: no torch, no weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.llm.models import DEFAULT_MODEL, get_recipe, prepare_model
from dynamo.llm.models.manifest import SourceInfo, build_manifest, check_model_dir, write_manifest

OLD_GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
FAKE_WEIGHTS = b"not really weights"


@pytest.fixture
def old_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A valid prepared directory as the recipe before sampling defaults built it."""
    recipe = get_recipe(DEFAULT_MODEL)
    target = tmp_path / "cache" / recipe.name
    target.mkdir(parents=True)
    for name in recipe.required_files:
        (target / name).write_text("{}\n")
    (target / "generation_config.json").write_text(json.dumps(OLD_GENERATION_CONFIG))
    (target / "model.safetensors").write_bytes(FAKE_WEIGHTS)
    source = SourceInfo(package="p", package_version="1", gguf_file="g.gguf", gguf_sha256="0")
    write_manifest(target, build_manifest(target, recipe, source))
    monkeypatch.setenv("DYN_MODEL_DIR", str(tmp_path / "cache"))
    assert check_model_dir(target, recipe, full=True) == []
    return target


def test_recipe_recommends_a_low_temperature_and_top_p_below_one() -> None:
    defaults = get_recipe(DEFAULT_MODEL).generation_defaults
    assert defaults["temperature"] <= 0.3
    assert defaults["top_p"] < 1.0
    assert defaults["do_sample"] is True  # transformers ignores temperature without it


def test_old_cache_is_upgraded_in_place(old_cache: Path) -> None:
    recipe = get_recipe(DEFAULT_MODEL)
    messages: list[str] = []
    assert prepare_model(DEFAULT_MODEL, log=messages.append) == old_cache
    config = json.loads((old_cache / "generation_config.json").read_text())
    assert config == {**OLD_GENERATION_CONFIG, **recipe.generation_defaults}
    assert (old_cache / "model.safetensors").read_bytes() == FAKE_WEIGHTS  # not rebuilt
    assert check_model_dir(old_cache, recipe, full=True) == []
    assert any("updated the sampling defaults" in m for m in messages), messages

    mtime = (old_cache / "generation_config.json").stat().st_mtime_ns
    messages.clear()
    prepare_model(DEFAULT_MODEL, log=messages.append)
    assert (old_cache / "generation_config.json").stat().st_mtime_ns == mtime
    assert not any("updated" in m for m in messages)
