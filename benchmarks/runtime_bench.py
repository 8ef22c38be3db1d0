"""Runtime benchmark: request → first-frame latency and streamed frames/s over loopback.

One client process (this one) and one server process (this script with `--serve`), a
private nats-server, uvloop in both. Measures:

* latency: request → first frame for a 1-item response, p50 / p99 over N requests;
* throughput, burst: one request streaming M items as fast as the handler can yield them
  (the server coalesces queued items into BATCH frames);
* throughput, paced: the handler yields to the event loop after every item (as an engine
  does between steps), so nearly every item travels as its own NATS message.

Targets (issue #3): p50 < 1 ms, ≥ 50,000 frames/s. Usage:

    .venv/bin/python benchmarks/runtime_bench.py [--requests 2000] [--items 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from dynamo.nats_server import NatsServer
from dynamo.runtime import DistributedRuntime


async def serve(url: str) -> None:
    runtime = await DistributedRuntime.connect(url, name="bench-server")

    async def handler(request: dict, ctx):
        paced = request.get("paced", False)
        for i in range(request["n"]):
            yield i
            if paced:
                await asyncio.sleep(0)

    async def raw_paced(msg) -> None:
        # Baseline: plain nats-py, one publish per item, yielding to the loop in between.
        for i in range(int(msg.data)):
            await runtime.nc.publish(msg.reply, i.to_bytes(4, "little"))
            await asyncio.sleep(0)

    await runtime.namespace("bench").component("srv").endpoint("gen").serve(handler)
    await runtime.nc.subscribe("bench.raw", cb=raw_paced)
    print("READY", flush=True)
    await asyncio.Event().wait()


async def raw_baseline(runtime: DistributedRuntime, items: int) -> float:
    """Items/s of bare nats-py publishing one message per item, paced like the engine."""
    got = 0
    done = asyncio.Event()

    async def on_msg(_msg) -> None:
        nonlocal got
        got += 1
        if got == items:
            done.set()

    inbox = runtime.nc.new_inbox()
    await runtime.nc.subscribe(inbox, cb=on_msg)
    await runtime.nc.flush()
    t0 = time.perf_counter()
    await runtime.nc.publish("bench.raw", str(items).encode(), reply=inbox)
    await done.wait()
    return items / (time.perf_counter() - t0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(url: str, requests: int, items: int) -> dict[str, float]:
    runtime = await DistributedRuntime.connect(url, name="bench-client")
    client = (
        await runtime.namespace("bench")
        .component("srv")
        .endpoint("gen")
        .client(wait_for_instances=10)
    )
    for _ in range(200):  # warm up
        async for _ in client.round_robin({"n": 1}):
            pass
    latencies = []
    for _ in range(requests):
        t0 = time.perf_counter()
        stream = client.round_robin({"n": 1})
        async for _ in stream:
            latencies.append(time.perf_counter() - t0)
    results = {
        "first_frame_p50_ms": percentile(latencies, 0.50) * 1e3,
        "first_frame_p99_ms": percentile(latencies, 0.99) * 1e3,
        "first_frame_mean_ms": statistics.fmean(latencies) * 1e3,
    }
    for label, paced in (("burst", False), ("paced", True)):
        t0 = time.perf_counter()
        count = 0
        async for _ in client.round_robin({"n": items, "paced": paced}):
            count += 1
        elapsed = time.perf_counter() - t0
        assert count == items, f"{label}: got {count} of {items}"
        results[f"frames_per_s_{label}"] = items / elapsed
    results["frames_per_s_raw_nats_paced"] = await raw_baseline(runtime, items)
    await runtime.shutdown(drain_timeout=0)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=2000, help="latency samples (default 2000)")
    parser.add_argument(
        "--items", type=int, default=100_000, help="items per throughput stream (default 100000)"
    )
    args = parser.parse_args()
    import uvloop

    if args.serve:
        uvloop.run(serve(args.serve))
        return 0
    with NatsServer() as nats:
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", nats.url], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None and server.stdout.readline().startswith("READY")
            results = uvloop.run(measure(nats.url, args.requests, args.items))
        finally:
            server.kill()
            server.wait()
    print("runtime benchmark (1 client process, 1 server process, loopback, uvloop)")
    print(
        f"  request -> first frame  p50 {results['first_frame_p50_ms']:.3f} ms   "
        f"p99 {results['first_frame_p99_ms']:.3f} ms   (target p50 < 1 ms)"
    )
    print(f"  streamed items/s, burst  {results['frames_per_s_burst']:,.0f}   (target >= 50,000)")
    print(
        f"  streamed items/s, paced  {results['frames_per_s_paced']:,.0f}   (one NATS message per item)"
    )
    raw = results["frames_per_s_raw_nats_paced"]
    print(
        f"  bare nats-py, paced      {raw:,.0f}   (the floor for one message per item; "
        f"runtime/bare = {results['frames_per_s_paced'] / raw:.2f})"
    )
    ok = results["first_frame_p50_ms"] < 1.0 and results["frames_per_s_burst"] >= 50_000
    print(f"  targets {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
