"""The K in force on an adaptive worker, shared from vLLM's engine core with the worker.

The adaptive scheduler (`speculative.scheduler`) chooses K in the engine core process, and the
worker process that owns the engine needs that K for its load reports, its `/metrics` and
the KV router's books. vLLM's stats reach the worker once per step but have no field for
it, so the two processes share a small memory-mapped file: the scheduler writes the K of
each decoding step, and the worker reads it when it reports. It is the same host by
construction (the engine core is the worker's child), and a write is a few bytes into a
page, so it costs the step nothing.

A sequence counter, odd while a write is under way (a seqlock), lets the reader take a
consistent pair without a lock across processes.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

MAX_COUNTED_K = 15
"""Steps are counted per K up to this K (a larger K counts as this one)."""
_LAYOUT = struct.Struct(f"<QqQ{MAX_COUNTED_K + 1}Q")
"""Sequence, K in force, decoding steps so far, then decoding steps at each K."""
_READ_TRIES = 8


def new_state_path() -> Path:
    """A fresh path for one worker's file: in shared memory where the host has it."""
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return folder / f"dynamo-speculation-{os.getpid()}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class SpeculationSnapshot:
    """What the scheduler last wrote."""

    k: int
    """The K its last decoding step chose."""
    steps: int
    """Decoding steps it has chosen a K for since the engine started."""
    steps_at_k: tuple[int, ...] = ()
    """Of those, the steps at K = 0, 1, ... (the engine's largest K last)."""


class SpeculationStateWriter:
    """The engine core's side: creates the file, then writes every step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _LAYOUT.size)
            self._map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        self._sequence = 0
        self._steps = 0
        self._at_k = [0] * (MAX_COUNTED_K + 1)

    def write(self, k: int) -> None:
        """One decoding step chose `k`."""
        self._steps += 1
        self._at_k[min(max(k, 0), MAX_COUNTED_K)] += 1
        self._sequence += 1  # odd: a write is under way
        _LAYOUT.pack_into(self._map, 0, self._sequence, k, self._steps, *self._at_k)
        self._sequence += 1
        _LAYOUT.pack_into(self._map, 0, self._sequence, k, self._steps, *self._at_k)

    def close(self) -> None:
        self._map.close()


class SpeculationStateReader:
    """The worker's side: opens the file once the engine core has created it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None

    def read(self) -> SpeculationSnapshot | None:
        """The last K written; None before the engine core wrote any (or created the
        file), or while writes kept overlapping the read."""
        if self._map is None and not self._open():
            return None
        assert self._map is not None
        for _ in range(_READ_TRIES):
            sequence, k, steps, *at_k = _LAYOUT.unpack_from(self._map, 0)
            if sequence == 0:
                return None
            if sequence % 2 == 0 and _LAYOUT.unpack_from(self._map, 0)[0] == sequence:
                last = max((i for i, n in enumerate(at_k) if n), default=0)
                return SpeculationSnapshot(k, steps, tuple(at_k[: last + 1]))
        return None

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size < _LAYOUT.size:
                return False
            self._map = mmap.mmap(fd, _LAYOUT.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        return True

    def close(self, *, remove: bool = False) -> None:
        """Unmap; with `remove`, delete the file too (the worker owns its lifetime)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        if remove:
            self.path.unlink(missing_ok=True)
