"""Bounded disk use for KV transferred through a directory (the CPU path).

The CPU connector (`DiskKvConnector`, vLLM's ExampleConnector with safe loads) writes a prompt's KV cache to `<shared_storage_path>/<hash of the
prompt's block-aligned tokens>/<layer>.safetensors` and a decode worker that sees the same
prompt loads it from there. vLLM never deletes these entries, so without help the
directory grows with every distinct prompt. `KvTransferJanitor` bounds it:

* consumed — a decode worker deletes the entry of a request that was handed a prefill
  worker's transfer (so the entry was written for it and loaded at its first step) once
  the request has ended, unless another request in flight on this worker uses the same
  entry. A request that merely found an entry for its prompt does not consume it: that
  entry may be another decode worker's, about to load;
* TTL — every worker sharing the directory removes entries older than `ttl_s` that no
  request of its own holds (a prefill whose decode never came: the client went away).

The entry name is computed with vLLM's own helpers (`align_to_block_size`, `safe_hash`)
over the same bytes the connector hashes, so the two can never disagree on a name.

The janitor owns the directory (`dynamo.vllm.kv_transfer.transfer_root`): it creates it 0700 with a
marker, refuses to touch one it did not create (a symlink, another user's, a group- or
world-writable one: the system temp directory, say), and deletes only entries shaped like
the connector's. A refused directory is logged as an error and left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from dynamo.runtime.tasks import cancel_and_wait
from dynamo.vllm.kv_transfer.storage_check import StorageProbeFile, sweep_stale_probes
from dynamo.vllm.kv_transfer.transfer_root import TransferRoot, remove_transfer_entry

log = logging.getLogger(__name__)

DISK_CONNECTOR = "DiskKvConnector"
DISK_CONNECTOR_MODULE = "dynamo.vllm.kv_transfer.disk_connector"
DISK_CONNECTORS = frozenset({"ExampleConnector", DISK_CONNECTOR})
"""Connectors that keep KV in entries of a shared directory, the ones this janitor cleans."""

DEFAULT_TTL_S = 120.0
ENV_TTL = "DYN_KV_TRANSFER_TTL"


def default_ttl() -> float:
    value = os.environ.get(ENV_TTL, "").strip()
    return float(value) if value else DEFAULT_TTL_S


def transferred_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens the ExampleConnector hands over: whole blocks of the first N-1."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import align_to_block_size

    return align_to_block_size(num_prompt_tokens - 1, block_size)


def entry_name(prompt_token_ids: Sequence[int], block_size: int) -> str:
    """The directory name the ExampleConnector uses for a prompt (no multimodal hashes)."""
    import torch
    from vllm.utils.hashing import safe_hash

    count = transferred_tokens(len(prompt_token_ids), block_size)
    tokens = torch.tensor(list(prompt_token_ids))[:count]
    return safe_hash(tokens.numpy().tobytes(), usedforsecurity=False).hexdigest()


class KvTransferJanitor:
    """Deletes consumed and expired connector entries under `storage_path`.

    Creating the janitor claims the directory (`TransferRoot.claim`): it must exist, with
    dynamo's marker, before the connector's first write would create it without one. Every
    deletion re-checks that the directory is still ours (`TransferRoot.problem`).
    """

    def __init__(
        self, storage_path: Path, block_size: int, *, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        self.storage_path = Path(storage_path)
        self.block_size = block_size
        self.ttl_s = ttl_s
        self.root = TransferRoot(self.storage_path)
        self._held: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self._refusal: str | None = None
        self.probe: StorageProbeFile | None = None
        """A prefill worker's probe file (`kv_transfer.storage_check`), kept fresh by each sweep."""
        self.removed_consumed = 0
        self.removed_expired = 0
        self.removed_refused = 0
        try:
            self.root.claim()
        except OSError as exc:
            log.error("cannot create the KV transfer directory %s: %s", self.storage_path, exc)
        self.usable()

    def usable(self) -> bool:
        """Whether the directory may be swept; a refusal is logged once, as an error."""
        problem = self.root.problem()
        if problem != self._refusal:
            if problem is not None:
                log.error(
                    "not deleting anything in the KV transfer directory: %s. Point "
                    "shared_storage_path (or $DYN_KV_SHARED_STORAGE_PATH) at a directory "
                    "that does not exist yet; the worker creates it.",
                    problem,
                )
            elif self._refusal is not None:
                log.info("KV transfer directory %s is usable again", self.storage_path)
            self._refusal = problem
        return problem is None

    def acquire(self, prompt_token_ids: Sequence[int]) -> str:
        """Note that a request using this prompt's entry is in flight; returns its name."""
        name = entry_name(prompt_token_ids, self.block_size)
        self._held[name] += 1
        return name

    def release(self, name: str, *, consumed: bool) -> None:
        """The request ended; delete its entry if it was consumed and nobody here holds it."""
        self._held[name] -= 1
        if self._held[name] > 0:
            return
        del self._held[name]
        if consumed and self.usable() and remove_transfer_entry(self.storage_path / name):
            self.removed_consumed += 1

    def discard(self, prompt_token_ids: Sequence[int]) -> None:
        """Delete this prompt's entry now: it holds KV this engine must not load."""
        if self.usable() and remove_transfer_entry(
            self.storage_path / entry_name(prompt_token_ids, self.block_size)
        ):
            self.removed_refused += 1

    def sweep(self, now: float | None = None) -> int:
        """Remove entries older than the TTL that no request here holds; returns how many.
        Also refreshes this worker's probe file and removes dead workers' stale ones."""
        if self.probe is not None:
            self.probe.refresh()
        if not self.usable():
            return 0
        now = time.time() if now is None else now
        sweep_stale_probes(self.storage_path, now, keep=self.probe.path if self.probe else None)
        removed = 0
        for entry in self.root.entries():
            if entry.name in self._held:
                continue
            try:
                age = now - entry.lstat().st_mtime
            except FileNotFoundError:
                continue
            if age > self.ttl_s and remove_transfer_entry(entry):
                removed += 1
        self.removed_expired += removed
        return removed

    def disk_usage(self) -> int:
        """Bytes held by transfer entries (the marker and anything foreign not counted)."""
        total = 0
        for entry in self.root.entries():
            with contextlib.suppress(FileNotFoundError), os.scandir(entry) as files:
                for file in files:
                    with contextlib.suppress(FileNotFoundError):
                        total += file.stat(follow_symlinks=False).st_size
        return total

    def start(self, interval_s: float | None = None) -> None:
        """Sweep periodically (every TTL/4 by default, at least once a minute)."""
        if self._task is None:
            period = interval_s or min(60.0, max(1.0, self.ttl_s / 4))
            self._task = asyncio.create_task(self._run(period), name="kv-transfer-janitor")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                removed = await asyncio.to_thread(self.sweep)
                if removed:
                    log.info(
                        "removed %d expired KV transfer entries from %s", removed, self.storage_path
                    )
            except Exception:
                log.exception("KV transfer sweep failed")


def disk_connector_storage(kv_transfer_config: object | None) -> Path | None:
    """The shared storage path when the engine keeps KV in a directory (DiskKvConnector or
    vLLM's ExampleConnector), else None."""
    if (
        kv_transfer_config is None
        or getattr(kv_transfer_config, "kv_connector", None) not in DISK_CONNECTORS
    ):
        return None
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return Path(extra.get("shared_storage_path", "/tmp"))
