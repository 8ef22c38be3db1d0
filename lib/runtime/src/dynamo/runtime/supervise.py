"""`python -m dynamo.runtime.supervise [options] -- CMD ARGS`: run a worker, and run it again
when it dies.

A vLLM worker whose engine dies exits (with an error), and its lease and card go with it,
so the frontends stop routing to it and requests fail over to the other workers. Under
Kubernetes the pod restarts; a user of `make run` or the `launch/` scripts had no one to
bring it back. The launch scripts start every worker through this supervisor:

* a child that exits with a failure (non-zero, or killed by a signal) is started again
  after a back-off: `--backoff-initial` seconds, doubling up to `--backoff-max`, back to
  the initial value once a run lasted `--stable-after` seconds;
* each new run gets `DYN_WORKER_RESTARTS` (how many restarts came before it) in its
  environment, which workers report as `dynamo_worker_restarts` on `/metrics`;
* a child that exits 0 (it was asked to stop) is not restarted; the supervisor exits 0;
  nor one that exits with a code of `--final-codes` (default 2: the worker's and
  argparse's "bad configuration", which a restart cannot cure): the supervisor exits
  with it, so a launch script reports a wrong flag at once;
* SIGTERM or SIGINT to the supervisor goes to the child, which drains as usual; the
  supervisor then exits with the child's status and starts nothing more;
* after `--max-restarts` restarts (0: no limit) the supervisor exits with the child's
  last status, so the launch script stops everything and says so;
* the child dies with the supervisor (`PR_SET_PDEATHSIG`), so a SIGKILLed supervisor
  leaves no worker behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from dynamo.runtime.parent_death import preexec_die_with_parent

log = logging.getLogger("dynamo.runtime.supervise")

RESTARTS_ENV = "DYN_WORKER_RESTARTS"
"""How many times the supervisor restarted the worker before this run."""
POLL_S = 0.1


def restarts_so_far() -> int:
    """This process's restart count from its supervisor (0 when unsupervised)."""
    value = os.environ.get(RESTARTS_ENV, "").strip()
    return int(value) if value.isdigit() else 0


@dataclass(frozen=True)
class Backoff:
    """Delays between restarts: `initial` doubling to `maximum`, reset after a stable run."""

    initial: float = 1.0
    maximum: float = 30.0
    stable_after: float = 60.0

    def next_delay(self, previous: float | None, ran_for: float) -> float:
        if previous is None or ran_for >= self.stable_after:
            return self.initial
        return min(self.maximum, previous * 2)


class Supervisor:
    """Runs `argv` until it exits cleanly, the supervisor is told to stop, or it failed
    more than `max_restarts` times in a row (see the module)."""

    def __init__(
        self,
        argv: Sequence[str],
        backoff: Backoff,
        max_restarts: int = 0,
        final_codes: frozenset[int] = frozenset({2}),
    ) -> None:
        self.argv = list(argv)
        self.backoff = backoff
        self.max_restarts = max_restarts
        self.final_codes = final_codes
        self.restarts = 0
        self._stop: int | None = None
        self._child: subprocess.Popen[bytes] | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        delay: float | None = None
        while True:
            started = time.monotonic()
            code = self._run_once()
            ran_for = time.monotonic() - started
            if self._stop is not None or code == 0:
                return code
            if code in self.final_codes:
                log.error("supervise: %s exited with %s; not restarting it", self._name(), code)
                return code
            if self.max_restarts and self.restarts >= self.max_restarts:
                log.error(
                    "supervise: %s failed (%s) after %d restarts; giving up",
                    self._name(), _describe(code), self.restarts,
                )  # fmt: skip
                return code if code > 0 else 1
            delay = self.backoff.next_delay(delay, ran_for)
            log.warning(
                "supervise: %s failed (%s) after %.0f s; restarting in %.1f s (restart %d)",
                self._name(), _describe(code), ran_for, delay, self.restarts + 1,
            )  # fmt: skip
            if self._sleep(delay):
                return code if code > 0 else 1
            self.restarts += 1

    def _run_once(self) -> int:
        env = {**os.environ, RESTARTS_ENV: str(self.restarts)}
        self._child = subprocess.Popen(
            self.argv, env=env, preexec_fn=preexec_die_with_parent(signal.SIGTERM)
        )
        if self._stop is not None:  # a signal arrived while starting it
            self._child.send_signal(self._stop)
        return self._child.wait()

    def _sleep(self, seconds: float) -> bool:
        """Wait `seconds`; True when told to stop meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._stop is not None:
                return True
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        return self._stop is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop = signum
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def _name(self) -> str:
        return " ".join(self.argv[:4]) + (" ..." if len(self.argv) > 4 else "")


def _describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.runtime.supervise",
        description="Run CMD; when it fails (non-zero exit or a signal), start it again after "
        "a back-off. Exit 0 from CMD, or SIGTERM/SIGINT here (passed on to CMD), ends it.",
    )
    parser.add_argument(
        "--backoff-initial", type=float, default=1.0, help="first delay before a restart (s)"
    )
    parser.add_argument(
        "--backoff-max", type=float, default=30.0, help="longest delay; doubles up to it (s)"
    )
    parser.add_argument(
        "--stable-after",
        type=float,
        default=60.0,
        help="a run this long (s) resets the delay to --backoff-initial",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="give up (exit with CMD's status) after this many restarts; 0: never",
    )
    parser.add_argument(
        "--final-codes",
        default="2",
        help="comma-separated exit codes that are not restarted (default 2: bad configuration)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.backoff_initial < 0 or args.backoff_max < args.backoff_initial:
        parser.error("--backoff-initial must be >= 0 and --backoff-max >= --backoff-initial")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    try:
        final = frozenset(int(c) for c in args.final_codes.split(",") if c.strip())
    except ValueError:
        parser.error(f"--final-codes must be comma-separated integers, got {args.final_codes!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    backoff = Backoff(args.backoff_initial, args.backoff_max, args.stable_after)
    return Supervisor(command, backoff, args.max_restarts, final).run()


if __name__ == "__main__":
    sys.exit(main())
