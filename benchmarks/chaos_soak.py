"""Chaos soak: mixed traffic through a NATS cluster, a two-process frontend, mocker workers
and a real vLLM worker while workers, NATS nodes and frontend children are killed, paused
and restarted at random (dynamo.testing.chaos says what runs and what is counted).

    python benchmarks/chaos_soak.py [--duration 600] [--clients 12] [--fault-every 12]
        [--seed 0] [--no-vllm] [--log-dir DIR] [--json FILE]

Prints, per fault kind, the requests that overlapped it by outcome (completed, failed
cleanly, connection lost, hung, wrong tokens, cancelled by the client), the routers'
bookings after the traffic and the frontend's memory before and after. Exits 1 when a
request hung or got wrong tokens, or a booking was left. Addresses are all on this host.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from dynamo.llm.models import DEFAULT_MODEL, prepare_model
from dynamo.testing.chaos import run_soak
from dynamo.testing.chaos_records import FAULT_KINDS, SoakConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    parser.add_argument("--clients", type=int, default=12, help="concurrent client loops")
    parser.add_argument(
        "--fault-every", type=float, default=12.0, help="mean seconds between faults"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the faults and the traffic")
    parser.add_argument(
        "--no-vllm", action="store_true", help="mocker workers only (no real engine)"
    )
    parser.add_argument(
        "--faults",
        default=",".join(FAULT_KINDS),
        help=f"comma-separated fault kinds to inject (default: all of {', '.join(FAULT_KINDS)})",
    )
    parser.add_argument("--log-dir", type=Path, help="process logs (default: a temporary dir)")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = set(faults) - set(FAULT_KINDS)
    if unknown:
        print(f"error: unknown fault kinds {sorted(unknown)}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    print(f"chaos soak: logs in {log_dir}", flush=True)
    config = SoakConfig(
        model_dir=prepare_model(DEFAULT_MODEL),
        log_dir=log_dir,
        duration_s=args.duration,
        clients=args.clients,
        fault_every_s=args.fault_every,
        seed=args.seed,
        vllm=not args.no_vllm,
        faults=faults,
    )
    report = run_soak(config)
    print(report.render())
    if args.json:
        args.json.write_text(report.to_json())
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
