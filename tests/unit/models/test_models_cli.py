"""The model cache: manifest checks, the resolver, and the CLI's answers to bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dynamo.llm.models import DEFAULT_MODEL, UnknownModelError, get_recipe, resolve_model
from dynamo.llm.models.manifest import MANIFEST_NAME, check_model_dir
from dynamo.testing.module_runs import run_module


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_module("dynamo.llm.models", *args, env=env)


def test_unknown_model_lists_known_ones_and_exits_2() -> None:
    result = run_cli("prepare", "gpt-17-ultra")
    assert result.returncode == 2
    assert "unknown model 'gpt-17-ultra'" in result.stderr
    assert DEFAULT_MODEL in result.stderr


def test_path_of_unprepared_model_exits_1(tmp_path: Path) -> None:
    result = run_cli("path", DEFAULT_MODEL, env={"DYN_MODEL_DIR": str(tmp_path)})
    assert result.returncode == 1
    assert "not prepared" in result.stderr


def test_list_reports_cache_and_state(tmp_path: Path) -> None:
    result = run_cli("list", env={"DYN_MODEL_DIR": str(tmp_path)})
    assert result.returncode == 0
    assert str(tmp_path) in result.stdout
    assert f"{DEFAULT_MODEL} (default): not prepared" in result.stdout


def test_resolver_accepts_dirs_and_names_and_rejects_others(
    tmp_path: Path, embedded_model: Path
) -> None:
    assert resolve_model(tmp_path) == tmp_path.absolute()
    assert resolve_model(DEFAULT_MODEL, prepare=False) == embedded_model
    with pytest.raises(UnknownModelError) as info:
        resolve_model("no-such-model")
    assert DEFAULT_MODEL in str(info.value)
    with pytest.raises(UnknownModelError):
        resolve_model(str(tmp_path / "missing-dir"))


@pytest.fixture
def cache_copy(tmp_path: Path, embedded_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the prepared model in its own cache root."""
    root = tmp_path / "cache"
    target = root / DEFAULT_MODEL
    shutil.copytree(embedded_model, target)
    # copytree keeps mtimes (copy2), so the quick check still sees an intact directory.
    monkeypatch.setenv("DYN_MODEL_DIR", str(root))
    return target


def test_intact_copy_passes_quick_and_full_checks(cache_copy: Path) -> None:
    recipe = get_recipe(DEFAULT_MODEL)
    assert check_model_dir(cache_copy, recipe, full=False) == []
    assert check_model_dir(cache_copy, recipe, full=True) == []


def test_corruptions_are_detected(cache_copy: Path) -> None:
    recipe = get_recipe(DEFAULT_MODEL)
    config = cache_copy / "config.json"
    stat = config.stat()
    text = config.read_text()
    config.write_text(text.replace('"', "'", 1))  # same size, different bytes
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert check_model_dir(cache_copy, recipe, full=False) == [
        "config.json: sha256 differs from the manifest"
    ]
    (cache_copy / "tokenizer.json").unlink()
    assert "tokenizer.json: missing" in check_model_dir(cache_copy, recipe)
    manifest = cache_copy / MANIFEST_NAME
    data = json.loads(manifest.read_text())
    data["recipe_version"] = 0
    manifest.write_text(json.dumps(data))
    assert any("recipe version 0" in p for p in check_model_dir(cache_copy, recipe))
    manifest.write_text("{not json")
    assert "unreadable manifest" in check_model_dir(cache_copy, recipe)[0]


def test_verify_command_reports_corruption(cache_copy: Path) -> None:
    ok = run_cli("verify", env={"DYN_MODEL_DIR": str(cache_copy.parent)})
    assert ok.returncode == 0 and "ok" in ok.stdout
    with (cache_copy / "model.safetensors").open("r+b") as handle:
        handle.seek(4096)
        handle.write(b"\x00" * 64)
    bad = run_cli("verify", env={"DYN_MODEL_DIR": str(cache_copy.parent)})
    assert bad.returncode == 1
    assert "model.safetensors" in bad.stderr
