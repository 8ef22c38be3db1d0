"""Children that die with their parent, even when the parent is SIGKILLed.

A process killed hard runs no cleanup, so whatever it started lives on: a `nats-server`
holding its port and store, a vLLM engine core holding its memory. Linux can tie a child to
its parent instead: `prctl(PR_SET_PDEATHSIG, sig)` makes the kernel send `sig` to the
child the moment its parent goes, however it went. Three ways in:

* `preexec_die_with_parent(sig)`: a `preexec_fn` for `subprocess.Popen` (the nats-server
  that `NatsServer` starts);
* `children_die_with_this_process(sig)`: every child this process *forks* from now on
  (`os.fork`, `multiprocessing`'s fork start method);
* `spawned_children_die_with_this_process(sig)`: every child `multiprocessing` *spawns*
  from now on (vLLM spawns its engine core): a fresh interpreter runs none of our code
  before the engine's, so multiprocessing's executable becomes a two-line launcher that
  runs the interpreter through the exec wrapper below;
* `python -m dynamo.runtime.parent_death [--signal TERM] [--parent-pid PID] -- CMD ARGS`:
  sets it on itself and `exec`s CMD (same pid), for shell scripts, which cannot do this
  themselves (the `launch/` scripts start every background process through it).

Caveats, by the kernel's rules: the "parent" is the *thread* that forked the child, so a
child started from a thread that later exits is signalled then: start children from a
thread that lives as long as the process (the main thread; an executor's worker
thread, which lives until the executor shuts down). The setting survives `exec` but not
`fork`. Each entry point checks after `prctl` that the parent is still the one it
expected, closing the race where the parent died before the setting took effect. On
other systems every function here is a no-op.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import hashlib
import multiprocessing
import os
import shlex
import signal
import stat
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
DEFAULT_WRAPPER_SIGNAL = signal.SIGTERM
"""The launch wrapper's default: SIGTERM lets a frontend or worker deregister (a worker
whose broker died with it stops within a second or two); `--signal KILL` for none."""


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's `prctl`, resolved once in the parent (never first in a forked child, where
    loading a library is unsafe); None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def supported() -> bool:
    """True where a parent-death signal can be set (Linux)."""
    return _prctl() is not None


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (thread) exits.
    False where unsupported or refused."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(sig: int, *, parent_pid: int | None = None) -> None:
    """Set the parent-death signal on this process, then deliver `sig` to it at once if
    the parent is already gone (it is not `parent_pid`, default: the parent now)."""
    expected = os.getppid() if parent_pid is None else parent_pid
    if set_parent_death_signal(sig) and os.getppid() != expected:
        os.kill(os.getpid(), sig)


def pid_is_running(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user counts: it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def preexec_die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` that ties the child to this process (None
    where unsupported). Call `Popen` from a long-lived thread: see the module's caveats."""
    if not supported():
        return None
    parent = os.getpid()

    def preexec() -> None:
        die_with_parent(sig, parent_pid=parent)

    return preexec


_fork_hook_signal: int | None = None
_forking_pid = 0


def children_die_with_this_process(sig: int = signal.SIGKILL) -> bool:
    """From now on every child this process forks (`os.fork`, `multiprocessing`'s fork
    start method) gets `sig` when this process dies. Idempotent (the last signal
    wins); False where unsupported. A spawned Python child must call `die_with_parent`
    itself (it does not fork from here)."""
    global _fork_hook_signal
    if not supported():
        return False
    if _fork_hook_signal is None:
        os.register_at_fork(before=_remember_forking_pid, after_in_child=_after_fork_in_child)
    _fork_hook_signal = int(sig)
    return True


def _remember_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    # The hooks are inherited by the child: a grandchild compares with the pid of the
    # process that forked it, recorded just before that fork.
    if _fork_hook_signal is not None:
        die_with_parent(_fork_hook_signal, parent_pid=_forking_pid)


def spawned_children_die_with_this_process(sig: int = signal.SIGKILL) -> bool:
    """From now on every process `multiprocessing` spawns (its `spawn` start method) gets
    `sig` when this process dies: the spawn executable becomes a launcher script that
    execs the interpreter through `python -m dynamo.runtime.parent_death` (about 0.3 s
    more per spawn). Its resource tracker is not tied: it exits by itself once every
    process using it is gone, and only then cleans up shared memory they leaked. False
    where unsupported."""
    if not supported():
        return False
    multiprocessing.set_executable(str(_spawn_launcher(sys.executable, int(sig))))
    return True


def _spawn_launcher(python: str, sig: int) -> Path:
    """The launcher for `python` and `sig`, in a directory only this user can write
    (rewritten atomically on every call, so a stale or tampered copy never runs)."""
    directory = Path(tempfile.gettempdir()) / f"dynamo-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        directory = Path(tempfile.mkdtemp(prefix="dynamo-spawn-"))
    digest = hashlib.sha256(f"{python}\0{sig}".encode()).hexdigest()[:16]
    path = directory / f"spawn-{digest}.sh"
    exe = shlex.quote(python)
    text = (
        "#!/bin/sh\n"
        "# multiprocessing's spawn executable, written by dynamo.runtime.parent_death: a\n"
        "# spawned process dies with the process that spawned it ($PPID). The resource\n"
        "# tracker is left alone: it must outlive them all to clean up what they leaked.\n"
        'case " $* " in *" --multiprocessing-fork "*)\n'
        f'  exec {exe} -m dynamo.runtime.parent_death --signal {sig} --parent-pid "$PPID" '
        f'-- {exe} "$@";;\n'
        "esac\n"
        f'exec {exe} "$@"\n'
    )
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".spawn-")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(temporary, 0o700)
    os.replace(temporary, path)
    return path


# ---------------------------------------------------------------------- exec wrapper


def _signal_number(text: str) -> int:
    if text.isdigit():
        try:
            return int(signal.Signals(int(text)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a signal number: {text}") from None
    name = text.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise argparse.ArgumentTypeError(f"not a signal name: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.runtime.parent_death",
        description=(
            "Run CMD so that it receives a signal when the process that started this one "
            "dies, even by SIGKILL (Linux PR_SET_PDEATHSIG; elsewhere CMD just runs). CMD "
            "replaces this process (same pid)."
        ),
    )
    parser.add_argument(
        "--signal",
        type=_signal_number,
        default=int(DEFAULT_WRAPPER_SIGNAL),
        metavar="NAME",
        help="Signal CMD gets when the parent dies, by name or number: TERM (default; "
        "lets it shut down cleanly) or KILL (at once).",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="The pid the parent must have (a shell passes $$): if it is already gone, "
        "CMD is not run at all. Default: whatever the parent is now.",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("error: no command given (usage: ... -- CMD [ARGS...])", file=sys.stderr)
        return 2
    die_with_parent(args.signal, parent_pid=args.parent_pid)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"error: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached: execvp replaced this process


if __name__ == "__main__":
    raise SystemExit(main())
