"""py-spy profiles of running processes, and summaries of them that fit in a table.

`recording(pids, out_dir)` runs `py-spy record --format raw` against each process for the
duration of a `with` block (py-spy writes its file when interrupted), and `summarise`
reads one such file (collapsed stacks: `frame;frame;... count`, outermost first) into:

* shares by *area* (`area_of`: the project's own modules by package, libraries by name,
  the event loop's own code): which layer the CPU goes to;
* the functions with the most *own* samples (the frame on top of the stack): where
  the CPU is actually spent;
* the functions with the most *inclusive* samples (anywhere on the stack below the event
  loop, counted once per stack): which calls are expensive with everything they call.

Samples count only while a thread holds the GIL, so the shares are of the process's busy
time (an event loop waiting for I/O has released it).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

SAMPLE_RATE = 500  # per second: py-spy counts only busy samples, so ~CPU seconds x 500

# "function (path/to/file.py:123)" or "function (path/to/file.py)"
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")

# py-spy names a file by its path below the sys.path entry it was imported from
# ("aiohttp/http_writer.py", "frontend/http/generation.py": the `dynamo` namespace package's
# subpackages appear without their `dynamo/`). The first component says whose it is.
_OURS = {"frontend", "runtime", "llm", "mocker", "vllm", "testing"}
_LIBRARIES = {"nats": "nats-py"}  # shown under another name than their directory's

# The event loop's run call: frames above it (runpy, main) are on every stack, and a
# sample whose top frame is this one is time spent in the loop itself (uvloop's C code).
_LOOP_ENTRY = "runners.py:Runner.run"


class ProfilerUnavailable(RuntimeError):
    """py-spy is not installed or cannot attach (ptrace refused)."""


@dataclass(frozen=True)
class FlameSummary:
    """One process's profile, reduced (see the module docstring)."""

    samples: int
    areas: list[tuple[str, float]]  # (area, share of samples), largest first
    own: list[tuple[str, float]]  # (function, share), largest first
    inclusive: list[tuple[str, float]]

    def as_dict(self) -> dict[str, object]:
        """Every field, for the benchmark's JSON."""
        return asdict(self)


def py_spy() -> str:
    """The py-spy executable; raises `ProfilerUnavailable` when there is none."""
    beside = Path(sys.executable).with_name("py-spy")  # the virtualenv's, not on PATH
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise ProfilerUnavailable("py-spy is not installed (pip install py-spy)")
    return found


@contextlib.contextmanager
def recording(
    pids: Mapping[str, int], out_dir: Path, subprocesses: bool = False
) -> Iterator[dict[str, Path]]:
    """Record each process (name → pid), and with `subprocesses` its children too, while
    the block runs; yields name → the raw file it will hold once the block has ended.

    Only samples holding the GIL count (`--gil`): an event loop waiting in epoll has
    released it, so the shares are of busy time, not of wall time."""
    exe = py_spy()
    files = {name: out_dir / f"profile-{name}.txt" for name in pids}
    procs = []
    for name, pid in pids.items():
        argv = [
            exe, "record", "--pid", str(pid), "--format", "raw", "--rate", str(SAMPLE_RATE),
            "--nonblocking", "--gil", "--output", str(files[name]),
            *(["--subprocesses"] if subprocesses else []),
        ]  # fmt: skip
        log = open(out_dir / f"py-spy-{name}.log", "wb")
        procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        time.sleep(0.5)  # attached before the measured work starts
        if any(proc.poll() is not None for proc, _ in procs):
            raise ProfilerUnavailable(f"py-spy exited at once; see {out_dir}/py-spy-*.log")
        yield files
    finally:
        for proc, _log in procs:
            proc.send_signal(signal.SIGINT)
        for proc, log in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()


def area_of(path: str) -> str:
    """Which layer a source file (as py-spy names it) belongs to: `dynamo.<subpackage>`,
    a library's name, `asyncio`, or `stdlib` for the rest of the standard library."""
    head, sep, _ = path.partition("/")
    if not sep:
        return "stdlib"  # a top-level module (random.py, uuid.py) or <frozen ...>
    if head in _OURS:
        return f"dynamo.{head}"
    return _LIBRARIES.get(head, head)


def parse_frame(frame: str) -> tuple[str, str]:
    """(function label `file.py:function`, source path) of one collapsed frame."""
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip(), ""
    path = match["file"]
    return f"{Path(path).name}:{match['func']}", path


def summarise(raw: Path, top: int = 12) -> FlameSummary:
    """Read a `py-spy record --format raw` file (see the module docstring)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [parse_frame(f) for f in stack.split(";")]
        frames = [f for f in frames if f[1]]  # drop the process / thread labels
        if not frames:
            continue
        total += count
        label, path = frames[-1]
        own[label] += count
        areas["event loop" if label == _LOOP_ENTRY else area_of(path)] += count
        labels = [label for label, _ in frames]
        below_loop = labels[labels.index(_LOOP_ENTRY) + 1 :] if _LOOP_ENTRY in labels else labels
        for function in set(below_loop):
            inclusive[function] += count
    return FlameSummary(
        total,
        _shares(areas, total, len(areas)),
        _shares(own, total, top),
        _shares(inclusive, total, top),
    )


def _shares(counts: Counter[str], total: int, top: int) -> list[tuple[str, float]]:
    return [(name, round(n / max(1, total), 3)) for name, n in counts.most_common(top)]


def render(name: str, summary: FlameSummary, rows: int = 8) -> str:
    """A plain-text block: areas, then own and inclusive top functions."""

    def column(pairs: Sequence[tuple[str, float]]) -> list[str]:
        return [f"{share:6.1%}  {label}" for label, share in pairs[:rows]]

    lines = [f"{name}: {summary.samples} samples"]
    lines.append("  by area:      " + ", ".join(f"{a} {s:.0%}" for a, s in summary.areas[:8]))
    lines.append("  own time:")
    lines += [f"    {entry}" for entry in column(summary.own)]
    lines.append("  inclusive:")
    lines += [f"    {entry}" for entry in column(summary.inclusive)]
    return "\n".join(lines)


def profile_while(
    pids: Mapping[str, int],
    work: Callable[[], object],
    out_dir: Path,
    keep: Path | None,
    subprocesses: bool = False,
) -> dict[str, dict[str, object]]:
    """Run `work` with py-spy on each process (name → pid); print each summary and return
    them (as dicts, for a JSON report). The raw profiles are copied to
    `<keep stem>.profile-<name>.txt` beside `keep` (None: not kept). No profiler: says so
    and returns {} (the benchmark's numbers do not depend on it)."""
    try:
        with recording(pids, out_dir, subprocesses) as files:
            work()
    except ProfilerUnavailable as exc:
        print(f"  no profile: {exc}", flush=True)
        return {}
    summaries: dict[str, dict[str, object]] = {}
    for name, raw in files.items():
        summary = summarise(raw)
        summaries[name] = summary.as_dict()
        print(render(name, summary), flush=True)
        if keep is not None:
            kept = keep.with_name(f"{keep.stem}.profile-{name}.txt")
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text(raw.read_text())
    return summaries
