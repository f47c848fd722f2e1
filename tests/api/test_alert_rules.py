"""The Prometheus alerting rules in deploy/prometheus/alerts.yml: the file parses as rule groups, and every expression
names only metrics a running service exposes at /metrics (the cluster's too), checked by a small PromQL tokenizer; with
``promtool`` (Debian's ``prometheus``, which ``.ci/run`` installs), Prometheus's own check passes as well: without it
the check is skipped, except under ``CI=true``, where it fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from switchboard.api.app import create_app
from switchboard.control.metrics import _Cluster
from switchboard.runtime.agent import AgentRegistry

from .conftest import make_settings
from .test_dashboard import SUFFIXES

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
SECRET = "whsec_" + "A" * 44
PROMETHEUS_OWN = {"up"}  # series Prometheus itself writes for each target
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "delta", "histogram_quantile", "abs", "absent",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "clamp_min", "clamp_max", "time", "vector", "scalar", "topk", "bottomk", "changes", "resets", "max_over_time",
    "min_over_time", "avg_over_time", "le",
}  # fmt: skip
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
MATCHERS = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENTIFIER = re.compile(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label names, functions and keywords left out)."""
    bare = GROUPINGS.sub(" ", MATCHERS.sub(" ", STRINGS.sub(" ", expr)))
    return {name for name in IDENTIFIER.findall(bare) if name not in PROMQL_WORDS}


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


async def exposed(tmp_path: Path) -> set[str]:
    """Every series name a running service (with an alert sink) exposes at /metrics, and the cluster's."""
    sink = {"name": "ops", "url": "http://127.0.0.1:9/alerts", "secret": SECRET}
    app = create_app(make_settings(tmp_path, alert_sinks=[sink]), registry=AgentRegistry({}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            text = (await client.get("/metrics")).text
    families = list(text_string_to_metric_families(text))
    feed = SimpleNamespace(repaired=0, polls=0, discarded=0, order=SimpleNamespace(repairs=0, discarded=0))
    fanout = SimpleNamespace(available=True, dropped=0, rejected=defaultdict(int))
    families += list(_Cluster(fanout, feed).collect())  # type: ignore[arg-type]
    names: set[str] = set()
    for family in families:
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


async def test_every_rule_reads_only_metrics_the_service_exposes(tmp_path: Path) -> None:
    names = await exposed(tmp_path)
    found = rules()
    assert len(found) >= 8
    for rule in found:
        assert rule["alert"].startswith("Switchboard") and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]
        read = metric_names(str(rule["expr"]))
        assert read, rule["alert"]
        assert read <= names | PROMETHEUS_OWN, f"{rule['alert']}: not exposed: {sorted(read - names)}"
    alerts = {rule["alert"] for rule in found}
    for needed in (
        "SwitchboardNodeDown",
        "SwitchboardNotReady",
        "SwitchboardStoreWritesFailing",
        "SwitchboardEventStreamsFallingBehind",
        "SwitchboardAlertSinkFailing",
        "SwitchboardManySessionsNeedAttention",
    ):
        assert needed in alerts, needed


def test_the_tokenizer_finds_metric_names_and_leaves_labels_and_functions_out() -> None:
    expr = 'sum by (instance, sink) (increase(switchboard_x_total{state=~"failed|dropped"}[15m])) > 0 and up == 0'
    assert metric_names(expr) == {"switchboard_x_total", "up"}
    expr = "histogram_quantile(0.99, sum by (le) (rate(switchboard_store_commit_seconds_bucket[5m])))"
    assert metric_names(expr) == {"switchboard_store_commit_seconds_bucket"}


def test_the_monitoring_profile_loads_the_rules() -> None:
    prometheus = yaml.safe_load((RULES.parent / "prometheus.yml").read_text())
    assert prometheus["rule_files"] == [RULES.name]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert (
        f"./deploy/prometheus/{RULES.name}:/etc/prometheus/{RULES.name}:ro"
        in compose["services"]["prometheus"]["volumes"]
    )


def test_promtool_checks_the_rules() -> None:
    if shutil.which("promtool") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
        pytest.skip("promtool is not installed")
    done = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
