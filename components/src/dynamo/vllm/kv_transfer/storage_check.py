"""Does the decode worker see the prefill worker's KV-transfer directory?

On CPU, prefill and decode workers hand KV over through vLLM's ExampleConnector: the
prefill writes `<shared_storage_path>/<hash of the prompt>/...` and the decode worker looks
for the same name under *its* `shared_storage_path`. Nothing in vLLM checks that the two
paths are one directory. When they are not (workers on different hosts, each with its own
`/tmp`; or one host with two different paths), the decode worker silently finds nothing
and recomputes every prompt, or loads a stale entry some earlier prefill left there, while
the prefill worker's entries pile up until they expire.

So the check is made explicit:

* **prefill side** (`StorageProbeFile`): at start-up the prefill worker writes a file named
  `.dynamo-kv-probe-<random token>` (holding the token) into its transfer directory, and
  names the token, its path and its advertised host in every prefill result
  (`LLMEngineOutput.kv_storage`, forwarded by the frontend as `PrefillResult.kv_storage`)
  and on its model card. The file is refreshed by the janitor and removed at shutdown;
  probes of workers that died without removing theirs are swept after a day.
* **decode side** (`SharedStorageCheck`): before a request's transfer parameters reach
  vLLM, the decode worker looks for that file under its own transfer directory. Present:
  the directory is shared. Absent: the request fails with `KvStorageNotSharedError`,
  naming both paths, both hosts and the fix, and the worker logs it once per prefill
  worker, as an error. The verdict is cached per token (one `stat`+`read` per prefill
  worker, not per request); a negative one is re-checked after `recheck_s`, so a shared
  filesystem that shows new files late (NFS attribute caching), or is mounted later, is
  picked up without a restart.

Results without a probe (an older prefill worker or frontend, or a NIXL prefill) are
admitted as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dynamo.llm.protocols import KvStorageProbe

log = logging.getLogger(__name__)

PROBE_PREFIX = ".dynamo-kv-probe-"
TOKEN = re.compile(r"[0-9a-f]{32}")
"""A token is 128 random bits in hex; anything else is refused (it becomes a file name)."""
STALE_PROBE_S = 24 * 3600.0
"""Probe files not refreshed for this long belong to prefill workers that died (a live
one refreshes its own at every janitor sweep, at least once a minute)."""
DEFAULT_RECHECK_S = 5.0
MAX_CACHED_VERDICTS = 1024

FIX = (
    "Mount one shared directory (e.g. NFS) at the transfer path on every prefill and "
    "decode host (the path may differ per host; $DYN_KV_SHARED_STORAGE_PATH or "
    "kv_connector_extra_config.shared_storage_path), give same-host workers the same path, "
    "or use NixlConnector (--kv-transfer-config), which sends the KV over the network."
)


class KvStorageNotSharedError(RuntimeError):
    """A prefill result's KV is in a directory this decode worker cannot see. The runtime
    reports it to the frontend by this class name; the client gets HTTP 500 with the
    message (a deployment error, not the request's fault, and not worth retrying)."""


def probe_path(root: Path, token: str) -> Path:
    return root / f"{PROBE_PREFIX}{token}"


@dataclass
class StorageProbeFile:
    """The prefill side: this worker's probe file and what it advertises."""

    root: Path
    probe: KvStorageProbe

    @property
    def path(self) -> Path:
        return probe_path(self.root, self.probe.token)

    @classmethod
    def create(cls, root: Path, host: str) -> StorageProbeFile | None:
        """Write a fresh probe into `root` (atomically: a decode worker never reads a half
        file). None, logged, when the directory cannot be written: the worker still
        serves, its results just carry no probe."""
        token = secrets.token_hex(16)
        probe = KvStorageProbe(token=token, path=str(root), host=host)
        final = probe_path(root, token)
        staging = root / f".{final.name}.tmp"
        try:
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(token)
            os.rename(staging, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                staging.unlink()
            log.error(
                "cannot write the KV-transfer probe into %s (%s): decode workers cannot "
                "check that they share this directory",
                root,
                exc,
            )
            return None
        return cls(root, probe)

    def refresh(self) -> None:
        """Mark the probe alive (sweeps remove probes not refreshed for a day); rewritten
        when something removed it."""
        try:
            os.utime(self.path)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                self.path.write_text(self.probe.token)
        except OSError:
            pass

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def sweep_stale_probes(root: Path, now: float | None = None, keep: Path | None = None) -> int:
    """Remove probe files of dead prefill workers (not refreshed for `STALE_PROBE_S`);
    returns how many. Only regular files named like a probe are touched."""
    now = time.time() if now is None else now
    removed = 0
    try:
        with os.scandir(root) as children:
            names = [c.name for c in children if c.name.startswith(PROBE_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = root / name
        if path == keep or not TOKEN.fullmatch(name[len(PROBE_PREFIX) :]):
            continue
        with contextlib.suppress(OSError):
            info = path.lstat()
            if path.is_file() and not path.is_symlink() and now - info.st_mtime > STALE_PROBE_S:
                path.unlink()
                removed += 1
    return removed


class SharedStorageCheck:
    """The decode side: does a prefill result's directory coincide with ours?"""

    def __init__(
        self,
        own_root: Path,
        own_host: str,
        *,
        recheck_s: float = DEFAULT_RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.own_root = Path(own_root)
        self.own_host = own_host
        self.recheck_s = recheck_s
        self._clock = clock
        self._verdicts: dict[str, tuple[str | None, float]] = {}
        self._reported: set[str] = set()

    def problem(self, probe: KvStorageProbe) -> str | None:
        """Why KV behind `probe` cannot be loaded here (None: it can), cached per token."""
        now = self._clock()
        cached = self._verdicts.get(probe.token)
        if cached is not None and (cached[0] is None or now - cached[1] < self.recheck_s):
            return cached[0]
        verdict = self._look(probe)
        if len(self._verdicts) >= MAX_CACHED_VERDICTS:
            self._verdicts.clear()  # prefill workers come and go; this only costs a stat
        self._verdicts[probe.token] = (verdict, now)
        if verdict is not None and probe.token not in self._reported:
            self._reported.add(probe.token)
            log.error("%s (reported once per prefill worker)", verdict)
        elif verdict is None and probe.token in self._reported:
            self._reported.discard(probe.token)
            log.info("the KV-transfer directory of prefill worker on %s is visible now", probe.host)
        return verdict

    def check(self, probe: KvStorageProbe | None) -> None:
        """Raise `KvStorageNotSharedError` when `probe` names a directory not shared with
        ours; a missing probe (an older peer) passes."""
        if probe is None:
            return
        problem = self.problem(probe)
        if problem is not None:
            raise KvStorageNotSharedError(problem)

    def _look(self, probe: KvStorageProbe) -> str | None:
        if not TOKEN.fullmatch(probe.token):
            return f"malformed KV-transfer probe from the prefill worker on {probe.host or '?'}"
        try:
            found = probe_path(self.own_root, probe.token).read_text() == probe.token
        except OSError:
            found = False
        if found:
            return None
        return (
            "KV transfer directory not shared: the prefill worker on host "
            f"{probe.host or '?'} wrote this prompt's KV under {probe.path or '?'}, but this "
            f"decode worker on host {self.own_host} reads {self.own_root} and does not see "
            f"that worker's probe file ({PROBE_PREFIX}{probe.token}) there, so it could "
            f"never load the KV. {FIX}"
        )
