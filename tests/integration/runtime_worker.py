"""A runtime server process for the integration tests (`python runtime_worker.py URL NS`).

Serves `t.<ns>.work.generate` with a handler driven by the request:
  {"n": N, "delay": s}   yield N items {"i": k, "instance": id}, sleeping `delay` between;
  {"fail": "msg"}        raise RuntimeError(msg) after one item.
When a request is cancelled, publishes "<request_id>" on `test.<ns>.cancelled`.
Prints "READY <instance_id>" once registered; exits cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from dynamo.runtime import Context, DistributedRuntime


async def main(url: str, namespace: str, lease_ttl: float) -> None:
    runtime = await DistributedRuntime.connect(url, lease_ttl=lease_ttl, name="test-worker")

    async def generate(request: dict, ctx: Context):
        if "fail" in request:
            yield {"i": 0, "instance": runtime.instance_id}
            raise RuntimeError(request["fail"])
        delay = float(request.get("delay", 0))
        try:
            for i in range(int(request.get("n", 1))):
                yield {"i": i, "instance": runtime.instance_id}
                if delay:
                    await asyncio.sleep(delay)
        finally:
            if ctx.is_stopped():
                await runtime.publish(f"test.{namespace}.cancelled", ctx.id.encode())

    endpoint = runtime.namespace(namespace).component("work").endpoint("generate")
    await endpoint.serve(generate)
    print(f"READY {runtime.instance_id}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runtime.shutdown(drain_timeout=2)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 2.0))
