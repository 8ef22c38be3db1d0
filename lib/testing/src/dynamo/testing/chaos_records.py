"""What a chaos soak is asked to do and what it records: `SoakConfig`, one `Record` per
request, one `Fault` per injection and the `SoakReport` that sums them up.

Plain data, no processes: the stack (`chaos_stack`), the faults (`chaos_faults`), the
traffic (`chaos_traffic`) and the soak itself (`chaos`) all share these types, and a
report can be rendered or written as JSON without starting anything.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FAULT_KINDS = ("worker_sigkill", "worker_sigstop", "nats_node_restart", "frontend_child_kill")
OUTCOMES = ("completed", "failed", "connection_lost", "hung", "wrong", "cancelled")


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
