"""Model cards on NATS: how a worker announces a model and a frontend discovers it.

* A card is a leased key in the `dyn_models` bucket, one per (model, worker instance), so
  a model is listed while at least one of its workers is alive and vanishes with the last.
  Key: `<namespace>.<escaped model name>.<instance hex>`.
* The tokenizer files (tokenizer.json, tokenizer_config.json, chat template, ...) go to the
  `dyn_files` object store under `<digest>/<file name>`, where the digest covers the names
  and bytes of all of them; a frontend on another host downloads them once per digest and
  needs no shared disk. Identical files from many workers are stored once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamo.llm.protocols import ModelCard
from dynamo.runtime import DistributedRuntime
from dynamo.runtime.naming import instance_hex

log = logging.getLogger(__name__)

MODELS_BUCKET = "dyn_models"
FILES_BUCKET = "dyn_files"

# Files a frontend needs to tokenize, template and detokenize exactly like the worker.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

_card_decoder = msgspec.msgpack.Decoder(ModelCard)
_KEY_SAFE = re.compile(r"[A-Za-z0-9_-]")


def escape_model_name(name: str) -> str:
    """A model name as one KV key segment: unsafe characters become `=XX` (hex bytes)."""
    return "".join(
        ch if _KEY_SAFE.match(ch) else "".join(f"={b:02X}" for b in ch.encode()) for ch in name
    )


def card_key(card: ModelCard) -> str:
    return f"{card.namespace}.{escape_model_name(card.name)}.{instance_hex(card.instance_id)}"


def tokenizer_files_in(model_path: Path) -> list[Path]:
    """The tokenizer-related files present in a model directory."""
    return [model_path / name for name in TOKENIZER_FILES if (model_path / name).is_file()]


def files_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


async def publish_model_card(
    runtime: DistributedRuntime, card: ModelCard, model_path: Path
) -> ModelCard:
    """Upload the tokenizer files (once per digest) and register `card` (leased).

    Returns the card as registered, with its tokenizer fields filled in.
    """
    files = tokenizer_files_in(Path(model_path))
    if not any(f.name == "tokenizer.json" or f.name == "tokenizer.model" for f in files):
        raise FileNotFoundError(f"{model_path} holds no tokenizer.json / tokenizer.model")
    digest = files_digest(files)
    store = await runtime.object_store(FILES_BUCKET)
    for path in files:
        name = f"{digest}/{path.name}"
        try:
            await store.get_info(name)
            continue  # already uploaded (content-addressed)
        except Exception:
            pass
        await store.put(name, path.read_bytes())
    card.tokenizer_bucket = FILES_BUCKET
    card.tokenizer_files = [p.name for p in files]
    card.tokenizer_digest = digest
    await runtime.put_leased(MODELS_BUCKET, card_key(card), msgspec.msgpack.encode(card))
    log.info(
        "registered model %s (instance %s, tokenizer %s)",
        card.name,
        instance_hex(card.instance_id),
        digest,
    )
    return card


async def remove_model_card(runtime: DistributedRuntime, card: ModelCard) -> None:
    await runtime.delete_leased(MODELS_BUCKET, card_key(card))


async def fetch_tokenizer_files(
    runtime: DistributedRuntime, card: ModelCard, dest_root: Path
) -> Path:
    """The card's tokenizer files in a local directory `dest_root/<digest>` (downloaded once)."""
    if not card.tokenizer_digest or not card.tokenizer_files:
        raise ValueError(f"model card of {card.name} carries no tokenizer files")
    target = Path(dest_root) / card.tokenizer_digest
    if all((target / name).is_file() for name in card.tokenizer_files):
        return target
    Path(dest_root).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{card.tokenizer_digest}.", dir=dest_root))
    try:
        store = await runtime.object_store(card.tokenizer_bucket or FILES_BUCKET)
        for name in card.tokenizer_files:
            result = await store.get(f"{card.tokenizer_digest}/{name}")
            (staging / name).write_bytes(result.data or b"")
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class CardAdded:
    card: ModelCard


@dataclass(frozen=True)
class CardRemoved:
    card: ModelCard


CardEvent = CardAdded | CardRemoved


class ModelCardWatcher:
    """Async iterator of `CardAdded` / `CardRemoved` for every card in a namespace (or all
    namespaces when `namespace` is None). The current cards come first as `CardAdded`."""

    def __init__(self, runtime: DistributedRuntime, namespace: str | None = None) -> None:
        import asyncio

        self._queue: asyncio.Queue[CardEvent] = asyncio.Queue()
        self._cards: dict[str, ModelCard] = {}
        key_filter = f"{namespace}.>" if namespace else ">"
        self._watcher = runtime.watch_bucket(
            MODELS_BUCKET, key_filter, on_put=self._on_put, on_delete=self._on_delete
        )

    @property
    def cards(self) -> list[ModelCard]:
        return list(self._cards.values())

    async def start(self) -> ModelCardWatcher:
        await self._watcher.start()
        return self

    async def close(self) -> None:
        await self._watcher.close()

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            card = _card_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring undecodable model card %s: %s", key, exc)
            return
        known = self._cards.get(key)
        self._cards[key] = card
        if known is None or known != card:
            self._queue.put_nowait(CardAdded(card))

    def _on_delete(self, key: str) -> None:
        card = self._cards.pop(key, None)
        if card is not None:
            self._queue.put_nowait(CardRemoved(card))

    def __aiter__(self) -> AsyncIterator[CardEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[CardEvent]:
        while True:
            yield await self._queue.get()
