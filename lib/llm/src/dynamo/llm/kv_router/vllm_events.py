"""vLLM KV-cache events: decoding the publisher's batches and re-keying them by content.

Wire format (vLLM 0.32, ``vllm/distributed/kv_events.py``): each ZMQ message carries one
msgpack ``EventBatch``, an array ``[ts, events, data_parallel_rank]``. An event is a map
tagged by ``type``::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": B, "lora_id": ..., "medium": "GPU", "lora_name": ...,
     "extra_keys": [...] | None, "group_idx": g, ...}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": g}
    {"type": "AllBlocksCleared"}

Older vLLM releases encoded events as positional arrays with the tag first
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium?]``); both forms decode to the same objects. vLLM block hashes are ``bytes``
(sha256) by default, or ints with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``; they are
opaque keys here.

vLLM's hashes depend on the engine's hash function and seed, so the router cannot compute
them. `KvEventConverter` therefore re-keys every stored block by its *content hash*
(`hashing.compute_block_hashes` over the event's token ids, chained from the parent's
content hash) and remembers ``vLLM hash -> content hash`` only to resolve parent links and
``BlockRemoved``.

Tiers: every event keeps vLLM's ``medium`` as a `KvMedium` (``GPU``, or absent in old
releases: the device tier; ``CPU``: host memory; ``STORAGE``, or Mooncake's ``disk``: disk;
any case). A block may sit in several tiers at once (an offload connector copies it out,
and the device copy may stay), so the converter keeps, per vLLM hash, the set of tiers that
announced it, and a removal only ends the copy in the tier it names: an offload-tier
eviction never erases a device-tier hit, nor a device eviction the offloaded copy that
outlives it. An offloaded block whose vLLM hash the device tier announced already is
re-keyed by that mapping, so it is indexed even when the connector sends no tokens.

What is deliberately *not* indexed (dropped and counted in `ConverterStats`):

* blocks stored under a LoRA adapter (``lora_id`` / ``lora_name``): requests carry no
  adapter, so matching them by token content alone would report false cache hits;
* blocks with ``extra_keys`` (multimodal features, ``cache_salt``, prompt embeddings): their
  KV is not determined by the token ids;
* a ``medium`` that is none of the above (or a tier the converter was told not to index);
  vLLM labels its primary pool ``GPU`` on every platform, the CPU build included;
* KV-cache groups other than the primary one (hybrid models emit one event per group with
  different block sizes), and events whose ``block_size`` is not the worker's;
* a store whose parent is unknown (stored before the relay started, or dropped by a rule
  above): its content hash cannot be computed;
* a store whose token count is not ``len(block_hashes) * block_size`` (vLLM skipped null
  or masked blocks, so tokens and hashes no longer line up).

Dropping is always safe for routing: a missing block only loses a cache hit, never
invents one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

from dynamo.llm.kv_router.hashing import compute_block_hashes
from dynamo.llm.kv_router.tiers import TIER_ORDER
from dynamo.llm.protocols import (
    KvAllCleared,
    KvBlockRemoved,
    KvBlockStored,
    KvMedium,
    RouterEvent,
)

VllmBlockHash: TypeAlias = bytes | int
"""vLLM's own block hash: sha256 bytes by default, an int when configured so."""

VLLM_MEDIA: dict[str, KvMedium] = {
    "GPU": KvMedium.GPU,
    "CPU": KvMedium.CPU,
    "STORAGE": KvMedium.STORAGE,
    "DISK": KvMedium.STORAGE,
}
"""vLLM's ``medium`` names (upper-cased) as tiers; ``None`` (releases before media) is GPU."""


def medium_of(name: str | None) -> KvMedium | None:
    """The tier of a vLLM ``medium``; None for a name this router does not know."""
    return KvMedium.GPU if name is None else VLLM_MEDIA.get(name.upper())


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class KvEventDecodeError(ValueError):
    """A payload that is not a vLLM KV event batch."""


# --------------------------------------------------------------------------- typed events


@dataclass(frozen=True, slots=True)
class VllmBlockStored:
    """Blocks that became cached on the engine, with the tokens they hold."""

    block_hashes: list[VllmBlockHash]
    parent_block_hash: VllmBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class VllmBlockRemoved:
    """Blocks evicted from the engine's cache."""

    block_hashes: list[VllmBlockHash]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class VllmAllBlocksCleared:
    """The engine reset its prefix cache."""


@dataclass(frozen=True, slots=True)
class VllmUnknownEvent:
    """An event type this relay does not know (a newer vLLM); skipped, not fatal."""

    type: str


VllmKvEvent: TypeAlias = (
    VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared | VllmUnknownEvent
)


@dataclass(frozen=True, slots=True)
class VllmEventBatch:
    """One published message: the events of one engine step."""

    ts: float
    events: list[VllmKvEvent]
    data_parallel_rank: int | None = None


# --------------------------------------------------------------------------- decoding


def decode_event_batch(payload: bytes) -> VllmEventBatch:
    """Decode one msgpack ``EventBatch`` (array or map form, tagged-map or positional
    events). Raises `KvEventDecodeError` when the payload has another shape."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventDecodeError(f"not msgpack: {exc}") from exc
    return batch_from_builtins(raw)


def batch_from_builtins(raw: Any) -> VllmEventBatch:
    """Build a batch from already-decoded msgpack values."""
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvEventDecodeError(f"event batch must be an array or map, got {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise KvEventDecodeError("event batch needs a numeric ts and a list of events")
    if rank is not None and not isinstance(rank, int):
        raise KvEventDecodeError("data_parallel_rank must be an integer")
    return VllmEventBatch(float(ts), [event_from_builtins(e) for e in events], rank)


def event_from_builtins(raw: Any) -> VllmKvEvent:
    """One event from its map (``{"type": ...}``) or positional (``[type, ...]``) form."""
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag, fields = raw[0], None
    else:
        raise KvEventDecodeError(f"event must be a tagged map or array, got {raw!r:.80}")
    if not isinstance(tag, str):
        raise KvEventDecodeError(f"event tag must be a string, got {tag!r:.40}")
    if tag == "BlockStored":
        values = fields if fields is not None else _positional(raw, _STORED_FIELDS)
        return _stored(values)
    if tag == "BlockRemoved":
        values = fields if fields is not None else _positional(raw, _REMOVED_FIELDS)
        return _removed(values)
    if tag == "AllBlocksCleared":
        return VllmAllBlocksCleared()
    return VllmUnknownEvent(tag)


def _positional(raw: list[Any], names: Sequence[str]) -> dict[str, Any]:
    """Name the fields of an array-encoded event (trailing defaults may be omitted)."""
    return dict(zip(names, raw[1:], strict=False))


def _stored(values: dict[str, Any]) -> VllmBlockStored:
    block_size = values.get("block_size")
    if not isinstance(block_size, int) or block_size <= 0:
        raise KvEventDecodeError(f"BlockStored needs a positive block_size, got {block_size!r}")
    token_ids = values.get("token_ids")
    if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
        raise KvEventDecodeError("BlockStored needs a list of integer token_ids")
    return VllmBlockStored(
        block_hashes=_hash_list(values.get("block_hashes")),
        parent_block_hash=_optional_hash(values.get("parent_block_hash")),
        token_ids=token_ids,
        block_size=block_size,
        lora_id=_optional(values.get("lora_id"), int, "lora_id"),
        medium=_optional(values.get("medium"), str, "medium"),
        lora_name=_optional(values.get("lora_name"), str, "lora_name"),
        extra_keys=_optional(values.get("extra_keys"), list, "extra_keys"),
        group_idx=_optional(values.get("group_idx"), int, "group_idx"),
        kv_cache_spec_kind=_optional(values.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
    )


def _removed(values: dict[str, Any]) -> VllmBlockRemoved:
    return VllmBlockRemoved(
        block_hashes=_hash_list(values.get("block_hashes")),
        medium=_optional(values.get("medium"), str, "medium"),
        group_idx=_optional(values.get("group_idx"), int, "group_idx"),
    )


def _hash_list(value: Any) -> list[VllmBlockHash]:
    if not isinstance(value, list) or not all(isinstance(h, (bytes, int)) for h in value):
        raise KvEventDecodeError("block_hashes must be a list of bytes or integers")
    return value


def _optional_hash(value: Any) -> VllmBlockHash | None:
    if value is None or isinstance(value, (bytes, int)):
        return value
    raise KvEventDecodeError(
        f"parent_block_hash must be bytes, an integer or nil, got {value!r:.40}"
    )


def _optional(value: Any, type_: type, name: str) -> Any:
    if value is None or isinstance(value, type_):
        return value
    raise KvEventDecodeError(f"{name} must be {type_.__name__} or nil, got {value!r:.40}")


# --------------------------------------------------------------------------- conversion


@dataclass(slots=True)
class ConverterStats:
    """What the converter did, by outcome (exported by the relay for debugging)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    dropped_lora: int = 0
    dropped_extra_keys: int = 0
    dropped_medium: int = 0
    dropped_group: int = 0
    dropped_block_size: int = 0
    dropped_misaligned: int = 0
    dropped_orphan: int = 0
    unknown_removals: int = 0
    unknown_events: int = 0


class KvEventConverter:
    """Turns one worker's vLLM events into `RouterEvent`s keyed by content hashes.

    Event ids are consecutive per converter, starting at `first_event_id`; a relay that
    restarts starts again with a `clear()` so the indexer accepts the restarted sequence.
    """

    def __init__(
        self,
        worker_id: int,
        block_size: int,
        *,
        media: Iterable[KvMedium] = TIER_ORDER,
        kv_group: int = 0,
        first_event_id: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.media = frozenset(media)
        self.kv_group = kv_group
        self.stats = ConverterStats()
        self._next_event_id = first_event_id
        self._content_of: dict[VllmBlockHash, int] = {}  # vLLM hash -> content hash
        self._media_of: dict[VllmBlockHash, set[KvMedium]] = {}  # tiers that announced it
        # (tier, content hash) -> vLLM hashes naming that content in that tier
        self._refs: dict[tuple[KvMedium, int], int] = {}

    @property
    def known_blocks(self) -> int:
        """vLLM blocks currently mapped (bounded by the engine's cache size)."""
        return len(self._content_of)

    def content_hash(self, vllm_hash: VllmBlockHash) -> int | None:
        return self._content_of.get(vllm_hash)

    def clear(self) -> RouterEvent:
        """Forget every mapping and announce an empty cache (relay start, lost events)."""
        self._content_of.clear()
        self._media_of.clear()
        self._refs.clear()
        self.stats.clears += 1
        return self._emit(KvAllCleared())

    def convert_batch(self, batch: VllmEventBatch) -> list[RouterEvent]:
        """Convert a batch in order; events that are not indexed produce nothing."""
        out: list[RouterEvent] = []
        for event in batch.events:
            converted = self.convert(event)
            if converted is not None:
                out.append(converted)
        return out

    def convert(self, event: VllmKvEvent) -> RouterEvent | None:
        """One vLLM event as a `RouterEvent`, or None when there is nothing to index."""
        if isinstance(event, VllmBlockStored):
            return self._convert_stored(event)
        if isinstance(event, VllmBlockRemoved):
            return self._convert_removed(event)
        if isinstance(event, VllmAllBlocksCleared):
            return self.clear()
        self.stats.unknown_events += 1
        return None

    # ------------------------------------------------------------------ internals

    def _convert_stored(self, event: VllmBlockStored) -> RouterEvent | None:
        medium = self._medium(event.medium)
        if medium is None or (event.group_idx or 0) != self.kv_group:
            self._drop("medium" if medium is None else "group")
            return None
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self._content_of.get(event.parent_block_hash)
        known = [self._content_of.get(h) for h in event.block_hashes]
        if medium is not KvMedium.GPU and event.block_hashes and None not in known:
            # An offloaded copy of blocks the device tier announced: same content.
            contents = [content for content in known if content is not None]
        else:
            reason = self._store_rejection(event)
            if reason is None and event.parent_block_hash is not None and parent is None:
                reason = "orphan"
            if reason is not None:
                self._drop(reason)
                return None
            contents = compute_block_hashes(event.token_ids, self.block_size, parent)
        for vllm_hash, content in zip(event.block_hashes, contents, strict=True):
            self._map(vllm_hash, content, medium)
        self.stats.stored_blocks += len(contents)
        return self._emit(KvBlockStored(block_hashes=contents, parent_hash=parent, medium=medium))

    def _medium(self, name: str | None) -> KvMedium | None:
        """The event's tier, or None when it is unknown or not indexed here."""
        medium = medium_of(name)
        return medium if medium in self.media else None

    def _store_rejection(self, event: VllmBlockStored) -> str | None:
        """Why a stored event cannot be indexed (see the module docstring), or None."""
        if event.lora_id is not None or event.lora_name is not None:
            return "lora"
        if event.extra_keys is not None and any(k is not None for k in event.extra_keys):
            return "extra_keys"
        if event.block_size != self.block_size:
            return "block_size"
        if (
            not event.block_hashes
            or len(event.token_ids) != len(event.block_hashes) * self.block_size
        ):
            return "misaligned"
        return None

    def _convert_removed(self, event: VllmBlockRemoved) -> RouterEvent | None:
        medium = self._medium(event.medium)
        if medium is None or (event.group_idx or 0) != self.kv_group:
            self._drop("medium" if medium is None else "group")
            return None
        removed: list[int] = []
        for vllm_hash in event.block_hashes:
            content = self._unmap(vllm_hash, medium)
            if content is not None:
                removed.append(content)
        if not removed:
            return None
        self.stats.removed_blocks += len(removed)
        return self._emit(KvBlockRemoved(block_hashes=removed, medium=medium))

    def _map(self, vllm_hash: VllmBlockHash, content: int, medium: KvMedium) -> None:
        """Remember a stored block in `medium`; storing the same block again (vLLM
        re-reports reused prefixes in "full" report mode) changes nothing."""
        previous = self._content_of.get(vllm_hash)
        if previous is not None and previous != content:
            for held in list(self._media_of.get(vllm_hash, ())):
                self._unmap(vllm_hash, held)
        media = self._media_of.setdefault(vllm_hash, set())
        self._content_of[vllm_hash] = content
        if medium in media:
            return
        media.add(medium)
        key = (medium, content)
        self._refs[key] = self._refs.get(key, 0) + 1

    def _unmap(self, vllm_hash: VllmBlockHash, medium: KvMedium) -> int | None:
        """Forget a vLLM block in `medium`; returns its content hash when no other vLLM
        block still names the same content in that tier (only then has the content left
        the tier)."""
        media = self._media_of.get(vllm_hash)
        if media is None or medium not in media:
            self.stats.unknown_removals += 1
            return None
        media.discard(medium)
        content = self._content_of[vllm_hash]
        if not media:
            del self._media_of[vllm_hash]
            del self._content_of[vllm_hash]
        key = (medium, content)
        left = self._refs[key] - 1
        if left:
            self._refs[key] = left
            return None
        del self._refs[key]
        return content

    def _drop(self, reason: str) -> None:
        attr = f"dropped_{reason}"
        setattr(self.stats, attr, getattr(self.stats, attr) + 1)

    def _emit(self, data: KvBlockStored | KvBlockRemoved | KvAllCleared) -> RouterEvent:
        event = RouterEvent(worker_id=self.worker_id, event_id=self._next_event_id, data=data)
        self._next_event_id += 1
        return event
