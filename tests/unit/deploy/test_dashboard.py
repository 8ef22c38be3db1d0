"""The Grafana dashboard and the compose stack that loads it.

Claims: the PromQL metric-name extraction handles what our queries use (functions,
matchers, ranges, grouping lists, histogram suffixes, Grafana variables); every metric the
dashboard queries has a process that must export it (checked against live `/metrics` in
tests/integration/deploy and tests/e2e/test_worker_speculative.py; the planner's here,
against its metrics registry, which declares every series it will ever export); the
panels the deployment guide describes exist; compose mounts, provisioning and Prometheus
targets agree with each other."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from deploy_support import DEPLOY
from prometheus_client import generate_latest

from dynamo.planner.metrics import PREFIX as PLANNER_PREFIX
from dynamo.planner.metrics import PlannerMetrics
from dynamo.testing.dashboard import (
    FRONTEND,
    MOCKER,
    VLLM_WORKER,
    dashboard_metrics,
    exported_names,
    iter_panels,
    load_dashboard,
    names_from,
    promql_metric_names,
    source_of,
)


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            "histogram_quantile(0.95, sum by (le, model) "
            '(rate(a_seconds_bucket{model=~"$model", x="y"}[$__rate_interval])))',
            {"a_seconds_bucket"},
        ),
        (
            "sum by (instance, position) (rate(vllm:per_pos_total[5m])) / ignoring(position) "
            "group_left sum by (instance) (rate(vllm:drafts_total[5m]))",
            {"vllm:per_pos_total", "vllm:drafts_total"},
        ),
        ("1 + sum(rate(a_total[1m])) / clamp_min(b, 1e-9) or vector(0)", {"a_total", "b"}),
        ('max without (pod) (up{job="frontend"}) offset 5m', {"up"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_exported_names_include_what_type_lines_promise() -> None:
    text = (
        "# HELP h_seconds x\n# TYPE h_seconds histogram\n"
        "# HELP c_total x\n# TYPE c_total counter\n"
        "# TYPE g gauge\n"
        'g{model="m"} 1.0\n'
        'vllm:x_total{engine="0"} 2.0\n'
    )
    assert exported_names(text) == {
        "h_seconds_bucket",
        "h_seconds_sum",
        "h_seconds_count",
        "c_total",
        "g",
        "vllm:x_total",
    }


def _planner_exports() -> set[str]:
    """What the planner's `/metrics` can hold: its registry declares every family when
    built (readings absent until measured still have their `# TYPE` line)."""
    return exported_names(generate_latest(PlannerMetrics().registry).decode())


def test_every_queried_metric_has_a_source() -> None:
    names = dashboard_metrics()
    assert len(names) >= 25
    planner = _planner_exports()
    orphans = {
        name: panels
        for name, panels in names.items()
        if source_of(name) is None and name not in planner
    }
    assert not orphans
    # Each source has metrics to be checked against it (else its test checks nothing).
    for source in (FRONTEND, MOCKER, VLLM_WORKER):
        assert names_from(source), source


def test_the_planner_exports_every_planner_metric_of_the_dashboard() -> None:
    wanted = {name for name in dashboard_metrics() if name.startswith(f"{PLANNER_PREFIX}_")}
    assert f"{PLANNER_PREFIX}_sla_intervals_total" in wanted
    assert sorted(wanted - _planner_exports()) == []


# What the deployment guide promises a reader will find, and a metric each panel must use.
PANELS = {
    "Time to first token": "dynamo_frontend_time_to_first_token_seconds_bucket",
    "Inter-token latency": "dynamo_frontend_inter_token_latency_seconds_bucket",
    "Throughput": "dynamo_frontend_output_tokens_total",
    "Requests in flight (frontend)": "dynamo_frontend_inflight_requests",
    "Running and queued per worker": "dynamo_worker_waiting_requests",
    "KV-cache usage per worker": "dynamo_worker_kv_cache_usage",
    "Prefix cache hit rate per worker": "dynamo_worker_cached_prompt_tokens_total",
    "Router decisions per worker": "dynamo_frontend_router_decisions_total",
    "Acceptance rate": "vllm:spec_decode_num_accepted_tokens_total",
    "Acceptance length and K": "vllm:spec_decode_num_drafts_total",
    "Acceptance per draft position": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "Migrations and retries": "dynamo_frontend_migrations_total",
    "Rejections and disconnects": "dynamo_frontend_rejected_requests_total",
    "Replicas per pool (planner)": "dynamo_planner_replicas_target",
    "Request rate, observed and forecast (planner)": "dynamo_planner_request_rate_forecast",
    "SLA attainment (planner)": "dynamo_planner_sla_intervals_total",
    "TTFT p90 vs target (planner)": "dynamo_planner_ttft_p90_seconds",
    "ITL p90 vs target (planner)": "dynamo_planner_itl_p90_seconds",
    "Worker capacity and acceptance (planner)": "dynamo_planner_worker_capacity_rps",
}


def test_the_panels_the_guide_describes_exist_and_query_their_metric() -> None:
    dashboard = load_dashboard()
    panels = {p["title"]: p for p in iter_panels(dashboard)}
    for title, metric in PANELS.items():
        exprs = " ".join(t["expr"] for t in panels[title]["targets"])
        assert metric in promql_metric_names(exprs), title
    guide = (DEPLOY.parent / "docs" / "deploy.md").read_text()
    for title in PANELS:
        assert title in guide, f"docs/deploy.md does not describe {title!r}"


def test_panels_are_well_formed() -> None:
    dashboard = load_dashboard()
    ids = [p["id"] for p in iter_panels(dashboard)]
    assert len(ids) == len(set(ids))
    (variable,) = dashboard["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    for panel in iter_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["targets"] and panel["description"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_provisioning_and_prometheus_agree() -> None:
    services = _compose()["services"]
    mounts = {
        src: dst
        for volume in services["grafana"]["volumes"]
        for src, dst, *_ in [volume.split(":")]
    }
    for src in mounts:
        assert (DEPLOY / src).exists(), src
    assert (DEPLOY / "grafana/dashboards/dynamo.json").is_file()
    provisioning = DEPLOY / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards/dynamo.yaml").read_text())["providers"]
    assert provider["options"]["path"] == mounts["./grafana/dashboards"]
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["uid"] == load_dashboard()["templating"]["list"][0]["current"]["value"]
    assert source["url"] == "http://prometheus:9090"

    prometheus = services["prometheus"]
    assert "host.docker.internal:host-gateway" in prometheus["extra_hosts"]
    config_mount = next(v for v in prometheus["volumes"] if v.startswith("./prometheus/"))
    config = yaml.safe_load((DEPLOY / config_mount.split(":")[0]).read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    frontend_targets = jobs["frontend"]["static_configs"][0]["targets"]
    assert frontend_targets == ["host.docker.internal:8000"]
    assert jobs["workers"]["static_configs"][0]["targets"]
    assert jobs["planner"]["static_configs"][0]["targets"] == ["host.docker.internal:9400"]
    nats = services["nats"]
    assert "-js" in nats["command"] and "4222:4222" in nats["ports"]
