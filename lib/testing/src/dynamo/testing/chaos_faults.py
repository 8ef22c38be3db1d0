"""The faults of a chaos soak, one at a time: a worker SIGKILLed or SIGSTOPped, a NATS
node killed and restarted, a frontend child SIGKILLed; each waited out until the stack
is whole again.

Separate from the stack, which only starts and observes the processes, and from the
traffic, which never touches them: `FaultInjector` is the one place that harms a process
on purpose and times its recovery.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable

import psutil

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.testing.chaos_records import Fault
from dynamo.testing.chaos_stack import MOCK_MODEL, SoakStack, process_alive
from dynamo.testing.processes import ManagedProcess
from dynamo.testing.waiting import WaitTimeout, wait_until

RECOVERY_TIMEOUT_S = 180.0


def _worker_of(supervisor: ManagedProcess) -> psutil.Process | None:
    children = [
        child for child in psutil.Process(supervisor.pid).children() if process_alive(child)
    ]
    return children[0] if children else None


def _signal_tree(proc: psutil.Process, sig: signal.Signals) -> None:
    for p in [proc, *proc.children(recursive=True)]:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class FaultInjector:
    def __init__(self, stack: SoakStack, rng: random.Random) -> None:
        self.stack = stack
        self.rng = rng
        self.actions: dict[str, Callable[[], str]] = {
            "worker_sigkill": self.kill_worker,
            "worker_sigstop": self.pause_worker,
            "nats_node_restart": self.restart_nats_node,
            "frontend_child_kill": self.kill_frontend_child,
        }
        self._cycles: dict[str, list[ManagedProcess]] = {}

    def _victim(self, kind: str) -> tuple[ManagedProcess, psutil.Process]:
        """The next worker for a fault of `kind`: each kind goes through every worker in
        turn (a shuffled cycle), so the vLLM worker is hit as often as each mocker."""
        cycle = self._cycles.setdefault(kind, [])
        if not cycle:
            cycle.extend(self.rng.sample(self.stack.workers, len(self.stack.workers)))
        supervisor = cycle.pop()
        worker = _worker_of(supervisor)
        if worker is None:
            raise RuntimeError(f"{supervisor.name} has no worker running")
        return supervisor, worker

    def kill_worker(self) -> str:
        supervisor, worker = self._victim("worker_sigkill")
        model = MOCK_MODEL if supervisor.name.startswith("mocker") else DEFAULT_MODEL
        before = self.stack.instances()[model]
        _signal_tree(worker, signal.SIGKILL)
        # The dead instance stays listed until its lease expires (18 s on a cluster), so
        # a count cannot tell that the supervisor's new worker registered; a new id can.
        wait_until(
            lambda: bool(self.stack.instances()[model] - before),
            timeout=RECOVERY_TIMEOUT_S,
            interval=0.5,
            what=f"{supervisor.name}'s new worker to register",
            retry_on=(OSError, ValueError, KeyError),
        )
        return f"{supervisor.name} pid {worker.pid}"

    def pause_worker(self) -> str:
        supervisor, worker = self._victim("worker_sigstop")
        pause = self.rng.uniform(2.0, 8.0)
        _signal_tree(worker, signal.SIGSTOP)
        time.sleep(pause)
        _signal_tree(worker, signal.SIGCONT)
        return f"{supervisor.name} pid {worker.pid} for {pause:.1f}s"

    def restart_nats_node(self) -> str:
        index = self.rng.randrange(len(self.stack.cluster.nodes))
        node = self.stack.cluster.nodes[index]
        node.kill()
        time.sleep(self.rng.uniform(1.0, 4.0))
        node.start(timeout=60)
        return f"node {index}"

    def kill_frontend_child(self) -> str:
        child = self.rng.choice(self.stack.frontend_children())
        child.kill()
        # SIGKILL takes effect asynchronously: until it has, "whole" would still count it.
        wait_until(lambda: not process_alive(child), timeout=10, interval=0.05, what="the kill")
        return f"http worker pid {child.pid}"

    def inject(self, kind: str) -> Fault:
        """Apply one fault and wait for the stack to be whole again; a stack that is not
        whole after RECOVERY_TIMEOUT_S is a finding (`Fault.recovered_in_time`)."""
        started = time.monotonic()
        detail = self.actions[kind]()
        try:
            self.stack.wait_whole(timeout=RECOVERY_TIMEOUT_S)
        except WaitTimeout as exc:
            return Fault(kind, started, time.monotonic(), f"{detail}; NOT RECOVERED: {exc}", False)
        return Fault(kind, started, time.monotonic(), detail)
