"""The CPU KV connector: vLLM's ExampleConnector, made safe against entries that vanish.

Prefill and decode workers on CPU hand a prompt's KV over as files in a shared directory
(vLLM's ExampleConnector: one entry per prompt, one safetensors file per attention layer).
The engine decides to load an entry when it schedules the request (the entry exists) and
reads the files one step later, in the model runner. Anything that removes or damages the
entry in between (another decode worker consuming the same prompt's entry, a TTL sweep,
an operator cleaning the directory, a full disk that truncated a file) makes the read
raise inside the engine, and the ExampleConnector lets that kill the engine.

`DiskKvConnector` keeps the ExampleConnector's format and names (so `KvTransferJanitor`
and the storage probe keep working) and changes three things:

* a request whose entry cannot be read is not loaded: its blocks are reported to vLLM as
  failed (`get_block_ids_with_load_errors`) and the engine, configured with
  `kv_load_failure_policy="recompute"`, computes the prompt itself. The request is slower,
  its output is right, and the engine lives;
* a failed read does not leave an empty entry directory behind (the ExampleConnector
  creates the directory when it builds a file name to read), which would otherwise look
  like a hit for every later request with that prompt;
* a worker whose role is `kv_consumer` (a decode worker) never writes entries: it only
  loads what prefill workers wrote. The ExampleConnector writes every prompt it computes,
  whatever the role, which on a decode worker is disk traffic nobody reads.

Used by default for disaggregated CPU workers (`dynamo.vllm.config.kv_defaults`); a user who names
vLLM's ExampleConnector in `--kv-transfer-config` gets vLLM's behaviour.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    ReqMeta,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger(__name__)

LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, SafetensorError, KeyError, RuntimeError)
"""What reading a vanished, truncated or foreign entry raises: FileNotFoundError (an
OSError), a damaged file (SafetensorError), a file without the `kv_cache` tensor
(KeyError), a tensor that does not fit the destination slots (RuntimeError)."""


def blocks_of(request: ReqMeta, block_size: int) -> set[int]:
    """The KV-cache block ids a load request writes into (its slots, per block)."""
    return {int(b) for b in (request.slot_mapping // block_size).unique().tolist()}


class DiskKvConnector(ExampleConnector):
    """ExampleConnector whose failed loads are recomputed and whose consumers never write
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._failed_blocks: set[int] = set()
        self._writes = not (
            self._kv_transfer_config.is_kv_consumer and not self._kv_transfer_config.is_kv_producer
        )

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads each request's entry on its own, so one unreadable entry fails only its
        own request's blocks (recomputed by the engine) and not the step."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, ExampleConnectorMetadata)
        loads = [r for r in metadata.requests if not r.is_store]
        if not loads:
            return
        try:
            for request in loads:
                self.bind_connector_metadata(ExampleConnectorMetadata(requests=[request]))
                try:
                    super().start_load_kv(forward_context, **kwargs)
                except LOAD_ERRORS as exc:
                    self._fail_load(request, exc)
        finally:
            self.bind_connector_metadata(metadata)

    def _fail_load(self, request: ReqMeta, exc: BaseException) -> None:
        blocks = blocks_of(request, self._block_size)
        self._failed_blocks |= blocks
        folder = self._generate_foldername_debug(request.token_ids, request.mm_hashes)
        with contextlib.suppress(OSError):  # only an empty one: the read created it
            os.rmdir(folder)
        log.warning(
            "KV transfer entry %s could not be read (%s: %s); the engine computes the "
            "%d tokens of its %d blocks itself",
            os.path.basename(folder),
            type(exc).__name__,
            exc,
            len(request.slot_mapping),
            len(blocks),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------------ scheduler side

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, ExampleConnectorMetadata)
        if not self._writes:
            meta.requests = [r for r in meta.requests if not r.is_store]
        return meta
