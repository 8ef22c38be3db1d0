"""Model cards on NATS: how a worker announces a model and a frontend discovers it.

* A card is a leased key in the `dyn_models` bucket, one per (model, worker instance), so
  a model is listed while at least one of its workers is alive and vanishes with the last.
  Key: `<namespace>.<escaped model name>.<instance hex>`.
* The tokenizer files (tokenizer.json, tokenizer_config.json, chat template, ...) go to the
  `dyn_files` object store under `<digest>/<file name>`, where the digest covers the names
  and bytes of all of them; a frontend on another host downloads them once per digest and
  needs no shared disk. Identical files from many workers are stored once.
* A card comes from the network, so its tokenizer fields are untrusted: the digest and the
  file names become paths in the frontend's cache. Only a 32-hex-digit digest and the
  known tokenizer file names are accepted (`check_tokenizer_fields`), a card failing that
  is refused by the watcher, and downloaded files must hash to the card's digest before
  they replace anything in the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
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
FETCH_TIMEOUT_S = 60.0
"""Longest a card's tokenizer download may take (a stalled object-store read fails the
fetch, and the card is retried, instead of holding card discovery forever)."""
CACHE_LOCK_TIMEOUT_S = 120.0
"""Longest a process waits for another one downloading into the shared cache."""
LOCK_POLL_S = 0.05

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
# `files_digest` output: 32 lowercase hex digits, nothing that could name another path.
_DIGEST = re.compile(r"[0-9a-f]{32}")
# JetStream bucket names: letters, digits, `_` and `-`.
_BUCKET = re.compile(r"[A-Za-z0-9_-]{1,64}")


class InvalidModelCardError(ValueError):
    """A card whose tokenizer fields are not what a worker publishes: used as paths they
    could reach outside the tokenizer cache, so the card is refused as a whole."""


class TokenizerDigestError(ValueError):
    """Downloaded tokenizer files do not hash to the card's digest (tampered or corrupt
    object-store content): they are discarded, never loaded."""


def check_tokenizer_fields(card: ModelCard) -> None:
    """Refuse a card whose tokenizer digest, file names or bucket could be used to build
    a path outside the cache (`/`, `..`, absolute paths, unknown names).

    Raises `InvalidModelCardError` naming the bad field; values are shown with `repr` so a
    hostile value cannot forge log lines."""
    digest = card.tokenizer_digest
    if digest is not None and not _DIGEST.fullmatch(digest):
        raise InvalidModelCardError(
            f"tokenizer_digest {digest!r} of model {card.name!r} is not 32 hex digits"
        )
    unknown = [name for name in card.tokenizer_files if name not in TOKENIZER_FILES]
    if unknown:
        raise InvalidModelCardError(
            f"tokenizer_files of model {card.name!r} name unknown files {unknown!r}; "
            f"accepted: {', '.join(TOKENIZER_FILES)}"
        )
    if len(set(card.tokenizer_files)) != len(card.tokenizer_files):
        raise InvalidModelCardError(f"tokenizer_files of model {card.name!r} repeat a name")
    bucket = card.tokenizer_bucket
    if bucket is not None and not _BUCKET.fullmatch(bucket):
        raise InvalidModelCardError(
            f"tokenizer_bucket {bucket!r} of model {card.name!r} is not a bucket name"
        )


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
    """sha256 over each file's name and sha256, in name order, cut to 32 hex digits: what
    a worker publishes as `tokenizer_digest` and a frontend checks after downloading."""
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
    digest, names = await upload_tokenizer_files(runtime, model_path)
    card.tokenizer_bucket = FILES_BUCKET
    card.tokenizer_files = names
    card.tokenizer_digest = digest
    await runtime.put_leased(MODELS_BUCKET, card_key(card), msgspec.msgpack.encode(card))
    log.info(
        "registered model %s (instance %s, tokenizer %s)",
        card.name,
        instance_hex(card.instance_id),
        digest,
    )
    return card


async def upload_tokenizer_files(
    runtime: DistributedRuntime, model_path: Path
) -> tuple[str, list[str]]:
    """Put the tokenizer files of `model_path` into the object store, skipping those
    already there (content-addressed). Returns their digest and names.

    Called again by a worker after every reconnect: a broker restarted without its store
    has lost them, and a frontend that has not cached them yet could not load the model.
    """
    files = tokenizer_files_in(Path(model_path))
    if not any(f.name == "tokenizer.json" or f.name == "tokenizer.model" for f in files):
        raise FileNotFoundError(f"{model_path} holds no tokenizer.json / tokenizer.model")
    digest = files_digest(files)
    store = await runtime.object_store(FILES_BUCKET)
    uploaded = 0
    for path in files:
        name = f"{digest}/{path.name}"
        try:
            await store.get_info(name)
            continue  # already uploaded (content-addressed)
        except Exception:
            pass
        await store.put(name, path.read_bytes())
        uploaded += 1
    if uploaded:
        log.info("uploaded %d tokenizer files of %s (%s)", uploaded, model_path, digest)
    return digest, [p.name for p in files]


async def remove_model_card(runtime: DistributedRuntime, card: ModelCard) -> None:
    await runtime.delete_leased(MODELS_BUCKET, card_key(card))


async def fetch_tokenizer_files(
    runtime: DistributedRuntime, card: ModelCard, dest_root: Path
) -> Path:
    """The card's tokenizer files in a local directory `dest_root/<digest>` (downloaded once).

    The card's fields are checked first (`check_tokenizer_fields`), so every path built here
    is a direct child of `dest_root`. Files are downloaded into a private staging directory
    inside `dest_root` and must hash to the card's digest (`files_digest`, as the worker
    computed it) before they replace the cached copy; a cached copy is re-checked the same
    way before it is trusted. Raises `TokenizerDigestError` on a mismatch. Processes sharing
    `dest_root` download one at a time and never replace a verified copy; a download that
    takes longer than `FETCH_TIMEOUT_S` fails with `TimeoutError` (the caller retries).
    """
    check_tokenizer_fields(card)
    digest = card.tokenizer_digest
    if not digest or not card.tokenizer_files:
        raise ValueError(f"model card of {card.name} carries no tokenizer files")
    root = Path(dest_root)
    target = root / digest
    names = list(card.tokenizer_files)
    if await asyncio.to_thread(_holds_verified_copy, target, names, digest):
        return target
    root.mkdir(parents=True, exist_ok=True)
    # The processes of `--http-workers` share the cache: one downloads at a time, and a
    # copy another process verified while this one waited is used, never replaced (a
    # process may be loading its tokenizer from it right now).
    async with _exclusive(root, timeout=CACHE_LOCK_TIMEOUT_S):
        if await asyncio.to_thread(_holds_verified_copy, target, names, digest):
            return target
        await asyncio.wait_for(_download(runtime, card, root, target, names), FETCH_TIMEOUT_S)
    return target


async def _download(
    runtime: DistributedRuntime, card: ModelCard, root: Path, target: Path, names: list[str]
) -> None:
    """Fetch `names` into a staging directory, check the digest, and move it to `target`
    (replacing a copy that failed verification)."""
    digest = card.tokenizer_digest or ""
    staging = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=root))
    try:
        store = await runtime.object_store(card.tokenizer_bucket or FILES_BUCKET)
        for name in names:
            result = await store.get(f"{digest}/{name}")
            (staging / name).write_bytes(result.data or b"")
        actual = await asyncio.to_thread(files_digest, [staging / name for name in names])
        if actual != digest:
            raise TokenizerDigestError(
                f"tokenizer files of model {card.name!r} hash to {actual}, not to the card's "
                f"digest {digest}; refusing them"
            )
        if target.exists() or target.is_symlink():
            _remove_cache_entry(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.asynccontextmanager
async def _exclusive(directory: Path, *, timeout: float) -> AsyncIterator[None]:
    """Hold an exclusive `flock` on `directory` itself (no lock file is left behind),
    polled without blocking the event loop; `TimeoutError` after `timeout` seconds."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(
                        f"the tokenizer cache {directory} stayed locked for {timeout:g}s"
                    ) from None
                await asyncio.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holds_verified_copy(target: Path, names: list[str], digest: str) -> bool:
    """Whether `target` already holds the named files, as plain files with that digest."""
    files = [target / name for name in names]
    if target.is_symlink() or not all(f.is_file() and not f.is_symlink() for f in files):
        return False
    try:
        return files_digest(files) == digest
    except OSError:
        return False


def _remove_cache_entry(path: Path) -> None:
    """Remove a stale `<cache>/<digest>` entry; a symlink is unlinked, never followed."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


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
        """Start watching; on return the cards registered now are queued as events."""
        await self._watcher.start()
        return self

    @property
    def pending(self) -> int:
        """Events queued and not yet taken (right after `start`: the first snapshot's)."""
        return self._queue.qsize()

    async def close(self) -> None:
        await self._watcher.close()

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            card = _card_decoder.decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring undecodable model card %s: %s", key, exc)
            return
        try:
            check_tokenizer_fields(card)
        except InvalidModelCardError as exc:
            log.error("refusing model card %r: %s", key, exc)
            self._on_delete(key)  # whatever the key held before is no longer advertised
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
