"""`dynamo.testing`: what the test suite and the benchmarks share.

Processes started for real (`processes`), waiting for conditions with a deadline
(`waiting`), small HTTP and Prometheus helpers (`http`), and in-process test doubles
(`engines`). Importable in a development install (`make setup`); not part of the wheel,
and nothing under `lib/runtime`, `lib/llm` or `components/` imports it.

`frontends` runs the real frontend as a task of a test's own event loop, for integration
tests that serve their scripted workers from the same loop.

`sse` reads a streaming completion the way fault tests need it: chunk times, the in-band
error event, `[DONE]`, usage.

`clocks` has a `FakeClock` that only moves when the test moves it, for the time-based
bookkeeping that takes its clock as a callable.

`greedy` compares greedy outputs as bf16 arithmetic allows: equal, or parting only at a
token the reference itself found within rounding of its choice.

`raw_http` speaks HTTP/1.1 over a plain socket, for tests of what a server does to a
connection (slowloris heads, clients that stop reading).
"""
