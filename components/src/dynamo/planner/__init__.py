"""The SLA planner (`python -m dynamo.planner`): as few workers per pool as meet the TTFT
and ITL targets.

Every interval it observes the traffic (the frontends' `/metrics`) and the workers' load
reports (NATS), forecasts the next interval's load, asks a performance model per pool how
many workers that load needs to meet the targets (speculation included: K and the
measured acceptance change what a decode worker delivers), and sets the replicas through
a connector (`local`: worker processes on this machine; `kubernetes`: the scale
subresource of the pools' Deployments). docs/planner.md is the user's guide.

| module | job |
| --- | --- |
| `pools.py` | the pools a topology has (aggregated, or prefill + decode) |
| `observation.py` | what one interval observed: traffic, and each pool's load |
| `frontend_scrape.py` | the frontends' `/metrics` → the interval's traffic |
| `worker_load.py` | the workers' `LoadMetrics` over NATS → each pool's load |
| `forecast.py` | the next interval's request rate and lengths |
| `perf_model.py` | step times, ITL and prefill time per pool, corrected online |
| `policy.py` | replicas needed, with hysteresis and a cool-down |
| `connectors/` | `Connector` and its `local` and `kubernetes` implementations |
| `metrics.py` | the planner's own `/metrics` (Grafana's planner panels) |
| `args.py`, `service.py`, `__main__.py` | the command line and the loop |
"""
