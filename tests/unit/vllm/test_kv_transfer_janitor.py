"""The KV-transfer janitor deletes only what it owns: a directory it created (0700, with
its marker, not a symlink, this user's, not group/world-writable) and, inside it, only
entries shaped like vLLM's ExampleConnector entries. Everything runs in tmp dirs; the
real system temp directory is never swept, even by a broken janitor."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from dynamo.vllm.kv_transfer.janitor import KvTransferJanitor, entry_name
from dynamo.vllm.kv_transfer.transfer_root import MARKER_NAME, TransferRoot

BLOCK = 32
TTL_S = 10.0
OLD_S = 3600.0  # well past the TTL
PROMPT = list(range(100, 180))
MD5_NAME = "0123456789abcdef0123456789abcdef"
SHA256_NAME = "ab" * 32


def age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past), follow_symlinks=False)


def make_entry(
    root: Path, name: str, files: tuple[str, ...] = ("model.layers.0.safetensors",)
) -> Path:
    """A directory like the connector writes: `<hex>/<layer>.safetensors`, aged past the TTL."""
    entry = root / name
    entry.mkdir(parents=True)
    for file in files:
        (entry / file).write_bytes(b"kv" * 64)
    age(entry, OLD_S)
    return entry


def foreign_tree(root: Path) -> dict[str, Path]:
    """What another program keeps in a shared temp directory, all aged past the TTL."""
    jetstream = root / "nats-jetstream"
    (jetstream / "jetstream" / "$G" / "streams").mkdir(parents=True)
    (jetstream / "jetstream" / "$G" / "streams" / "meta.inf").write_text("stream")
    age(jetstream, OLD_S)
    # Even a hex-named directory is not ours when it holds other files.
    lookalike = make_entry(root, MD5_NAME, files=("index.db",))
    return {"jetstream": jetstream, "lookalike": lookalike}


def janitor_for(root: Path) -> KvTransferJanitor:
    return KvTransferJanitor(root, BLOCK, ttl_s=TTL_S)


def test_the_janitor_creates_its_root_0700_with_a_marker(tmp_path: Path) -> None:
    root = tmp_path / "shared" / "kv"
    janitor = janitor_for(root)
    info = root.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert (root / MARKER_NAME).is_file()
    assert TransferRoot(root).problem() is None
    # A second worker sharing the directory accepts it as it is.
    again = janitor_for(root)
    assert again.usable() and janitor.usable()
    assert sorted(p.name for p in root.iterdir()) == [MARKER_NAME]
    assert [p.name for p in root.parent.iterdir()] == ["kv"], "no staging directory left"


def test_a_system_temp_like_directory_is_never_swept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Like /tmp (vLLM's default shared_storage_path): exists, sticky, world-writable.
    tmp_like = tmp_path / "tmp"
    tmp_like.mkdir()
    tmp_like.chmod(0o1777)
    foreign = foreign_tree(tmp_like)
    entry = make_entry(tmp_like, entry_name(PROMPT, BLOCK))

    with caplog.at_level(logging.ERROR, logger="dynamo.vllm.kv_transfer.janitor"):
        janitor = janitor_for(tmp_like)
        assert janitor.sweep(now=time.time() + OLD_S) == 0
        name = janitor.acquire(PROMPT)
        janitor.release(name, consumed=True)

    assert all(path.exists() for path in foreign.values())
    assert entry.exists(), "even a real transfer entry stays: the directory is not ours"
    assert (foreign["jetstream"] / "jetstream" / "$G" / "streams" / "meta.inf").exists()
    assert not (tmp_like / MARKER_NAME).exists(), "an existing directory is never adopted"
    refusals = [r.message for r in caplog.records if "not deleting anything" in r.message]
    assert len(refusals) == 1, "refused once, loudly, not once per sweep"
    assert "writable by group or others" in refusals[0]


def test_an_existing_directory_without_the_marker_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)  # ours, private, but not created by a janitor
    entry = make_entry(root, MD5_NAME)
    janitor = janitor_for(root)
    assert "no .dynamo-kv-transfer marker" in (TransferRoot(root).problem() or "")
    assert janitor.sweep() == 0
    assert entry.exists()


def test_a_symlinked_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    owner = janitor_for(real)
    entry = make_entry(real, MD5_NAME)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)

    janitor = janitor_for(link)
    assert "symbolic link" in (TransferRoot(link).problem() or "")
    assert janitor.sweep() == 0
    assert entry.exists()
    assert owner.sweep() == 1, "through its real path the entry is swept"


def test_a_root_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "kv"
    janitor = janitor_for(root)
    entry = make_entry(root, MD5_NAME)
    other_uid = os.geteuid() + 1
    monkeypatch.setattr(os, "geteuid", lambda: other_uid)  # as seen by another user
    assert f"not to this user ({other_uid})" in (TransferRoot(root).problem() or "")
    assert janitor.sweep() == 0
    assert entry.exists()


def test_a_root_opened_to_the_group_is_refused_until_closed_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    janitor = janitor_for(root)
    entry = make_entry(root, MD5_NAME)
    root.chmod(0o770)
    assert janitor.sweep() == 0 and entry.exists()
    root.chmod(0o700)
    with caplog.at_level(logging.INFO, logger="dynamo.vllm.kv_transfer.janitor"):
        assert janitor.sweep() == 1
    assert not entry.exists()
    assert any("usable again" in r.message for r in caplog.records)


def test_only_entries_shaped_like_the_connectors_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    janitor = janitor_for(root)
    md5_entry = make_entry(root, MD5_NAME)
    sha_entry = make_entry(root, SHA256_NAME, files=("a.safetensors", "b.safetensors"))
    real_name = make_entry(root, entry_name(PROMPT, BLOCK))
    keep = {
        "not hex": make_entry(root, "old-cache"),
        "upper-case hex": make_entry(root, MD5_NAME.upper()),
        "hex, 31 digits": make_entry(root, MD5_NAME[:-1]),
        "foreign file inside": make_entry(root, "1" * 32, files=("x.safetensors", "notes.txt")),
        "nested directory": make_entry(root, "2" * 32),
    }
    (keep["nested directory"] / "sub").mkdir()
    age(keep["nested directory"], OLD_S)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.safetensors").write_text("keep")
    link = root / ("3" * 32)
    link.symlink_to(outside, target_is_directory=True)
    hex_file = root / ("4" * 32)
    hex_file.write_text("a file, not an entry")
    age(hex_file, OLD_S)
    fresh = make_entry(root, "5" * 32)
    age(fresh, 0)

    assert janitor.sweep() == 3
    assert not md5_entry.exists() and not sha_entry.exists() and not real_name.exists()
    for what, path in keep.items():
        assert path.exists(), what
    assert link.is_symlink() and (outside / "precious.safetensors").read_text() == "keep"
    assert hex_file.is_file() and fresh.exists() and (root / MARKER_NAME).is_file()


def test_a_consumed_entry_holding_foreign_files_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    janitor = janitor_for(root)
    name = janitor.acquire(PROMPT)
    entry = make_entry(root, name, files=("model.layers.0.safetensors", "other.bin"))
    janitor.release(name, consumed=True)
    assert entry.exists() and janitor.removed_consumed == 0


def test_a_racing_peer_keeps_its_root_and_no_staging_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "kv"
    TransferRoot(root).claim()  # the peer that won
    (root / MARKER_NAME).write_text("peer")
    # This worker looked before the peer created it.
    monkeypatch.setattr(os.path, "lexists", lambda _path: False)
    TransferRoot(root).claim()
    monkeypatch.undo()
    assert (root / MARKER_NAME).read_text() == "peer"
    assert [p.name for p in tmp_path.iterdir()] == ["kv"]
    assert TransferRoot(root).problem() is None
