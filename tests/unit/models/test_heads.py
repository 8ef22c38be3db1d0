"""Shipped draft heads: prepared into the cache with the verifier pointing at the prepared
target, current copies left alone, stale ones replaced, names known to the resolver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.llm.models import KNOWN_HEADS, ModelNotPreparedError, resolve_model
from dynamo.llm.models.heads import MARKER, is_head_prepared, prepare_head, weights_digest
from dynamo.llm.models.prepare import is_known_name
from dynamo.llm.models.recipes import UnknownModelError

pytestmark = pytest.mark.unit

HEAD = KNOWN_HEADS["smollm2-135m-instruct-eagle3"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DYN_MODEL_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_shipped_head_is_in_the_tree_and_names_its_target_by_recipe() -> None:
    config = json.loads((HEAD.source_dir / "config.json").read_text())
    assert config["speculators_model_type"] == HEAD.method
    assert config["speculators_config"]["verifier"]["name_or_path"] == HEAD.target
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == HEAD.num_speculative_tokens
    size = sum(p.stat().st_size for p in HEAD.source_dir.glob("*.safetensors"))
    assert 0 < size < 25 * 2**20
    recipe = json.loads((HEAD.source_dir / "recipe.json").read_text())
    assert recipe["held_out"]["acceptance_length"] > 1.0


def test_prepare_copies_rewrites_the_verifier_and_is_then_a_no_op(cache: Path) -> None:
    target = cache / "some-target"
    messages: list[str] = []
    prepared = prepare_head(HEAD, target, log=messages.append)
    assert prepared == cache / HEAD.name
    config = json.loads((prepared / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target)
    assert weights_digest(prepared) == weights_digest(HEAD.source_dir)
    assert is_head_prepared(HEAD)
    mtime = (prepared / "config.json").stat().st_mtime_ns
    prepare_head(HEAD, target, log=messages.append)
    assert (prepared / "config.json").stat().st_mtime_ns == mtime
    assert "is prepared at" in messages[-1]


def test_a_copy_of_other_weights_is_replaced(cache: Path) -> None:
    prepared = prepare_head(HEAD, cache / "t", log=lambda _: None)
    marker = prepared / MARKER
    marker.write_text(json.dumps({"head": HEAD.name, "weights_sha256": "older"}))
    assert not is_head_prepared(HEAD)
    prepare_head(HEAD, cache / "t", log=lambda _: None)
    assert is_head_prepared(HEAD)


def test_head_names_are_known_to_the_resolver(cache: Path) -> None:
    assert is_known_name(HEAD.name.upper())
    with pytest.raises(ModelNotPreparedError, match=f"prepare {HEAD.name}"):
        resolve_model(HEAD.name, prepare=False)
    with pytest.raises(UnknownModelError, match=HEAD.name):
        resolve_model("no-such-model", prepare=False)
