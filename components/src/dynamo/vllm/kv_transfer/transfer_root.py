"""The directory the CPU KV connector shares between workers, owned by dynamo.

`KvTransferJanitor` deletes directories, so it must only ever delete what vLLM's
ExampleConnector wrote, in a directory dynamo made for it. Without that rule a connector
config naming the system temp directory (vLLM's default `shared_storage_path` is `/tmp`)
would let the janitor sweep other programs' directories, a running nats-server's
JetStream store among them. The rules:

* **Ours.** `TransferRoot.claim` creates the directory (mode 0700) with a marker file
  inside, atomically: it is built under a temporary name and renamed into place, so a
  peer worker never sees it without the marker. A directory that already exists is never
  adopted: it is used only if it carries the marker, is a real directory (not a symlink),
  belongs to this user and is writable by nobody else (`TransferRoot.problem`).
* **Entries only.** Within it, only entries shaped like the connector's are touched
  (`is_transfer_entry`): a directory named by the hex digest of the prompt's tokens
  (`vllm.utils.hashing.safe_hash`: md5, or sha256 where FIPS forbids md5) holding nothing
  but `<layer name>.safetensors` files. Removal unlinks those files and then the empty
  directory; it never recurses into anything else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER_NAME = ".dynamo-kv-transfer"
MARKER_TEXT = (
    "This directory was created by dynamo for vLLM's ExampleConnector (KV transfer).\n"
    "dynamo's KV-transfer janitor deletes expired transfer entries in it.\n"
)
# md5 (32) or sha256 (64) hex digest: the names `safe_hash(...).hexdigest()` produces.
ENTRY_NAME = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")
# `<layer name>.safetensors`: what the connector writes into an entry.
ENTRY_FILE = re.compile(r"[^/\x00]+\.safetensors")


def is_transfer_entry(path: Path) -> bool:
    """Whether `path` looks exactly like one ExampleConnector entry (see module doc)."""
    if not ENTRY_NAME.fullmatch(path.name):
        return False
    try:
        if not stat.S_ISDIR(path.lstat().st_mode):
            return False
        with os.scandir(path) as children:
            return all(
                ENTRY_FILE.fullmatch(child.name) and child.is_file(follow_symlinks=False)
                for child in children
            )
    except OSError:
        return False


def remove_transfer_entry(path: Path) -> bool:
    """Remove one entry that `is_transfer_entry` accepts: its files, then the directory.
    Returns whether it is gone. Anything else is left alone."""
    if not is_transfer_entry(path):
        return False
    with contextlib.suppress(FileNotFoundError), os.scandir(path) as children:
        for child in children:
            if ENTRY_FILE.fullmatch(child.name) and child.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child.path)
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:  # the connector wrote a new layer meanwhile: keep it
        return False
    return True


@dataclass(frozen=True)
class TransferRoot:
    """The shared KV-transfer directory, with the checks that make it safe to sweep."""

    path: Path

    @property
    def marker(self) -> Path:
        return self.path / MARKER_NAME

    def claim(self) -> None:
        """Create the directory (0700, with the marker) unless something is already there.

        Must run before the connector's first write, which would create the directory
        itself without a marker. An existing path is left as it is; `problem` says
        whether it may be used."""
        if os.path.lexists(self.path):
            return
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=parent))
        try:
            fd = os.open(staging / MARKER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as marker:
                marker.write(MARKER_TEXT)
            # A peer worker may have won the race (ENOTEMPTY): its directory stays, and
            # any other failure leaves the path as it is, for `problem` to report.
            with contextlib.suppress(OSError):
                os.rename(staging, self.path)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def problem(self) -> str | None:
        """Why the directory must not be swept, or None when it is ours."""
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return f"{self.path} does not exist"
        if stat.S_ISLNK(info.st_mode):
            return f"{self.path} is a symbolic link"
        if not stat.S_ISDIR(info.st_mode):
            return f"{self.path} is not a directory"
        if info.st_uid != os.geteuid():
            return f"{self.path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{self.path} is writable by group or others (mode {info.st_mode & 0o777:o})"
        try:
            marker = self.marker.lstat()
        except FileNotFoundError:
            return f"{self.path} was not created by dynamo (no {MARKER_NAME} marker)"
        if not stat.S_ISREG(marker.st_mode) or marker.st_uid != info.st_uid:
            return f"{self.marker} is not a regular file of this user"
        return None

    def entries(self) -> list[Path]:
        """The transfer entries directly under the directory (nothing else)."""
        try:
            with os.scandir(self.path) as children:
                names = [child.name for child in children]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [self.path / name for name in names if is_transfer_entry(self.path / name)]
