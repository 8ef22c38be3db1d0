"""A chaos soak: mixed traffic through a whole stack while faults are injected at random.

The stack (every address on this machine): a three-node NATS cluster, a frontend of two
HTTP worker processes in kv mode, two mocker workers and, unless `vllm=False`, one real
vLLM worker on the embedded model; each worker runs under the launch scripts'
supervisor (`python -m dynamo.runtime.supervise`), so a killed worker comes back as it
would for a user of `launch/`. The migration limit is the default.

Traffic: `clients` loops, each sending one request after another, drawn from a mix of
streamed and plain completions and chats, `n` = 2, cancellations (the client goes away
after three chunks) and, on the vLLM worker, structured output, tool calls, seeded
sampling and long prompts. Completions to the mocker use token-id prompts, `ignore_eos`
and a fixed length, so their text can be checked token for token against what the
mocker produces, migrations included (`dynamo.testing.mocker_tokens`).

Faults, one at a time, each after the stack is whole again: a worker SIGKILLed (the
supervisor restarts it), a worker SIGSTOPped for a few seconds then SIGCONTed, a NATS node
killed and restarted, a frontend child SIGKILLed (the frontend starts another).

Each request ends as: completed (whole, and for checked completions the right tokens),
failed (a clean error: an HTTP error status or an SSE error event), connection lost
(reset: expected only when its frontend child was killed), hung (no end within
`request_deadline_s`: must be 0), wrong (completed with tokens lost or repeated: must be
0), or cancelled (by the client, on purpose). Requests are counted under every fault whose
window (injection to recovery, plus `SETTLE_S`) they overlap, or under "none". At the end:
the KV routers' bookings must fall back to 0, and the frontend's memory before and after
is reported.

`benchmarks/chaos_soak.py` is the command line; tests/integration/test_chaos_soak.py runs
a short version in `make test`.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from dynamo.llm.models import DEFAULT_MODEL
from dynamo.nats_server import NatsCluster
from dynamo.testing.http import http_get, kv_router_views, listed_instances
from dynamo.testing.mocker_tokens import ExpectedTokens
from dynamo.testing.processes import (
    FrontendProcess,
    ManagedProcess,
    cpu_engine_flags,
    stop_all,
    worker_argv,
)
from dynamo.testing.waiting import WaitTimeout, wait_until

MOCK_MODEL = "mock-chaos"
FAULT_KINDS = ("worker_sigkill", "worker_sigstop", "nats_node_restart", "frontend_child_kill")
OUTCOMES = ("completed", "failed", "connection_lost", "hung", "wrong", "cancelled")
SETTLE_S = 5.0
RECOVERY_TIMEOUT_S = 180.0
TOOLS_TEMPLATE = Path(__file__).parents[5] / "examples" / "chat_templates" / "smollm2_tools.jinja"
"""The launch scripts' template for the embedded model: tool calls work out of the box."""
CHECKED_TOKENS = 40
PROMPT_TOKENS = 24
CANCEL_AFTER_CHUNKS = 3
RETRY_PAUSE_S = 0.5
"""A client's pause after an error before its next request (a 404 while the only worker of
a model restarts would otherwise be a spin of hundreds a second)."""


@dataclass
class SoakConfig:
    model_dir: Path
    log_dir: Path
    duration_s: float = 600.0
    clients: int = 12
    fault_every_s: float = 12.0
    seed: int = 0
    vllm: bool = True
    faults: tuple[str, ...] = FAULT_KINDS
    request_deadline_s: float = 180.0
    warmup_s: float = 5.0


@dataclass
class Record:
    kind: str
    started: float
    ended: float = 0.0
    outcome: str = "hung"
    detail: str = ""


@dataclass
class Fault:
    kind: str
    started: float
    recovered: float
    detail: str
    recovered_in_time: bool = True


@dataclass
class SoakReport:
    config: dict[str, Any]
    faults: list[Fault]
    table: dict[str, dict[str, int]]  # fault kind (or "none") -> outcome -> requests
    totals: dict[str, int]
    bookings_after: dict[str, int]
    frontend_rss_mib: tuple[float, float]
    problems: list[str] = field(default_factory=list)  # one line per hung or wrong request
    failures: dict[str, int] = field(default_factory=dict)  # clean failures by message
    losses: dict[str, int] = field(default_factory=dict)  # lost connections by error

    @property
    def clean(self) -> bool:
        """Nothing hung, no wrong tokens, no booking left."""
        return not self.problems and not any(self.bookings_after.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)

    def render(self) -> str:
        injected = Counter(f.kind for f in self.faults)
        lines = [
            f"{'fault':<22}{'injected':>9}{'requests':>9}" + "".join(f"{o:>16}" for o in OUTCOMES),
        ]
        for kind in ("none", *FAULT_KINDS):
            row = self.table.get(kind, {})
            lines.append(
                f"{kind:<22}{injected.get(kind, 0) if kind != 'none' else '-':>9}"
                f"{sum(row.values()):>9}" + "".join(f"{row.get(o, 0):>16}" for o in OUTCOMES)
            )
        before, after = self.frontend_rss_mib
        lines.append(f"all requests: {self.totals}")
        lines.append(f"router bookings after the traffic: {self.bookings_after}")
        lines.append(f"frontend RSS: {before:.0f} MiB after warm-up, {after:.0f} MiB at the end")
        lines.extend(self.problems[:20])
        for message, count in sorted(self.failures.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"failed x{count}: {message}")
        for error, count in sorted(self.losses.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"connection lost x{count}: {error}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- the stack


def _supervised(argv: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "dynamo.runtime.supervise",
        "--backoff-initial", "0.5", "--backoff-max", "2", "--", *argv,
    ]  # fmt: skip


class SoakStack:
    """The processes of the soak; `close()` stops them all."""

    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.namespace = "chaos" + uuid.uuid4().hex[:8]
        self.cluster = NatsCluster(3, store_root=config.log_dir / "nats").start()
        self.workers: list[ManagedProcess] = []
        self.frontend: FrontendProcess | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        cfg, url = self.config, self.cluster.url
        for i in range(2):
            argv = [
                sys.executable, "-m", "dynamo.mocker",
                "--model", str(cfg.model_dir), "--served-model-name", MOCK_MODEL,
                "--namespace", self.namespace, "--component", "mocker",
                "--nats-server", url, "--nats-replicas", "3", "--decode-ms-per-step", "40",
                "--decode-ms-per-token", "0", "--prefill-ms-per-token", "0",
            ]  # fmt: skip
            self.workers.append(ManagedProcess(f"mocker-{i}", _supervised(argv), cfg.log_dir))
        if cfg.vllm:
            argv = worker_argv(
                cfg.model_dir, url, self.namespace, cpu_engine_flags(), "--nats-replicas", "3",
            )  # fmt: skip
            self.workers.append(ManagedProcess("vllm", _supervised(argv), cfg.log_dir))
        self.frontend = FrontendProcess(
            "frontend", url, cfg.log_dir, namespace=self.namespace,
            extra=[
                "--http-workers", "2", "--router-mode", "kv", "--nats-replicas", "3",
                "--chat-template", str(TOOLS_TEMPLATE), "--tool-call-parser", "hermes",
            ],
        )  # fmt: skip
        self.wait_whole(timeout=300)

    @property
    def base_url(self) -> str:
        assert self.frontend is not None
        return self.frontend.base_url

    def expected_instances(self) -> dict[str, int]:
        return {MOCK_MODEL: 2, **({DEFAULT_MODEL: 1} if self.config.vllm else {})}

    def is_whole(self) -> bool:
        """Every node, worker and frontend child is up: both children listen, and every
        worker is routable."""
        if not all(node.running for node in self.cluster.nodes):
            return False
        children = self.frontend_children()
        if len(children) != 2 or not all(_listens(child) for child in children):
            return False
        return all(
            len(ids) >= count
            for ids, count in zip(
                self.instances().values(), self.expected_instances().values(), strict=True
            )
        )

    def instances(self) -> dict[str, set[int]]:
        """The instances the frontend lists, per model of `expected_instances`."""
        _, body = http_get(f"{self.base_url}/health", timeout=2)
        health = json.loads(body)
        return {model: set(listed_instances(health, model)) for model in self.expected_instances()}

    def wait_whole(self, timeout: float) -> None:
        wait_until(
            self.is_whole,
            timeout=timeout,
            interval=0.5,
            what="the stack to be whole (nodes, frontend children, worker instances)",
            retry_on=(OSError, ValueError, KeyError, psutil.Error),
        )

    def frontend_children(self) -> list[psutil.Process]:
        """The frontend's HTTP worker processes that run (a killed one stays listed as a
        zombie until the supervisor reaps it)."""
        assert self.frontend is not None
        return [child for child in psutil.Process(self.frontend.pid).children() if _alive(child)]

    def frontend_rss_mib(self) -> float:
        assert self.frontend is not None
        parent = psutil.Process(self.frontend.pid)
        total = 0
        for proc in [parent, *parent.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:  # a child that just died
                pass
        return total / 2**20

    def bookings(self) -> dict[str, int]:
        """Requests the KV routers still count as in flight, per model (all children)."""
        paths = {MOCK_MODEL: f"{self.namespace}/mocker/generate"}
        if self.config.vllm:
            paths[DEFAULT_MODEL] = f"{self.namespace}/backend/generate"
        return {
            model: sum(
                sum(w["active_requests"] for w in view["workers"].values())
                for view in kv_router_views(self.base_url, model, path)
            )
            for model, path in paths.items()
        }

    def close(self) -> None:
        procs: list[ManagedProcess] = [*([self.frontend] if self.frontend else []), *self.workers]
        stop_all(procs)
        self.cluster.close()


# --------------------------------------------------------------------------- faults


def _worker_of(supervisor: ManagedProcess) -> psutil.Process | None:
    children = [child for child in psutil.Process(supervisor.pid).children() if _alive(child)]
    return children[0] if children else None


def _alive(proc: psutil.Process) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listens(proc: psutil.Process) -> bool:
    """Whether `proc` has a listening TCP socket (a frontend child that started serving)."""
    try:
        return any(c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp"))
    except psutil.Error:
        return False


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
        wait_until(lambda: not _alive(child), timeout=10, interval=0.05, what="the kill")
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


# --------------------------------------------------------------------------- traffic


class Traffic:
    """The client loops and what they recorded."""

    def __init__(self, stack: SoakStack, config: SoakConfig, expected: ExpectedTokens) -> None:
        self.stack = stack
        self.config = config
        self.expected = expected
        self.records: list[Record] = []
        self.stop = asyncio.Event()
        kinds = ["checked_stream", "checked", "chat_stream", "chat", "n2", "cancel"]
        if config.vllm:
            kinds += ["vllm_structured", "vllm_tools", "vllm_seeded", "vllm_long"]
        self.kinds = kinds

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.config.clients)))

    async def _client(self, session: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(f"{self.config.seed}:{index}")
        while not self.stop.is_set():
            kind = rng.choice(self.kinds)
            record = Record(kind, time.monotonic())
            self.records.append(record)
            try:
                await asyncio.wait_for(
                    self._send(session, kind, rng, record), self.config.request_deadline_s
                )
            except TimeoutError:
                record.outcome, record.detail = "hung", "no end within the deadline"
            except aiohttp.ClientError as exc:
                record.outcome, record.detail = "connection_lost", repr(exc)
            except ValueError as exc:  # a body that is not the JSON it should be
                record.outcome, record.detail = "failed", f"unreadable response: {exc!r}"
            record.ended = time.monotonic()
            if record.outcome in ("failed", "connection_lost"):
                await asyncio.sleep(RETRY_PAUSE_S)  # as a client would, not in a spin

    async def _send(
        self, session: aiohttp.ClientSession, kind: str, rng: random.Random, record: Record
    ) -> None:
        prompt = rng.sample(range(1000, 9000), PROMPT_TOKENS)
        chat = [{"role": "user", "content": f"Tell me about item {rng.randrange(10**6)}."}]
        mock = {"model": MOCK_MODEL}
        vllm = {"model": DEFAULT_MODEL, "max_tokens": 24}
        checked = {**mock, "prompt": prompt, "max_tokens": CHECKED_TOKENS, "ignore_eos": True}
        bodies: dict[str, tuple[str, dict[str, Any], bool]] = {
            "checked_stream": ("completions", checked, True),
            "checked": ("completions", checked, False),
            "chat_stream": ("chat/completions", {**mock, "messages": chat, "max_tokens": 30}, True),
            "chat": ("chat/completions", {**mock, "messages": chat, "max_tokens": 30}, False),
            "n2": ("completions", {**mock, "prompt": prompt, "max_tokens": 20, "n": 2}, False),
            "cancel": ("completions", {**mock, "prompt": prompt, "max_tokens": 200}, True),
            "vllm_structured": ("chat/completions", {**vllm, "messages": chat, "response_format": {
                "type": "json_schema", "json_schema": {"name": "item", "schema": {
                    "type": "object", "properties": {"name": {"type": "string"}},
                    "required": ["name"]}}}}, False),
            "vllm_tools": ("chat/completions", {**vllm, "messages": chat, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
                    "type": "object", "properties": {"item": {"type": "string"}}}}}]}, False),
            "vllm_seeded": ("completions", {**vllm, "prompt": "Once upon a time",
                "temperature": 0.8, "seed": rng.randrange(1000)}, True),
            "vllm_long": ("completions", {**vllm, "max_tokens": 8,
                "prompt": " ".join(f"word{rng.randrange(500)}" for _ in range(450))}, False),
        }  # fmt: skip
        path, body, stream = bodies[kind]
        url = f"{self.stack.base_url}/v1/{path}"
        if stream:
            text, usage = await self._stream(session, url, body, record, kind == "cancel")
        else:
            text, usage = await self._plain(session, url, body, record)
        if record.outcome == "completed" and kind.startswith("checked"):
            await self._check(prompt, text, usage, record)

    async def _plain(
        self, session: aiohttp.ClientSession, url: str, body: dict[str, Any], record: Record
    ) -> tuple[str, dict[str, Any]]:
        async with session.post(url, json=body) as resp:
            payload = await resp.json(content_type=None)
        if resp.status != 200:
            record.outcome, record.detail = "failed", str(payload.get("error", payload))[:200]
            return "", {}
        choices = payload.get("choices") or []
        if not choices or any(c.get("finish_reason") is None for c in choices):
            record.outcome, record.detail = "failed", f"no finish reason: {payload}"[:200]
            return "", {}
        record.outcome = "completed"
        return choices[0].get("text") or "", payload.get("usage") or {}

    async def _stream(
        self,
        session: aiohttp.ClientSession,
        url: str,
        body: dict[str, Any],
        record: Record,
        cancel: bool,
    ) -> tuple[str, dict[str, Any]]:
        payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
        texts: list[str] = []
        usage: dict[str, Any] = {}
        finished = done = False
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                record.outcome, record.detail = "failed", (await resp.text())[:200]
                return "", {}
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    record.outcome, record.detail = "failed", str(event["error"])[:200]
                    return "", {}
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    texts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                    finished = finished or choice.get("finish_reason") is not None
                if cancel and len(texts) >= CANCEL_AFTER_CHUNKS:
                    record.outcome = "cancelled"
                    return "", {}
        if done and finished:
            record.outcome = "completed"
        else:
            record.outcome, record.detail = "failed", "the stream ended without [DONE]"
        return "".join(texts), usage

    async def _check(
        self, prompt: list[int], text: str, usage: dict[str, Any], record: Record
    ) -> None:
        resumed = await asyncio.to_thread(self.expected.migrations, prompt, text, CHECKED_TOKENS)
        if resumed is None or usage.get("completion_tokens") != CHECKED_TOKENS:
            record.outcome = "wrong"
            # Whole, so that the tokens can be recomputed (`ExpectedTokens`) and compared.
            record.detail = f"prompt {prompt}, usage {usage}, text {text!r}"
        elif resumed:
            record.detail = f"resumed {resumed} time(s)"


# --------------------------------------------------------------------------- the soak


def _tabulate(records: list[Record], faults: list[Fault]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter[str]] = {}
    for record in records:
        ended = record.ended or float("inf")
        kinds = {
            f.kind
            for f in faults
            if record.started <= f.recovered + SETTLE_S and ended >= f.started
        } or {"none"}
        for kind in kinds:
            table.setdefault(kind, Counter())[record.outcome] += 1
    return {kind: dict(counts) for kind, counts in table.items()}


async def _soak(stack: SoakStack, config: SoakConfig) -> SoakReport:
    rng = random.Random(config.seed)
    expected = await asyncio.to_thread(ExpectedTokens, config.model_dir, MOCK_MODEL)
    traffic = Traffic(stack, config, expected)
    injector = FaultInjector(stack, rng)
    faults: list[Fault] = []
    clients = asyncio.create_task(traffic.run())
    await asyncio.sleep(config.warmup_s)
    rss_before = stack.frontend_rss_mib()
    deadline = time.monotonic() + config.duration_s
    order = rng.sample(list(config.faults), len(config.faults))
    # Every kind once per round, in a random order; the first round is finished whatever
    # the duration, so each kind is injected at least once.
    while (time.monotonic() < deadline or order) and not clients.done():
        if not order:
            order = rng.sample(list(config.faults), len(config.faults))
        fault = await asyncio.to_thread(injector.inject, order.pop())
        faults.append(fault)
        if not fault.recovered_in_time:
            break  # later faults would pile onto a broken stack: the report says so
        pause = rng.uniform(0.5, 1.5) * config.fault_every_s
        await asyncio.sleep(pause if order else min(pause, deadline - time.monotonic()))
    traffic.stop.set()
    await asyncio.wait_for(clients, config.request_deadline_s + 30)
    bookings: dict[str, int] = {}

    def released() -> bool:
        bookings.update(stack.bookings())
        return not any(bookings.values())

    try:
        wait_until(released, timeout=30, interval=0.5, what="the routers' bookings to reach 0")
    except Exception as exc:  # reported, not raised: the report says what was left
        print(f"chaos soak: {exc}", file=sys.stderr)
    records = traffic.records
    return SoakReport(
        config={k: str(v) for k, v in asdict(config).items()},
        faults=faults,
        table=_tabulate(records, faults),
        totals=dict(Counter(r.outcome for r in records)),
        bookings_after=bookings,
        frontend_rss_mib=(rss_before, stack.frontend_rss_mib()),
        problems=[
            *(f"{f.kind}: {f.detail}" for f in faults if not f.recovered_in_time),
            *(_problem(r, records, faults) for r in records if r.outcome in ("hung", "wrong")),
        ],
        failures=dict(Counter(r.detail[:120] for r in records if r.outcome == "failed")),
        losses=dict(Counter(r.detail[:120] for r in records if r.outcome == "connection_lost")),
    )


def _problem(record: Record, records: list[Record], faults: list[Fault]) -> str:
    """One line on a hung or wrong request: what, when it was sent and which faults came
    before its end, in seconds from the first request (to find it in the workers' logs)."""
    origin = min(r.started for r in records)
    until = record.ended or float("inf")
    during = ", ".join(
        f"{f.kind} at +{f.started - origin:.1f}s" for f in faults if f.started < until
    )
    return (
        f"{record.outcome} {record.kind}: {record.detail} (sent at +{record.started - origin:.1f}s; "
        f"faults before its end: {during or 'none'})"
    )


def run_soak(config: SoakConfig) -> SoakReport:
    """Start the stack, run the soak, stop everything; the report."""
    config.log_dir.mkdir(parents=True, exist_ok=True)
    stack = SoakStack(config)
    try:
        return asyncio.run(_soak(stack, config))
    finally:
        stack.close()
