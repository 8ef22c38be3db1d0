"""Decoding vLLM KV event batches (both wire forms) and re-keying them by content."""

from __future__ import annotations

import msgspec
import pytest

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.indexer import KvIndexer
from dynamo.llm.kv_router.vllm_events import (
    KvEventConverter,
    KvEventDecodeError,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    VllmUnknownEvent,
    decode_event_batch,
)
from dynamo.llm.protocols import KvAllCleared, KvBlockRemoved, KvBlockStored, KvMedium

B = 4
TOKENS = list(range(1, 13))  # 3 blocks
H = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32]  # vLLM's sha256-style block hashes


def pack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def stored_map(hashes: list, parent, tokens: list[int], **extra) -> dict:
    """A BlockStored event exactly as vLLM 0.32 encodes it (tagged map)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": B,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def stored(hashes: list, parent, tokens: list[int], **kw) -> VllmBlockStored:
    return VllmBlockStored(hashes, parent, tokens, kw.pop("block_size", B), medium="GPU", **kw)


# --------------------------------------------------------------------------- decoding


def test_decodes_the_tagged_map_form() -> None:
    payload = pack(
        [
            1.5,
            [
                stored_map(H[:2], None, TOKENS[:8], group_idx=0, extra_keys=None),
                {"type": "BlockRemoved", "block_hashes": [H[0]], "medium": "GPU", "group_idx": 0},
                {"type": "AllBlocksCleared"},
                {"type": "SomethingNew", "x": 1},
            ],
            0,
        ]
    )
    batch = decode_event_batch(payload)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    first, removed, cleared, unknown = batch.events
    assert first == VllmBlockStored(H[:2], None, TOKENS[:8], B, medium="GPU", group_idx=0)
    assert removed == VllmBlockRemoved([H[0]], medium="GPU", group_idx=0)
    assert cleared == VllmAllBlocksCleared()
    assert unknown == VllmUnknownEvent("SomethingNew")


def test_decodes_the_older_positional_form() -> None:
    payload = pack(
        [
            2.0,
            [
                ["BlockStored", [11, 12], None, TOKENS[:8], B, None],  # before `medium`
                ["BlockStored", [13], 12, TOKENS[8:], B, None, "GPU"],
                ["BlockRemoved", [11]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_event_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [
        VllmBlockStored([11, 12], None, TOKENS[:8], B),
        VllmBlockStored([13], 12, TOKENS[8:], B, medium="GPU"),
        VllmBlockRemoved([11]),
        VllmAllBlocksCleared(),
    ]


def test_decodes_what_vllm_itself_encodes() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv_events.KVEventBatch(
        ts=3.0,
        events=[
            kv_events.BlockStored(
                block_hashes=H[:2],
                parent_block_hash=None,
                token_ids=TOKENS[:8],
                block_size=B,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            kv_events.BlockRemoved(block_hashes=[H[1]], medium="GPU", group_idx=0),
            kv_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    decoded = decode_event_batch(msgspec.msgpack.encode(batch))
    assert decoded == VllmEventBatch(
        3.0,
        [
            VllmBlockStored(H[:2], None, TOKENS[:8], B, medium="GPU", group_idx=0),
            VllmBlockRemoved([H[1]], medium="GPU", group_idx=0),
            VllmAllBlocksCleared(),
        ],
        0,
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        pack("nope"),
        pack([1.0]),
        pack([1.0, [42]]),
        pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1]}]]),
        pack([1.0, [stored_map(["str-hash"], None, TOKENS[:4])]]),
        pack([1.0, [stored_map([1], None, ["a", "b", "c", "d"])]]),
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(KvEventDecodeError):
        decode_event_batch(payload)


# --------------------------------------------------------------------------- conversion


def test_parent_chaining_across_events_gives_whole_sequence_hashes() -> None:
    conv = KvEventConverter(worker_id=7, block_size=B)
    first = conv.convert(stored(H[:2], None, TOKENS[:8]))
    second = conv.convert(stored(H[2:], H[1], TOKENS[8:]))
    expected = compute_block_hashes(TOKENS, B)
    assert first is not None and second is not None
    assert first.data == KvBlockStored(block_hashes=expected[:2], parent_hash=None)
    assert second.data == KvBlockStored(block_hashes=expected[2:], parent_hash=expected[1])
    assert (first.worker_id, first.event_id, second.event_id) == (7, 0, 1)
    assert conv.content_hash(H[2]) == expected[2]


def test_removal_resolves_to_content_hashes_and_forgets_the_mapping() -> None:
    conv = KvEventConverter(1, B)
    conv.convert(stored(H, None, TOKENS))
    expected = compute_block_hashes(TOKENS, B)
    event = conv.convert(VllmBlockRemoved([H[2], H[1]], medium="GPU"))
    assert event is not None and event.data == KvBlockRemoved(
        block_hashes=[expected[2], expected[1]]
    )
    assert conv.known_blocks == 1 and conv.content_hash(H[1]) is None
    assert conv.convert(VllmBlockRemoved([H[1]])) is None  # already forgotten
    assert conv.stats.unknown_removals == 1
    # A child of a removed block can no longer be hashed: dropped, not mis-keyed.
    assert conv.convert(stored([b"\x09"], H[1], TOKENS[8:])) is None
    assert conv.stats.dropped_orphan == 1


def test_clear_forgets_everything_and_is_announced() -> None:
    conv = KvEventConverter(1, B)
    conv.convert(stored(H[:1], None, TOKENS[:4]))
    event = conv.convert(VllmAllBlocksCleared())
    assert event is not None and isinstance(event.data, KvAllCleared)
    assert conv.known_blocks == 0
    assert event.event_id == 1


def test_restoring_a_block_is_idempotent() -> None:
    conv = KvEventConverter(1, B)
    conv.convert(stored(H[:2], None, TOKENS[:8]))
    again = conv.convert(stored(H[:2], None, TOKENS[:8]))  # "full" report mode re-reports
    assert again is not None and conv.known_blocks == 2
    removed = conv.convert(VllmBlockRemoved([H[0]]))
    assert removed is not None and removed.data.block_hashes == compute_block_hashes(TOKENS, B)[:1]


def test_same_content_under_two_vllm_hashes_leaves_the_cache_with_the_last_one() -> None:
    conv = KvEventConverter(1, B)
    conv.convert(stored([b"a"], None, TOKENS[:4]))
    conv.convert(stored([b"b"], None, TOKENS[:4]))
    assert conv.convert(VllmBlockRemoved([b"a"])) is None  # the other copy is still cached
    last = conv.convert(VllmBlockRemoved([b"b"]))
    assert last is not None and last.data.block_hashes == compute_block_hashes(TOKENS[:4], B)


@pytest.mark.parametrize(
    ("event", "counter"),
    [
        (VllmBlockStored(H[:1], None, TOKENS[:4], B, lora_id=3), "dropped_lora"),
        (VllmBlockStored(H[:1], None, TOKENS[:4], B, lora_name="adapter"), "dropped_lora"),
        (VllmBlockStored(H[:1], None, TOKENS[:4], B, medium="NVME"), "dropped_medium"),
        (
            VllmBlockStored(H[:1], None, TOKENS[:4], B, extra_keys=[("img", 0)]),
            "dropped_extra_keys",
        ),
        (VllmBlockStored(H[:1], None, TOKENS[:4], B, group_idx=1), "dropped_group"),
        (VllmBlockStored(H[:1], None, TOKENS[:8], 8), "dropped_block_size"),
        (VllmBlockStored(H[:2], None, TOKENS[:4], B), "dropped_misaligned"),
        (VllmBlockStored(H[:1], b"unknown", TOKENS[:4], B), "dropped_orphan"),
    ],
)
def test_unindexable_stores_are_dropped(event: VllmBlockStored, counter: str) -> None:
    conv = KvEventConverter(1, B)
    assert conv.convert(event) is None
    assert getattr(conv.stats, counter) == 1
    assert conv.known_blocks == 0


def test_extra_keys_of_none_per_block_are_fine() -> None:
    conv = KvEventConverter(1, B)
    assert conv.convert(stored(H[:1], None, TOKENS[:4], extra_keys=[None])) is not None


def test_removals_of_other_tiers_do_not_touch_the_device_index() -> None:
    conv = KvEventConverter(1, B)
    conv.convert(stored(H[:1], None, TOKENS[:4]))
    assert conv.convert(VllmBlockRemoved(H[:1], medium="CPU")) is None
    assert conv.known_blocks == 1


def test_converted_events_drive_the_indexer() -> None:
    conv = KvEventConverter(5, B)
    index = KvIndexer(B)
    batch = VllmEventBatch(
        0.0,
        [
            stored(H[:2], None, TOKENS[:8]),
            stored(H[2:], H[1], TOKENS[8:]),
            VllmUnknownEvent("Future"),
            VllmBlockRemoved([H[2]]),
        ],
    )
    events = conv.convert_batch(batch)
    assert [e.event_id for e in events] == [0, 1, 2]
    for event in events:
        index.apply(event)
    assert index.find_matches_for_tokens([*TOKENS, 99]).scores == {5: 2}
    assert conv.stats.unknown_events == 1


# --------------------------------------------------------------------------- tiers


@pytest.mark.parametrize(
    ("name", "medium"),
    [
        (None, KvMedium.GPU),
        ("GPU", KvMedium.GPU),
        ("CPU", KvMedium.CPU),
        ("cpu", KvMedium.CPU),  # Mooncake's spelling
        ("STORAGE", KvMedium.STORAGE),
        ("disk", KvMedium.STORAGE),
    ],
)
def test_vllm_media_map_onto_tiers(name: str | None, medium: KvMedium) -> None:
    conv = KvEventConverter(1, B)
    event = conv.convert(VllmBlockStored(H[:1], None, TOKENS[:4], B, medium=name))
    assert event is not None and isinstance(event.data, KvBlockStored)
    assert event.data.medium is medium
    assert event.data.block_hashes == compute_block_hashes(TOKENS[:4], B)
    removed = conv.convert(VllmBlockRemoved(H[:1], medium=name))
    assert removed is not None and isinstance(removed.data, KvBlockRemoved)
    assert removed.data.medium is medium


def test_an_offload_eviction_keeps_the_device_hit_and_vice_versa() -> None:
    conv = KvEventConverter(1, B)
    index = KvIndexer(B)
    content = compute_block_hashes(TOKENS[:4], B)
    for event in (
        stored(H[:1], None, TOKENS[:4]),
        VllmBlockStored(H[:1], None, TOKENS[:4], B, medium="CPU"),
    ):
        converted = conv.convert(event)
        assert converted is not None
        index.apply(converted)
    assert index.tiers_of(1, content[0]) == {KvMedium.GPU, KvMedium.CPU}
    evicted_offload = conv.convert(VllmBlockRemoved(H[:1], medium="CPU"))
    assert evicted_offload is not None
    index.apply(evicted_offload)
    assert index.find_matches(content).scores == {1: 1}, "the device hit is still there"
    assert index.tiers_of(1, content[0]) == {KvMedium.GPU}
    # Offloaded again, then evicted from the device: the offloaded copy outlives it.
    for event in (
        VllmBlockStored(H[:1], None, TOKENS[:4], B, medium="CPU"),
        VllmBlockRemoved(H[:1], medium="GPU"),
    ):
        converted = conv.convert(event)
        assert converted is not None
        index.apply(converted)
    assert index.tiers_of(1, content[0]) == {KvMedium.CPU}
    assert conv.known_blocks == 1


def test_an_offloaded_copy_without_tokens_is_keyed_by_the_device_mapping() -> None:
    """vLLM's offloading connector may announce an offloaded block without its tokens;
    its vLLM hash, announced by the device tier first, names the same content."""
    conv = KvEventConverter(1, B)
    conv.convert(stored(H[:2], None, TOKENS[:8]))
    event = conv.convert(VllmBlockStored([H[1]], None, [], B, medium="CPU"))
    assert event is not None and isinstance(event.data, KvBlockStored)
    assert event.data.block_hashes == compute_block_hashes(TOKENS[:8], B)[1:]
    assert event.data.medium is KvMedium.CPU


def test_a_converter_may_index_the_device_tier_only() -> None:
    conv = KvEventConverter(1, B, media=[KvMedium.GPU])
    assert conv.convert(VllmBlockStored(H[:1], None, TOKENS[:4], B, medium="CPU")) is None
    assert conv.stats.dropped_medium == 1
