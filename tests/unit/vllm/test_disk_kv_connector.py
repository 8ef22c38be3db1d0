"""DiskKvConnector: vLLM's ExampleConnector whose unreadable entries are recomputed.

The connector runs here outside an engine, on vLLM's own config and metadata types, with
a KV cache tensor shaped like one layer's ([blocks, heads, block size, head dim]). The
engine-level claim (a decode engine survives an entry that breaks between scheduling and
loading, and answers right) is in tests/e2e/test_disaggregated.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnectorMetadata,
    ReqMeta,
)

from dynamo.vllm.kv_transfer.disk_connector import DiskKvConnector
from dynamo.vllm.kv_transfer.janitor import DISK_CONNECTOR, DISK_CONNECTOR_MODULE, entry_name

BLOCK = 32
LAYER = "model.layers.0.self_attn.attn"
PROMPT_A = list(range(100, 170))  # 70 tokens: two whole blocks are handed over
PROMPT_B = list(range(300, 370))


def make_connector(
    storage: Path, role: str = "kv_both", side: KVConnectorRole = KVConnectorRole.WORKER
) -> DiskKvConnector:
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=KVTransferConfig(
            kv_connector=DISK_CONNECTOR,
            kv_connector_module_path=DISK_CONNECTOR_MODULE,
            kv_role=role,
            kv_connector_extra_config={"shared_storage_path": str(storage)},
            kv_load_failure_policy="recompute",
        ),
    )
    return DiskKvConnector(config, side, None)


def kv_cache(fill: float | None = None) -> torch.Tensor:
    """One layer's paged KV: 8 blocks, 2 heads, BLOCK slots, head dim 4."""
    if fill is None:
        return torch.arange(8 * 2 * BLOCK * 4, dtype=torch.float32).reshape(8, 2, BLOCK, 4)
    return torch.full((8, 2, BLOCK, 4), fill)


def forward_context(cache: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(
        attn_metadata={LAYER: object()},
        no_compile_layers={LAYER: SimpleNamespace(kv_cache=cache)},
    )


def request(prompt: list[int], blocks: list[int], *, store: bool) -> ReqMeta:
    return ReqMeta.make_meta(prompt, blocks, BLOCK, store, [])


def write_entry(storage: Path, prompt: list[int], source: torch.Tensor) -> None:
    """What a prefill worker's connector leaves: the prompt's blocks 0 and 1 of `source`."""
    writer = make_connector(storage)
    writer.bind_connector_metadata(ExampleConnectorMetadata([request(prompt, [0, 1], store=True)]))
    writer.save_kv_layer(LAYER, source, object())


def load(storage: Path, *requests: ReqMeta) -> tuple[torch.Tensor, set[int]]:
    """Runs one step's loads on a consumer; returns its cache and the failed blocks."""
    reader = make_connector(storage, "kv_consumer")
    cache = kv_cache(fill=-1.0)
    reader.bind_connector_metadata(ExampleConnectorMetadata(list(requests)))
    reader.start_load_kv(forward_context(cache))
    return cache, reader.get_block_ids_with_load_errors()


def test_an_entry_loads_into_the_requests_blocks(tmp_path: Path) -> None:
    source = kv_cache()
    write_entry(tmp_path, PROMPT_A, source)
    cache, failed = load(tmp_path, request(PROMPT_A, [3, 4], store=False))
    assert failed == set()
    assert torch.equal(cache[3:5], source[0:2])
    assert torch.all(cache[:3] == -1.0)


@pytest.mark.parametrize("damage", ["emptied", "truncated", "removed"])
def test_an_unreadable_entry_fails_only_its_own_blocks(tmp_path: Path, damage: str) -> None:
    """Deleted between the scheduler's match and the load (the files first, then the
    directory, as the janitor removes an entry), or damaged: the other request of the
    step still loads, and the failed one's blocks go back to vLLM to recompute."""
    source = kv_cache()
    write_entry(tmp_path, PROMPT_A, source)
    write_entry(tmp_path, PROMPT_B, source)
    broken = tmp_path / entry_name(PROMPT_B, BLOCK)
    layer_file = broken / f"{LAYER}.safetensors"
    if damage == "truncated":
        layer_file.write_bytes(layer_file.read_bytes()[:100])
    else:
        layer_file.unlink()
        if damage == "removed":
            broken.rmdir()

    cache, failed = load(
        tmp_path, request(PROMPT_B, [5, 6], store=False), request(PROMPT_A, [3, 4], store=False)
    )

    assert failed == {5, 6}
    assert torch.equal(cache[3:5], source[0:2])
    # No empty directory is left to look like a hit for the next request.
    assert broken.exists() == (damage == "truncated")


def test_failed_blocks_are_reported_once(tmp_path: Path) -> None:
    reader = make_connector(tmp_path, "kv_consumer")
    reader.bind_connector_metadata(
        ExampleConnectorMetadata([request(PROMPT_A, [2, 3], store=False)])
    )
    reader.start_load_kv(forward_context(kv_cache(fill=0.0)))
    assert reader.get_block_ids_with_load_errors() == {2, 3}
    assert reader.get_block_ids_with_load_errors() == set()


def scheduled(prompt: list[int]) -> SimpleNamespace:
    """A scheduler output with one new request and nothing else (what the connector reads)."""
    new = SimpleNamespace(req_id="r1", prompt_token_ids=prompt, mm_features=[], block_ids=([0, 1],))
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={"r1": len(prompt)},
    )


@pytest.mark.parametrize(("role", "writes"), [("kv_consumer", False), ("kv_both", True)])
def test_only_a_worker_that_produces_kv_writes_entries(
    tmp_path: Path, role: str, writes: bool
) -> None:
    scheduler = make_connector(tmp_path, role, KVConnectorRole.SCHEDULER)
    meta = scheduler.build_connector_meta(scheduled(PROMPT_A))
    assert [r.is_store for r in meta.requests] == ([True] if writes else [])
