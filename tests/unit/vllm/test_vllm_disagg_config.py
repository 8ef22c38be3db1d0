"""Disaggregated worker configuration and the KV-transfer janitor (no engine started)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from dynamo.testing.module_runs import run_module
from dynamo.vllm.kv_transfer.janitor import KvTransferJanitor, disk_connector_storage, entry_name


def dry_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_module("dynamo.vllm", *args, "--dry-run", env=env)


def test_prefill_worker_without_a_connector_is_refused() -> None:
    result = dry_run("--is-prefill-worker", "--kv-transfer-config", "{}")
    assert result.returncode == 2
    assert "needs a KV connector" in result.stderr
    assert "Loading weights" not in result.stderr + result.stdout


def test_both_roles_at_once_is_refused() -> None:
    result = dry_run("--is-prefill-worker", "--is-decode-worker")
    assert result.returncode == 2
    assert "error:" in result.stderr


def test_cpu_default_connector_uses_the_shared_directory(tmp_path: Path) -> None:
    result = dry_run("--is-decode-worker", env={"DYN_KV_SHARED_STORAGE_PATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "kv_connector: DiskKvConnector" in result.stdout
    assert "kv_connector_module_path: dynamo.vllm.kv_transfer.disk_connector" in result.stdout
    assert f"shared_storage_path: {tmp_path}" in result.stdout
    assert "kv_role: kv_consumer" in result.stdout  # a decode worker only loads
    assert "kv_load_failure_policy: recompute" in result.stdout


def test_entry_name_follows_the_connector_alignment() -> None:
    # The connector keys a prompt by its first ((n - 1) - 1) // B * B tokens.
    prompt = list(range(100, 170))  # 70 tokens, block 32 -> 64 tokens keyed
    same_prefix = [*prompt[:66], 1, 2, 3, 4]
    assert entry_name(prompt, 32) == entry_name(same_prefix, 32)
    assert entry_name(prompt, 32) != entry_name(prompt[:40], 32)


def make_entry(root: Path, name: str, age_s: float = 0.0) -> Path:
    entry = root / name
    entry.mkdir(parents=True)
    (entry / "layer.0.safetensors").write_bytes(b"x" * 1024)
    if age_s:
        past = time.time() - age_s
        os.utime(entry, (past, past))
    return entry


def test_consumed_entries_go_when_the_last_holder_releases(tmp_path: Path) -> None:
    janitor = KvTransferJanitor(tmp_path / "kv", block_size=32, ttl_s=60)
    prompt = list(range(80))
    name = janitor.acquire(prompt)
    janitor.acquire(prompt)  # a second request with the same prompt
    entry = make_entry(janitor.storage_path, name)
    janitor.release(name, consumed=True)
    assert entry.exists(), "still held by the second request"
    janitor.release(name, consumed=True)
    assert not entry.exists()
    assert janitor.removed_consumed == 1


def test_sweep_removes_only_old_unheld_entries(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    janitor = KvTransferJanitor(root, block_size=32, ttl_s=10)  # entries: hex digest names
    old = make_entry(root, "0" * 32, age_s=30)
    fresh = make_entry(root, "f" * 32)
    held_name = janitor.acquire(list(range(80)))
    held = make_entry(root, held_name, age_s=30)
    assert janitor.disk_usage() == 3 * 1024
    assert janitor.sweep() == 1
    assert not old.exists() and fresh.exists() and held.exists()
    assert janitor.sweep(now=time.time() + 60) == 1  # fresh expired; held stays
    assert held.exists() and not fresh.exists()


def test_only_the_directory_connectors_are_managed() -> None:
    from vllm.config import KVTransferConfig

    for name in ("ExampleConnector", "DiskKvConnector"):
        config = KVTransferConfig(
            kv_connector=name,
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": "/x"},
        )
        assert disk_connector_storage(config) == Path("/x")
    assert (
        disk_connector_storage(KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"))
        is None
    )
    assert disk_connector_storage(None) is None


@pytest.mark.parametrize("ttl", ["0.5", "300"])
def test_ttl_from_environment(monkeypatch: pytest.MonkeyPatch, ttl: str) -> None:
    from dynamo.vllm.kv_transfer.janitor import default_ttl

    monkeypatch.setenv("DYN_KV_TRANSFER_TTL", ttl)
    assert default_ttl() == float(ttl)
