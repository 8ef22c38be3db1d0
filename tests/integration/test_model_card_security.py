"""Model cards come from the network: a hostile card must not make a frontend write or
delete files outside its tokenizer cache, and tampered object-store files must not be
loaded. Run against a real nats-server (object store and KV watch)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.js.object_store import ObjectStore

from dynamo.llm import model_card
from dynamo.llm.model_card import (
    FILES_BUCKET,
    MODELS_BUCKET,
    CardAdded,
    InvalidModelCardError,
    ModelCardWatcher,
    TokenizerDigestError,
    card_key,
    check_tokenizer_fields,
    fetch_tokenizer_files,
    publish_model_card,
)
from dynamo.llm.protocols import ModelCard
from dynamo.runtime import DistributedRuntime
from dynamo.testing.runtimes import connected_runtime
from dynamo.testing.tokenizers import build_tiny_tokenizer

GOOD_DIGEST = "0123456789abcdef0123456789abcdef"
EVENT_TIMEOUT_S = 10


def make_card(namespace: str, instance_id: int = 1, **fields: object) -> ModelCard:
    return ModelCard(
        name="secure-model",
        namespace=namespace,
        component="backend",
        endpoint="generate",
        instance_id=instance_id,
        **fields,  # type: ignore[arg-type]
    )


def tree(root: Path) -> set[str]:
    """Every path under `root` (relative), to show what a call created or removed."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
async def runtime(nats_url: str) -> AsyncIterator[DistributedRuntime]:
    async with connected_runtime(nats_url, lease_ttl=2.0) as rt:
        yield rt


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


# "{tmp}" stands for the test's tmp_path: absolute paths stay inside the sandbox even if
# the code under test followed them.
HOSTILE_FIELDS = {
    "digest-dotdot": {"tokenizer_digest": "../../x", "tokenizer_files": ["tokenizer.json"]},
    "digest-absolute": {"tokenizer_digest": "{tmp}/victim", "tokenizer_files": ["keep.txt"]},
    "digest-not-lowercase-hex": {
        "tokenizer_digest": GOOD_DIGEST.upper(),
        "tokenizer_files": ["tokenizer.json"],
    },
    "file-dotdot": {"tokenizer_digest": GOOD_DIGEST, "tokenizer_files": ["../evil"]},
    "file-dotdot-twice": {"tokenizer_digest": GOOD_DIGEST, "tokenizer_files": ["../../evil"]},
    "file-absolute": {"tokenizer_digest": GOOD_DIGEST, "tokenizer_files": ["{tmp}/abs-evil"]},
    "file-in-subdir": {"tokenizer_digest": GOOD_DIGEST, "tokenizer_files": ["sub/tokenizer.json"]},
    "file-repeated": {"tokenizer_digest": GOOD_DIGEST, "tokenizer_files": ["tokenizer.json"] * 2},
    "bucket-path": {
        "tokenizer_digest": GOOD_DIGEST,
        "tokenizer_files": ["tokenizer.json"],
        "tokenizer_bucket": "../b",
    },
}


def hostile_card(case: str, tmp: Path) -> ModelCard:
    fields = {
        key: [v.replace("{tmp}", str(tmp)) for v in value]
        if isinstance(value, list)
        else str(value).replace("{tmp}", str(tmp))
        for key, value in HOSTILE_FIELDS[case].items()
    }
    return make_card("sec-hostile", **fields)


@pytest.mark.parametrize("case", list(HOSTILE_FIELDS))
async def test_hostile_card_writes_nothing_outside_the_cache(
    runtime: DistributedRuntime, tmp_path: Path, case: str
) -> None:
    card = hostile_card(case, tmp_path)
    digest = card.tokenizer_digest or ""
    # What an attacker stores so that a naive fetch has something to write.
    store = await runtime.object_store(FILES_BUCKET)
    for name in card.tokenizer_files:
        await store.put(f"{digest}/{name}", b"attacker bytes")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("not yours")
    cache = tmp_path / "a" / "b" / "cache"
    cache.mkdir(parents=True)
    before = tree(tmp_path)

    outcome: BaseException | None = None
    try:
        await fetch_tokenizer_files(runtime, card, cache)
    except Exception as exc:
        outcome = exc

    assert tree(tmp_path) == before, "nothing is written or removed, in the cache or outside"
    assert (victim / "keep.txt").read_text() == "not yours"
    assert isinstance(outcome, InvalidModelCardError), outcome
    with pytest.raises(InvalidModelCardError):
        check_tokenizer_fields(card)


async def test_tampered_object_store_file_is_refused_by_digest(
    runtime: DistributedRuntime, tmp_path: Path, tokenizer_dir: Path
) -> None:
    card = await publish_model_card(runtime, make_card("sec-tamper"), tokenizer_dir)
    digest = card.tokenizer_digest
    assert digest is not None
    store = await runtime.object_store(FILES_BUCKET)
    original = (tokenizer_dir / "tokenizer.json").read_bytes()
    cache = tmp_path / "cache"
    try:
        await store.put(f"{digest}/tokenizer.json", original.replace(b"<|im_end|>", b"<|im_evil|>"))
        with pytest.raises(TokenizerDigestError, match=digest):
            await fetch_tokenizer_files(runtime, card, cache)
        assert tree(cache) == set(), "the tampered download (and its staging dir) is removed"
    finally:
        await store.put(f"{digest}/tokenizer.json", original)

    # With the genuine bytes back the same card downloads and verifies.
    target = await fetch_tokenizer_files(runtime, card, cache)
    assert target == cache / digest
    assert (target / "tokenizer.json").read_bytes() == original

    # A cached copy altered on disk is not trusted: it is fetched again.
    (target / "tokenizer.json").write_bytes(b"{}")
    assert await fetch_tokenizer_files(runtime, card, cache) == target
    assert (target / "tokenizer.json").read_bytes() == original


async def test_concurrent_fetches_into_one_cache_never_replace_a_verified_copy(
    runtime: DistributedRuntime,
    tmp_path: Path,
    tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The processes of `--http-workers` share the cache. Two fetches of one card at once
    (each object-store read slowed, so both would be downloading together) must not
    remove the copy the first one made: a process loading its tokenizer from it would
    find files missing (a chat template gone: a 400 for every chat until restart)."""
    card = await publish_model_card(runtime, make_card("sec-race"), tokenizer_dir)
    cache = tmp_path / "cache"
    target = cache / (card.tokenizer_digest or "")
    original_get = ObjectStore.get

    async def slow_get(self: ObjectStore, name: str, *args: object, **kwargs: object) -> object:
        await asyncio.sleep(0.2)
        return await original_get(self, name, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "get", slow_get)
    seen: list[tuple[int, bool]] = []  # (inode, every file present) while it exists
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            with contextlib.suppress(FileNotFoundError):
                inode = target.stat().st_ino
                complete = all((target / name).is_file() for name in card.tokenizer_files)
                seen.append((inode, complete))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        results = await asyncio.gather(
            fetch_tokenizer_files(runtime, card, cache), fetch_tokenizer_files(runtime, card, cache)
        )
    finally:
        done.set()
        await watcher
    assert results == [target, target]
    assert seen, "the copy appeared while the fetches ran"
    assert {inode for inode, _ in seen} == {target.stat().st_ino}, "the copy was replaced"
    assert all(complete for _, complete in seen), "a file was missing from the copy"
    assert tree(cache) == {f"{target.name}/{name}" for name in card.tokenizer_files} | {target.name}


async def test_a_stalled_download_fails_in_bounded_time_and_leaves_nothing(
    runtime: DistributedRuntime,
    tmp_path: Path,
    tokenizer_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    card = await publish_model_card(runtime, make_card("sec-stall"), tokenizer_dir)
    cache = tmp_path / "cache"

    async def stalled_get(self: ObjectStore, name: str, *args: object, **kwargs: object) -> object:
        await asyncio.Event().wait()  # an object-store read that never completes

    monkeypatch.setattr(ObjectStore, "get", stalled_get)
    monkeypatch.setattr(model_card, "FETCH_TIMEOUT_S", 0.5)
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(fetch_tokenizer_files(runtime, card, cache), 30)
    assert time.monotonic() - began < 10, "failed by the fetch's own bound, not the test's"
    assert tree(cache) == set(), "the staging directory is removed"


async def test_watcher_refuses_a_hostile_card_and_keeps_serving_good_ones(
    runtime: DistributedRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    namespace = "sec-watch"
    hostile = make_card(
        namespace, instance_id=7, tokenizer_digest="../../x", tokenizer_files=["../evil"]
    )
    good = make_card(
        namespace, instance_id=8, tokenizer_digest=GOOD_DIGEST, tokenizer_files=["tokenizer.json"]
    )
    await runtime.put_leased(MODELS_BUCKET, card_key(hostile), msgspec.msgpack.encode(hostile))
    await runtime.put_leased(MODELS_BUCKET, card_key(good), msgspec.msgpack.encode(good))
    watcher = await ModelCardWatcher(runtime, namespace).start()
    try:
        events = aiter(watcher)
        first = await asyncio.wait_for(anext(events), EVENT_TIMEOUT_S)
        assert first == CardAdded(good), "the hostile card never becomes an event"
        assert [c.instance_id for c in watcher.cards] == [8]
        assert any(
            "refusing model card" in r.message and "tokenizer_digest" in r.message
            for r in caplog.records
        )
    finally:
        await watcher.close()
        for card in (hostile, good):
            await runtime.delete_leased(MODELS_BUCKET, card_key(card))
