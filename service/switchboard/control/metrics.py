"""Prometheus metrics, on a registry of the app's own (several apps can live in one test process)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..runtime.events import Event


class _Live(Collector):
    def __init__(self, sessions: Callable[[], int], subscribers: Callable[[], int]) -> None:
        self._sessions = sessions
        self._subscribers = subscribers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("switchboard_sessions_live", "Live sessions in this process", value=self._sessions())
        yield GaugeMetricFamily(
            "switchboard_asyncio_tasks", "asyncio tasks alive in the event loop", value=len(asyncio.all_tasks())
        )
        yield GaugeMetricFamily(
            "switchboard_event_subscribers", "Live event-stream subscriptions", value=self._subscribers()
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # resident memory, CPU, open fds: what a soak test watches
        self.speeches = Counter("switchboard_speeches", "Speeches created, by source", ["source"], registry=r)
        self.interruptions = Counter("switchboard_speech_interruptions", "Speeches interrupted", registry=r)
        self.tool_calls = Counter("switchboard_tool_calls", "Tool calls ended, by status", ["status"], registry=r)
        self.events = Counter("switchboard_events", "Events made durable", registry=r)
        self.interrupt_latency = Histogram(
            "switchboard_interrupt_latency_seconds",
            "POST /interrupt: from request to the interrupted message committed",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=r,
        )
        self.ws_connections = Gauge("switchboard_ws_connections", "Open WebSocket event streams", registry=r)
        self.ws_dropped = Counter(
            "switchboard_ws_slow_consumers_dropped", "Event streams closed for falling behind (4008)", registry=r
        )

    def bind(self, sessions: Callable[[], int], subscribers: Callable[[], int]) -> None:
        self.registry.register(_Live(sessions, subscribers))

    def on_event(self, event: Event) -> None:
        self.events.inc()
        if event.type == "speech.created":
            self.speeches.labels(str(event.data.get("source"))).inc()
        elif event.type == "tool.ended":
            self.tool_calls.labels(str(event.data.get("status"))).inc()
        elif event.type == "speech.interrupted":
            self.interruptions.inc()
