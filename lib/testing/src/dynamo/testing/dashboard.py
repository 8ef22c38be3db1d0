"""The metric names a Grafana dashboard queries, and the names a process exports.

A dashboard panel whose query names a metric nobody exports shows "No data" forever and
nobody notices. The dashboard tests (tests/unit/deploy, the mocker integration test,
the vLLM e2e test) read `deploy/grafana/dashboards/dynamo.json` with `dashboard_metrics`
and compare with `exported_names(text)` of a running process's `/metrics`.

Sources are decided by prefix (`source_of`): `dynamo_frontend_*` is checked against a
running frontend, `dynamo_mocker_*` against a mocker, `dynamo_worker_*` and `vllm:*`
against a vLLM worker. A name with any other prefix has no source and fails the unit test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARD = (
    Path(__file__).resolve().parents[5] / "deploy" / "grafana" / "dashboards" / "dynamo.json"
)
"""The project's dashboard (this file is lib/testing/src/dynamo/testing/dashboard.py)."""

FRONTEND, MOCKER, VLLM_WORKER = "frontend", "mocker", "vllm-worker"

_SOURCES_BY_PREFIX = (
    ("dynamo_frontend_", FRONTEND),
    ("dynamo_mocker_", MOCKER),
    ("dynamo_worker_", VLLM_WORKER),
    ("vllm:", VLLM_WORKER),
)

# PromQL words that look like metric names but are not.
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "inf", "nan",
}  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_IDENT = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:]|\s*\()")
_NUMBER = re.compile(r"^\d")


def promql_metric_names(expr: str) -> set[str]:
    """The metric (sample) names `expr` selects, as written (`..._bucket` stays).

    Strings, label matchers, range selectors, grouping label lists and Grafana variables
    are removed first; what is left that is an identifier not followed by `(` (a
    function) and not a keyword is a metric name."""
    text = _STRING.sub(" ", expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)
    text = _VARIABLE.sub(" ", text)
    return {
        name
        for name in _IDENT.findall(text)
        if name.lower() not in _KEYWORDS and not _NUMBER.match(name)
    }


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested (collapsed) panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def dashboard_metrics(dashboard: dict[str, Any] | None = None) -> dict[str, set[str]]:
    """Metric name -> titles of the panels that query it."""
    dashboard = dashboard if dashboard is not None else load_dashboard()
    names: dict[str, set[str]] = {}
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            for name in promql_metric_names(target.get("expr", "")):
                names.setdefault(name, set()).add(panel.get("title", "?"))
    return names


def source_of(name: str) -> str | None:
    """Which process must export `name` (None: no known source)."""
    for prefix, source in _SOURCES_BY_PREFIX:
        if name.startswith(prefix):
            return source
    return None


def names_from(source: str, dashboard: dict[str, Any] | None = None) -> set[str]:
    """The dashboard's metric names that `source` must export."""
    return {name for name in dashboard_metrics(dashboard) if source_of(name) == source}


_SUFFIXES_BY_TYPE = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}


def exported_names(text: str) -> set[str]:
    """Every sample name a query may use against this Prometheus text exposition: the
    samples present, plus those each `# TYPE` line promises (a labelled histogram or
    counter that has not been observed yet has a TYPE line but no samples; its
    `_bucket`/`_sum`/`_count`, or `_total`, are still what a query names)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) < 4:
                continue
            family, kind = parts[2], parts[3]
            if kind == "counter":
                base = family.removesuffix("_total")
                names.add(f"{base}_total")
            else:
                names.update(family + s for s in _SUFFIXES_BY_TYPE.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names
