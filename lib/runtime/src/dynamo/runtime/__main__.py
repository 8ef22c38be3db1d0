"""`python -m dynamo.runtime`: look at what is registered on NATS.

python -m dynamo.runtime instances [--namespace NS]   live endpoint instances
python -m dynamo.runtime models [--namespace NS]      registered model cards
python -m dynamo.runtime watch                        print instance changes as they happen
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import msgspec

from dynamo.runtime import naming, wire
from dynamo.runtime.cli import ConfigError
from dynamo.runtime.nats_address import nats_url_from_env
from dynamo.runtime.nats_options import add_nats_arguments, nats_options_from_args, redact_url
from dynamo.runtime.runtime import DistributedRuntime

MODELS_BUCKET = "dyn_models"  # owned by dynamo.llm.model_card; read here as plain msgpack


async def _snapshot(runtime: DistributedRuntime, bucket: str, key_filter: str) -> dict[str, bytes]:
    watcher = runtime.watch_bucket(bucket, key_filter)
    await watcher.start()
    entries = dict(watcher.entries)
    await watcher.close()
    return entries


def _filter(namespace: str | None) -> str:
    return f"{namespace}.>" if namespace else ">"


async def _instances(runtime: DistributedRuntime, args: argparse.Namespace) -> int:
    entries = await _snapshot(runtime, naming.INSTANCES_BUCKET, _filter(args.namespace))
    if not entries:
        print("no instances registered")
        return 0
    print(f"{'ENDPOINT':40} {'INSTANCE':16} {'STATUS':9} {'HOST':20} {'PID':>7} UPTIME")
    for key in sorted(entries):
        info = wire.decode_instance(entries[key])
        endpoint = f"{info.namespace}/{info.component}/{info.endpoint}"
        uptime = f"{time.time() - info.started_at:.0f}s"
        print(
            f"{endpoint:40} {naming.instance_hex(info.instance_id)} {info.status.value:9} "
            f"{info.hostname[:20]:20} {info.pid:>7} {uptime}"
        )
    return 0


async def _models(runtime: DistributedRuntime, args: argparse.Namespace) -> int:
    entries = await _snapshot(runtime, MODELS_BUCKET, _filter(args.namespace))
    if not entries:
        print("no models registered")
        return 0
    for key in sorted(entries):
        card = msgspec.msgpack.decode(entries[key])
        if args.json:
            print(json.dumps(card, default=str))
            continue
        spec = card.get("speculative") or {}
        spec_text = (
            f"{spec.get('method')} K={spec.get('num_speculative_tokens')}" if spec else "none"
        )
        print(
            f"{card.get('name')}  ns={card.get('namespace')} worker={card.get('worker_type', 'agg')} "
            f"instance={naming.instance_hex(card.get('instance_id', 0))} ctx={card.get('context_length')} "
            f"block={card.get('kv_block_size')} kv_blocks={card.get('total_kv_blocks')} speculation={spec_text}"
        )
    return 0


async def _watch(runtime: DistributedRuntime, args: argparse.Namespace) -> int:
    def on_put(key: str, value: bytes) -> None:
        info = wire.decode_instance(value)
        print(f"{time.strftime('%H:%M:%S')} PUT {key} status={info.status.value}", flush=True)

    def on_delete(key: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} DEL {key}", flush=True)

    watcher = runtime.watch_bucket(
        naming.INSTANCES_BUCKET, _filter(args.namespace), on_put=on_put, on_delete=on_delete
    )
    await watcher.start()
    await asyncio.Event().wait()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo.runtime",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nats-server",
        default=None,
        help="NATS URL (default $NATS_SERVER or nats://127.0.0.1:4222)",
    )
    add_nats_arguments(parser.add_argument_group("NATS authentication and TLS"))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (
        ("instances", _instances, "list live endpoint instances"),
        ("models", _models, "list registered model cards"),
        ("watch", _watch, "print instance registrations and departures as they happen"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("--namespace", default=None, help="only this namespace")
        if name == "models":
            cmd.add_argument("--json", action="store_true", help="one JSON object per card")
        cmd.set_defaults(func=func)
    return parser


async def _main(args: argparse.Namespace) -> int:
    url = args.nats_server or nats_url_from_env()
    try:
        options = nats_options_from_args(args, url=url)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        runtime = await DistributedRuntime.connect(
            url, name="dynamo-cli", connect_timeout=2, options=options
        )
    except Exception as exc:
        print(f"error: cannot connect to NATS at {redact_url(url)}: {exc}", file=sys.stderr)
        return 1
    try:
        return await args.func(runtime, args)
    finally:
        await runtime.shutdown(drain_timeout=0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
