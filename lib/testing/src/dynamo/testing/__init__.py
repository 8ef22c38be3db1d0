"""`dynamo.testing`: what the test suite and the benchmarks share.

Processes started for real (`processes`, their argv from `command_lines` and
`mocker_command_line`; `module_runs` runs a command line to its end), waiting for
conditions with a deadline (`waiting`), small HTTP and Prometheus helpers (`http`), and
in-process test doubles (`engines`). Importable in a development install (`make setup`); not part of the wheel,
and nothing under `lib/runtime`, `lib/llm` or `components/` imports it.

`frontends` runs the real frontend as a task of a test's own event loop, for integration
tests that serve their scripted workers from the same loop; `mocker_stacks` and
`mocker_clusters` put one or several simulated workers behind it, and `runtimes` gives a
test its own runtime connection.

`chaos` is the chaos soak (its records, stack, faults and traffic in `chaos_records`,
`chaos_stack`, `chaos_faults`, `chaos_traffic`); `netns`, `jetstream` and `tls` build
multi-host, NATS-cluster and TLS set-ups.

`sse` reads a streaming completion the way fault tests need it: chunk times, the in-band
error event, `[DONE]`, usage.

`clocks` has a `FakeClock` that only moves when the test moves it, for the time-based
bookkeeping that takes its clock as a callable.

`greedy` compares greedy outputs as bf16 arithmetic allows: equal, or parting only at a
token the reference itself found within rounding of its choice.

`raw_http` speaks HTTP/1.1 over a plain socket, for tests of what a server does to a
connection (slowloris heads, clients that stop reading).
"""
