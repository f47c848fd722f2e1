"""Prometheus metrics, on a registry of the app's own (several apps can live in one test process).

No ``*_created`` series: the time each counter and histogram (and each of their label sets) was created is a third of
the exposition and tells nothing a restart's ``process_start_time_seconds`` does not. Turned off for the process as
this module is imported, so in every process that builds the app (each node of a cluster is one)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..runtime.events import Event
from .attention import AttentionCode
from .cluster.fanout import REJECT_REASONS

CONNECTION_CLOSE_REASONS = ("header_timeout", "per_client", "pending_full")  # api.connections
HTTP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

disable_created_metrics()  # type: ignore[no-untyped-call]

if TYPE_CHECKING:
    from .cluster.fanout import RedisFanout
    from .cluster.feed import ClusterFeed
    from .host import SessionHost


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


class _Node(Collector):
    """Ownership: sessions this node owns, takeovers, fencing refusals, the lease."""

    def __init__(self, host: SessionHost) -> None:
        self._host = host

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        lease = self._host.lease
        if lease is None:
            return
        yield GaugeMetricFamily(
            "switchboard_node_owned_sessions", "Sessions this node owns", value=len(lease.fence.epochs)
        )
        yield CounterMetricFamily(
            "switchboard_node_adoptions", "Sessions this node took over from nodes gone", value=self._host.adopted
        )
        yield CounterMetricFamily(
            "switchboard_node_fencing_refusals",
            "Writes refused because this node no longer owned their session",
            value=lease.fence.refusals,
        )
        yield CounterMetricFamily(
            "switchboard_node_lease_renewals_failed", "Lease renewals that failed", value=lease.renewals_failed
        )
        yield CounterMetricFamily(
            "switchboard_node_lease_renewals_skipped",
            "Lease renewals not sent because the event loop had stalled",
            value=lease.renewals_skipped,
        )
        yield GaugeMetricFamily(
            "switchboard_node_deposed", "1 when this node lost its sessions", value=int(bool(lease.deposed))
        )


class _Cluster(Collector):
    """Cluster mode: whether Redis carries the events between nodes, or streams read them from the database."""

    def __init__(self, fanout: RedisFanout, feed: ClusterFeed) -> None:
        self._fanout = fanout
        self._feed = feed

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = self._fanout.available
        yield GaugeMetricFamily(
            "switchboard_cluster_redis_up", "1 while Redis carries events between nodes, 0 while it is down", value=up
        )
        mode = GaugeMetricFamily(
            "switchboard_cluster_fanout_mode", "How other nodes' events reach this node's streams", labels=["mode"]
        )
        mode.add_metric(["redis"], int(up))
        mode.add_metric(["database_polling"], int(not up))
        yield mode
        yield CounterMetricFamily(
            "switchboard_cluster_events_repaired",
            "Events read from the database that Redis had not delivered to this node",
            value=self._feed.repaired,
        )
        yield CounterMetricFamily(
            "switchboard_cluster_event_polls", "Reads of the database for other nodes' events", value=self._feed.polls
        )
        yield CounterMetricFamily(
            "switchboard_cluster_session_gap_reads",
            "Reads of the database to fill a gap in a session's events, once per session for all its streams here",
            value=self._feed.order.repairs,
        )
        yield CounterMetricFamily(
            "switchboard_cluster_events_dropped",
            "Events this node could not publish to Redis (the others read them from the database)",
            value=self._fanout.dropped,
        )
        rejected = CounterMetricFamily(
            "switchboard_cluster_messages_rejected",
            "Redis messages dropped unread: unsigned, with a signature that does not check, or malformed once checked",
            labels=["reason"],
        )
        for reason in REJECT_REASONS:
            rejected.add_metric([reason], self._fanout.rejected[reason])
        yield rejected
        discarded = CounterMetricFamily(
            "switchboard_cluster_events_discarded",
            "Events announced through Redis that the database does not hold as announced: the database's kept",
            labels=["feed"],
        )
        discarded.add_metric(["cursor"], self._feed.discarded)
        discarded.add_metric(["session"], self._feed.order.discarded)
        yield discarded


class _Attention(Collector):
    """The live sessions that need an operator now, by reason; and, with alert sinks, the alerts this node tracks and
    the deliveries waiting for each sink."""

    def __init__(self, host: SessionHost) -> None:
        self._host = host

    def collect(self) -> Iterator[GaugeMetricFamily]:
        host = self._host
        unavailable = host.store.writer.unavailable
        counts: dict[str, int] = {}
        for sid, live in list(host.sessions.items()):
            for reason in host.attention.reasons(sid, live, store_unavailable=unavailable):
                counts[str(reason.code)] = counts.get(str(reason.code), 0) + 1
        needing = GaugeMetricFamily(
            "switchboard_sessions_needing_attention",
            "Live sessions of this node with a reason for attention, by reason (a session may count under several)",
            labels=["reason"],
        )
        for code in sorted(set(counts) | {str(c) for c in AttentionCode}):
            needing.add_metric([code], counts.get(code, 0))
        yield needing
        engine = host.alerts
        if engine is None:
            return
        yield GaugeMetricFamily(
            "switchboard_alerts_open", "Open alerts of the sessions this node runs", value=engine.open_alerts()
        )
        queue = GaugeMetricFamily(
            "switchboard_alert_queue", "Alert deliveries waiting for a sink on this node, by sink", labels=["sink"]
        )
        for sink, waiting in engine.waiting().items():
            queue.add_metric([sink], waiting)
        yield queue


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
        self.generation_failures = Counter(
            "switchboard_generation_failures", "Model generations that failed, by model", ["model"], registry=r
        )
        self.time_to_first_token = Histogram(
            "switchboard_model_time_to_first_token_seconds",
            "From a model request to its first chunk, by model",
            ["model"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
            registry=r,
        )
        self.tokens = Counter(
            "switchboard_model_tokens", "Tokens reported by models, by model and kind", ["model", "kind"], registry=r
        )
        self.store_commit = Histogram(
            "switchboard_store_commit_seconds",
            "One group commit of the store's writer: from its transaction's start to its commit",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=r,
        )
        self.store_batch_ops = Histogram(
            "switchboard_store_batch_operations",
            "Operations (events, items, tool call changes) written by one group commit",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.ws_connections = Gauge(
            "switchboard_ws_connections", "Open event streams (WebSocket, and AG-UI over SSE)", registry=r
        )
        self.ws_dropped = Counter(
            "switchboard_ws_slow_consumers_dropped", "Event streams closed for falling behind (4008)", registry=r
        )
        self.forwards = Counter(
            "switchboard_node_forwards",
            "Requests for a session another node runs, sent on to it, by outcome: answered (whatever the owner "
            "answered), unreachable (it did not answer), not_live (no live owner), loop (received forwarded, 503)",
            ["outcome"],
            registry=r,
        )
        self.lease_renew = Histogram(
            "switchboard_node_lease_renew_seconds",
            "A lease renewal (or the registration), from sending it to its commit: past 3/4 of the lease without one "
            "the node lets go of its sessions",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.forward_latency = Histogram(
            "switchboard_node_forward_seconds",
            "A forwarded request: from sending it to the owner to its answer",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=r,
        )
        self.rate_limit_fallbacks = Counter(
            "switchboard_rate_limit_local_fallbacks",
            "Commands (and media edges' transcripts) charged to this node's own rate-limit buckets because the "
            "cluster's (in Redis) did not answer in time",
            registry=r,
        )
        self.media_edges = Gauge(
            "switchboard_media_edges", "Connected media edges (one per session at most)", registry=r
        )
        self.media_relays = Counter(
            "switchboard_node_media_relays",
            "Media edges for a session another node runs, relayed to it, by outcome: connected (the owner took the "
            "connection), unreachable (it did not; the edge is closed with 4410), lost (it went away mid-stream: "
            "4410), not_live (no live owner: 4410), loop (received relayed for a session this node does not run: 4410)",
            ["outcome"],
            registry=r,
        )
        self.media_relays_open = Gauge(
            "switchboard_node_media_relays_open", "Media edges relayed to another node right now", registry=r
        )
        self.media_transcripts_limited = Counter(
            "switchboard_media_transcripts_limited",
            "Media edges' transcripts over their caller's budget: interim ones coalesced (not stored), final ones "
            "refused (the edge sends them again)",
            ["kind"],
            registry=r,
        )
        self.connections_closed = Counter(
            "switchboard_connections_closed_before_request",
            "Connections the server closed before their request arrived, by reason: header_timeout (408, the request "
            "headers not in within HEADER_TIMEOUT_S), per_client (429, over MAX_CONNECTIONS_PER_CLIENT), pending_full "
            "(503, among the longest waiting of more than MAX_PENDING_CONNECTIONS)",
            ["reason"],
            registry=r,
        )
        self.media_barge_in = Histogram(
            "switchboard_media_barge_in_seconds",
            "A media edge's barge-in (user.speech_started) read -> speech.stop written to its socket",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=r,
        )

        self.http_requests = Counter(
            "switchboard_http_requests",
            "HTTP requests answered, by method, route template (unmatched: no route) and status code",
            ["method", "route", "status"],
            registry=r,
        )
        self.http_duration = Histogram(
            "switchboard_http_request_duration_seconds",
            "HTTP requests: from arrival to the start of the response, by method, route template and status class",
            ["method", "route", "status"],
            buckets=HTTP_BUCKETS_S,
            registry=r,
        )
        self._http_series: dict[tuple[str, str, int], tuple[Counter, Histogram]] = {}  # ``http_request``
        self.alert_attempts = Counter(
            "switchboard_alert_delivery_attempts",
            "Attempts to deliver an alert to a webhook sink, by sink and result (ok: answered 2xx; error: not)",
            ["sink", "result"],
            registry=r,
        )
        self.alert_deliveries = Counter(
            "switchboard_alert_deliveries",
            "Alert deliveries ended, by sink, transition (opened, cleared) and state: delivered, failed (every attempt "
            "failed) or dropped (the sink's queue was full)",
            ["sink", "transition", "state"],
            registry=r,
        )
        self.websockets = Counter(
            "switchboard_websocket_connections",
            "WebSocket connections accepted, by route template",
            ["route"],
            registry=r,
        )

    def http_request(self, method: str, route: str, status: int, seconds: float) -> None:
        # each (method, route, status)'s two series found once: ``labels`` validates and locks on every call
        key = (method, route, status)
        found = self._http_series.get(key)
        if found is None:
            found = self._http_series[key] = (
                self.http_requests.labels(method, route, str(status)),
                self.http_duration.labels(method, route, f"{status // 100}xx"),
            )
        found[0].inc()
        found[1].observe(seconds)

    def websocket_accepted(self, route: str) -> None:
        self.websockets.labels(route).inc()

    def bind_connections(self, pending: Callable[[], int]) -> None:
        """The connection gate (``api.connections``): its closes are counted with ``connection_closed``."""
        waiting = Gauge(
            "switchboard_connections_pending",
            "Connections whose request line and headers have not all arrived yet",
            registry=self.registry,
        )
        waiting.set_function(pending)
        for reason in CONNECTION_CLOSE_REASONS:  # each counted from 0, so a rate can be taken from the start
            self.connections_closed.labels(reason=reason)

    def connection_closed(self, reason: str) -> None:
        self.connections_closed.labels(reason=reason).inc()

    def on_store_commit(self, seconds: float, operations: int) -> None:
        self.store_commit.observe(seconds)
        self.store_batch_ops.observe(operations)

    def bind(self, sessions: Callable[[], int], subscribers: Callable[[], int]) -> None:
        self.registry.register(_Live(sessions, subscribers))

    def on_forward(self, outcome: str, seconds: float | None = None) -> None:
        self.forwards.labels(outcome=outcome).inc()
        if seconds is not None:
            self.forward_latency.observe(seconds)

    def on_media_relay(self, outcome: str) -> None:
        self.media_relays.labels(outcome=outcome).inc()

    def bind_node(self, host: SessionHost) -> None:
        self.registry.register(_Node(host))
        if host.lease is not None:
            host.lease.on_renewed = self.lease_renew.observe
            if host.lease.renew_latency_s is not None:  # its registration, before the metrics were bound
                self.lease_renew.observe(host.lease.renew_latency_s)

    def bind_attention(self, host: SessionHost, sinks: list[str]) -> None:
        """Sessions needing attention, and the alerts of ``host`` (``host.alerts``) to ``sinks``, counted from 0."""
        self.registry.register(_Attention(host))
        for sink in sinks:
            for result in ("ok", "error"):
                self.alert_attempts.labels(sink, result)

    # -- DeliveryObserver (control.alerts) --

    def alert_attempt(self, sink: str, ok: bool) -> None:
        self.alert_attempts.labels(sink, "ok" if ok else "error").inc()

    def alert_delivery(self, sink: str, kind: str, state: str) -> None:
        self.alert_deliveries.labels(sink, kind, state).inc()

    def bind_cluster(self, fanout: RedisFanout, feed: ClusterFeed) -> None:
        self.registry.register(_Cluster(fanout, feed))

    # -- ModelObserver (control.model_meter) --

    def model_first_token(self, model: str, seconds: float) -> None:
        self.time_to_first_token.labels(model).observe(seconds)

    def model_tokens(self, model: str, prompt: int, completion: int) -> None:
        self.tokens.labels(model, "prompt").inc(prompt)
        self.tokens.labels(model, "completion").inc(completion)

    def model_failed(self, model: str) -> None:
        self.generation_failures.labels(model).inc()

    def on_event(self, event: Event) -> None:
        self.events.inc()
        if event.type == "speech.created":
            self.speeches.labels(str(event.data.get("source"))).inc()
        elif event.type == "tool.ended":
            self.tool_calls.labels(str(event.data.get("status"))).inc()
        elif event.type == "speech.interrupted":
            self.interruptions.inc()
