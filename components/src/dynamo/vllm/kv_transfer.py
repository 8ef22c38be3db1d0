"""Bounded disk use for KV transferred through vLLM's ExampleConnector (the CPU path).

The ExampleConnector writes a prompt's KV cache to `<shared_storage_path>/<hash of the
prompt's block-aligned tokens>/<layer>.safetensors` and a decode worker that sees the same
prompt loads it from there. vLLM never deletes these entries, so without help the
directory grows with every distinct prompt. `KvTransferJanitor` bounds it:

* consumed — a decode worker deletes the entry of a request once the request has ended
  (its KV was loaded at the first step), unless another request in flight on this worker
  uses the same entry;
* TTL — every worker sharing the directory removes entries older than `ttl_s` that no
  request of its own holds (a prefill whose decode never came: the client went away).

The entry name is computed with vLLM's own helpers (`align_to_block_size`, `safe_hash`)
over the same bytes the connector hashes, so the two can never disagree on a name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from dynamo.runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 120.0
ENV_TTL = "DYN_KV_TRANSFER_TTL"


def default_ttl() -> float:
    value = os.environ.get(ENV_TTL, "").strip()
    return float(value) if value else DEFAULT_TTL_S


def entry_name(prompt_token_ids: Sequence[int], block_size: int) -> str:
    """The directory name the ExampleConnector uses for a prompt (no multimodal hashes)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import align_to_block_size
    from vllm.utils.hashing import safe_hash

    count = align_to_block_size(len(prompt_token_ids) - 1, block_size)
    tokens = torch.tensor(list(prompt_token_ids))[:count]
    return safe_hash(tokens.numpy().tobytes(), usedforsecurity=False).hexdigest()


class KvTransferJanitor:
    """Deletes consumed and expired connector entries under `storage_path`."""

    def __init__(
        self, storage_path: Path, block_size: int, *, ttl_s: float = DEFAULT_TTL_S
    ) -> None:
        self.storage_path = Path(storage_path)
        self.block_size = block_size
        self.ttl_s = ttl_s
        self._held: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None
        self.removed_consumed = 0
        self.removed_expired = 0

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
        if consumed and self._remove(self.storage_path / name):
            self.removed_consumed += 1

    def sweep(self, now: float | None = None) -> int:
        """Remove entries older than the TTL that no request here holds; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        try:
            entries = list(os.scandir(self.storage_path))
        except FileNotFoundError:
            return 0
        for entry in entries:
            if entry.name in self._held or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                age = now - entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if age > self.ttl_s and self._remove(Path(entry.path)):
                removed += 1
        self.removed_expired += removed
        return removed

    def disk_usage(self) -> int:
        """Bytes currently stored under the directory."""
        total = 0
        for root, _dirs, files in os.walk(self.storage_path):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(root, name)).st_size
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

    @staticmethod
    def _remove(path: Path) -> bool:
        if not path.exists():
            return False
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()


def example_connector_storage(kv_transfer_config: object | None) -> Path | None:
    """The shared storage path when the engine uses the ExampleConnector, else None."""
    if (
        kv_transfer_config is None
        or getattr(kv_transfer_config, "kv_connector", None) != "ExampleConnector"
    ):
        return None
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    return Path(extra.get("shared_storage_path", "/tmp"))
