"""The Grafana dashboard and the compose monitoring profile: every query names only metrics the service exports,
the panels the operators need are there, and the profile loads the dashboard from the files in the repository."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from switchboard.control.metrics import Metrics

from .conftest import Api

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "switchboard.json"
METRIC_NAME = re.compile(r"\b((?:switchboard|process)_[a-z0-9_]+)\b")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported_names() -> set[str]:
    """Every series name the service's registry exposes (a labelled family without samples yet included; call it in
    an event loop: a collector counts its tasks)."""
    metrics = Metrics()
    metrics.bind(lambda: 0, lambda: 0)
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


async def test_every_query_names_only_exported_metrics():
    exported = exported_names()
    named = {name for expr in queries() for name in METRIC_NAME.findall(expr)}
    assert named, "the dashboard queries no metric"
    assert named <= exported, f"not exported by the service: {sorted(named - exported)}"
    # what the operators watch: sessions, speeches and interrupts, interrupt latency, tools by status, subscribers
    # and drops, store commit latency
    for needed in (
        "switchboard_sessions_live",
        "switchboard_speeches_total",
        "switchboard_speech_interruptions_total",
        "switchboard_interrupt_latency_seconds_bucket",
        "switchboard_tool_calls_total",
        "switchboard_event_subscribers",
        "switchboard_ws_slow_consumers_dropped_total",
        "switchboard_store_commit_seconds_bucket",
    ):
        assert needed in named, needed


async def test_the_check_catches_a_metric_the_service_does_not_export():
    assert "switchboard_no_such_thing_total" not in exported_names()
    assert METRIC_NAME.findall("sum(rate(switchboard_no_such_thing_total[1m]))") == ["switchboard_no_such_thing_total"]


def test_the_monitoring_profile_loads_the_dashboard():
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), source
    assert "profiles" not in services["switchboard"]  # the service itself runs without the profile
    grafana_mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load(
        (grafana_mounts["/etc/grafana/provisioning"] / "dashboards" / "switchboard.yml").read_text()
    )
    dashboards_dir = provider["providers"][0]["options"]["path"]
    assert (grafana_mounts[dashboards_dir] / DASHBOARD.name).read_text() == DASHBOARD.read_text()
    datasource = yaml.safe_load(
        (grafana_mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} == {datasource["uid"]}
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = prometheus["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["switchboard:8080"]
    assert datasource["url"] == "http://prometheus:9090"


async def test_store_commit_latency_is_measured(api: Api):
    session = await api.create()
    r = await api.client.post(f"/v1/sessions/{session['id']}/input", json={"text": "hello"})
    assert r.status_code == 202
    text = (await api.client.get("/metrics")).text
    count = next(line for line in text.splitlines() if line.startswith("switchboard_store_commit_seconds_count"))
    assert float(count.split()[-1]) >= 1
    ops = next(line for line in text.splitlines() if line.startswith("switchboard_store_batch_operations_sum"))
    assert float(ops.split()[-1]) >= 1
