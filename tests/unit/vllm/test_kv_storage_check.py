"""The check that a decode worker sees the prefill worker's KV-transfer directory
(`dynamo.vllm.kv_transfer.storage_check`).

Claims:
* a probe written by a prefill worker into a directory the decode worker reads passes; one
  written elsewhere (another host, another path) fails with both paths, both hosts and
  the fix, logged once per prefill worker;
* verdicts are cached per token: a passing one for good, a failing one for `recheck_s`,
  after which a probe that became visible (a late NFS mount) passes;
* a result without a probe (an older peer) passes; a malformed token is refused without
  touching the file system outside the directory;
* the probe file is refreshed by the janitor's sweeps, rewritten when removed, removed at
  shutdown, and dead workers' stale probes are swept while live ones are kept;
* the wire fields are optional: old and new peers decode each other's messages.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import msgspec
import pytest

from dynamo.llm.protocols import KvStorageProbe, LLMEngineOutput, ModelCard, PrefillResult
from dynamo.vllm.kv_transfer.janitor import KvTransferJanitor
from dynamo.vllm.kv_transfer.storage_check import (
    PROBE_PREFIX,
    STALE_PROBE_S,
    KvStorageNotSharedError,
    SharedStorageCheck,
    StorageProbeFile,
    probe_path,
    sweep_stale_probes,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    prefill, decode = tmp_path / "prefill-host-kv", tmp_path / "decode-host-kv"
    prefill.mkdir()
    decode.mkdir()
    return prefill, decode


def test_a_shared_directory_passes(tmp_path: Path) -> None:
    probe = StorageProbeFile.create(tmp_path, "10.0.0.1")
    assert probe is not None and probe.path.read_text() == probe.probe.token
    assert probe.probe.path == str(tmp_path) and probe.probe.host == "10.0.0.1"
    SharedStorageCheck(tmp_path, "10.0.0.2").check(probe.probe)


def test_the_same_share_mounted_at_another_path_passes(tmp_path: Path) -> None:
    """Only the directory's content matters: a host may mount the share elsewhere."""
    share = tmp_path / "share"
    share.mkdir()
    (tmp_path / "mounted-here").symlink_to(share)
    probe = StorageProbeFile.create(share, "10.0.0.1")
    assert probe is not None
    SharedStorageCheck(tmp_path / "mounted-here", "10.0.0.2").check(probe.probe)


def test_another_directory_fails_with_both_sides_and_the_fix(
    dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, decode = dirs
    probe = StorageProbeFile.create(prefill, "prefill-host")
    assert probe is not None
    check = SharedStorageCheck(decode, "decode-host")
    for _ in range(3):
        with pytest.raises(KvStorageNotSharedError) as failure:
            check.check(probe.probe)
    message = str(failure.value)
    for needle in (str(prefill), str(decode), "prefill-host", "decode-host", "NFS", "Nixl"):
        assert needle in message
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, "logged once per prefill worker, not per request"


def test_verdicts_are_cached_and_a_failure_is_rechecked(dirs: tuple[Path, Path]) -> None:
    prefill, decode = dirs
    probe = StorageProbeFile.create(prefill, "p")
    assert probe is not None
    clock = Clock()
    check = SharedStorageCheck(decode, "d", recheck_s=5.0, clock=clock)
    assert check.problem(probe.probe) is not None
    # The share shows up (mounted late, or NFS shows new files late)...
    probe_path(decode, probe.probe.token).write_text(probe.probe.token)
    clock.now += 1
    assert check.problem(probe.probe) is not None, "within recheck_s the failure is cached"
    clock.now += 5
    assert check.problem(probe.probe) is None, "...and is seen after recheck_s"
    probe_path(decode, probe.probe.token).unlink()
    clock.now += 3600
    assert check.problem(probe.probe) is None, "a passing verdict is kept (no stat per request)"


def test_no_probe_passes_and_a_malformed_one_fails(tmp_path: Path) -> None:
    check = SharedStorageCheck(tmp_path, "d")
    check.check(None)  # an older prefill worker or frontend
    (tmp_path.parent / "secret").write_text("x")
    for token in ("../secret", "ABCDEF" * 6, ""):
        with pytest.raises(KvStorageNotSharedError, match="malformed"):
            check.check(KvStorageProbe(token=token, path="/x", host="h"))


def test_a_file_with_the_name_but_another_token_fails(dirs: tuple[Path, Path]) -> None:
    prefill, decode = dirs
    probe = StorageProbeFile.create(prefill, "p")
    assert probe is not None
    probe_path(decode, probe.probe.token).write_text("something else")
    with pytest.raises(KvStorageNotSharedError):
        SharedStorageCheck(decode, "d").check(probe.probe)


def test_an_unwritable_directory_gives_no_probe(tmp_path: Path) -> None:
    assert StorageProbeFile.create(tmp_path / "missing", "h") is None


def test_refresh_remove_and_stale_sweep(tmp_path: Path) -> None:
    own = StorageProbeFile.create(tmp_path, "h")
    dead = StorageProbeFile.create(tmp_path, "h")
    live = StorageProbeFile.create(tmp_path, "h")
    assert own and dead and live
    old = time.time() - STALE_PROBE_S - 60
    for probe in (own, dead):
        os.utime(probe.path, (old, old))
    (tmp_path / f"{PROBE_PREFIX}not-a-token").write_text("x")  # not ours to delete
    assert sweep_stale_probes(tmp_path, keep=own.path) == 1
    assert own.path.exists() and live.path.exists() and not dead.path.exists()
    assert (tmp_path / f"{PROBE_PREFIX}not-a-token").exists()
    own.refresh()
    assert time.time() - own.path.stat().st_mtime < 60
    own.path.unlink()
    own.refresh()
    assert own.path.read_text() == own.probe.token, "rewritten when something removed it"
    own.remove()
    assert not own.path.exists()


def test_the_janitors_sweep_refreshes_its_probe_and_removes_stale_ones(tmp_path: Path) -> None:
    storage = tmp_path / "kv"
    janitor = KvTransferJanitor(storage, block_size=4)
    janitor.probe = StorageProbeFile.create(storage, "h")
    stale = StorageProbeFile.create(storage, "h")
    assert janitor.probe and stale
    old = time.time() - STALE_PROBE_S - 60
    for path in (janitor.probe.path, stale.path):
        os.utime(path, (old, old))
    janitor.sweep()
    assert janitor.probe.path.exists() and not stale.path.exists()
    assert janitor.root.problem() is None, "the probe does not make the directory foreign"
    assert janitor.root.entries() == [], "a probe is never taken for a transfer entry"


def test_the_wire_fields_are_optional_both_ways() -> None:
    probe = KvStorageProbe(token="ab" * 16, path="/kv", host="h")

    class OldPrefillResult(msgspec.Struct, omit_defaults=True):
        disaggregated_params: dict = {}
        prompt_tokens_details: dict | None = None

    new = msgspec.msgpack.encode(PrefillResult({"a": 1}, kv_storage=probe))
    assert msgspec.msgpack.decode(new, type=OldPrefillResult).disaggregated_params == {"a": 1}
    old = msgspec.msgpack.encode(OldPrefillResult({"a": 1}))
    assert msgspec.msgpack.decode(old, type=PrefillResult).kv_storage is None
    out = msgspec.msgpack.encode(LLMEngineOutput(kv_storage=probe))
    assert msgspec.msgpack.decode(out, type=LLMEngineOutput).kv_storage == probe
    assert b"kv_storage" not in msgspec.msgpack.encode(LLMEngineOutput()), "free when absent"
    card = ModelCard(name="m", namespace="n", component="c", endpoint="e", instance_id=1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(card), type=ModelCard).host is None
