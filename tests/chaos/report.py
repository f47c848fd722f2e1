"""What a chaos run prints: the violations by class with their first examples, and the figures (faults and
operations by kind, failover time, the time to answer inputs accepted during a drain)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .checker import Row, Violation, by_class
from .history import History

EXAMPLES = 3


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def drain_answers(history: History, durable: dict[str, list[Row]]) -> tuple[list[float], int]:
    """For each input accepted while a node drained: seconds from its acceptance to the first `generation.started`
    after it in the durable log (by the event's database time); and how many got none."""
    windows = [(d["t0"], d.get("t1", d["t0"])) for d in history.of("drain")]
    events: dict[str, list[Row]] = {}
    for event in durable.get("events", []):
        events.setdefault(event["session_id"], []).append(event)
    times: list[float] = []
    missing = 0
    for op in history.of("op"):
        if op["op"] != "input" or op.get("status") != 202 or not any(t0 <= op["t1"] <= t1 for t0, t1 in windows):
            continue
        log = sorted(events.get(op["sid"], []), key=lambda e: e["seq"])
        seq = next(
            (e["seq"] for e in log if e["type"] == "user.input" and e["data"].get("item_id") == op["body"]["item_id"]),
            None,
        )
        answer = next(
            (e for e in log if seq is not None and e["seq"] > seq and e["type"] == "generation.started"), None
        )
        if answer is None:
            missing += 1
        else:
            times.append(max(0.0, answer["at"] - op["t1"]))
    return times, missing


def figures(history: History, durable: dict[str, list[Row]]) -> dict[str, Any]:
    faults = Counter(f["fault"] for f in history.of("fault"))
    fault_errors = [f"{f['fault']}: {f['error']}" for f in history.of("fault") if f.get("error")]
    ops = Counter(f"{o['op']} {o.get('status')}" for o in history.of("op"))
    out: dict[str, Any] = {
        "faults": dict(sorted(faults.items())),
        "fault_errors": fault_errors,
        "ops": dict(sorted(ops.items())),
    }
    for kind in ("kill", "pause"):
        done = [f["seconds"] for f in history.of("failover") if f["fault"] == kind and f["seconds"] is not None]
        never = sum(1 for f in history.of("failover") if f["fault"] == kind and f["seconds"] is None)
        out[f"failover_{kind}"] = {
            "sessions": len(done),
            "never": never,
            "p50": percentile(done, 0.5),
            "p99": percentile(done, 0.99),
            "max": max(done, default=None),
        }
    times, missing = drain_answers(history, durable)
    out["drain_answers"] = {
        "inputs": len(times) + missing,
        "unanswered": missing,
        "p50": percentile(times, 0.5),
        "p99": percentile(times, 0.99),
        "max": max(times, default=None),
    }
    reconnects = [s["connections"] for s in history.of("stream")]
    out["stream_connections"] = sum(reconnects)
    out["edge_connections"] = sum(e["connections"] for e in history.of("edge"))
    out["transcripts"] = _transcripts(history)
    out["sessions"] = sum(1 for _ in history.of("session"))
    out["start_failures"] = [r["detail"] for r in history.of("start_failed")]
    return out


def _transcripts(history: History) -> dict[str, int]:
    """The media edges' final transcripts: said, taken, and how often each was sent, acknowledged and refused."""
    said = [t for e in history.of("edge") for t in e.get("transcripts", [])]
    return {
        "said": len(said),
        "taken": sum(1 for t in said if t["taken_at"] is not None),
        "sends": sum(t["sends"] for t in said),
        "acks": sum(t["acks"] for t in said),
        "command_failed": sum(t["errors"].count("command_failed") for t in said),
    }


def render(violations: list[Violation], figs: dict[str, Any]) -> str:
    lines = ["", "violations by class", "-------------------"]
    classes = by_class(violations)
    if not classes:
        lines.append("none")
    for cls, found in classes.items():
        lines.append(f"{cls:<20} {len(found):>5}")
        for v in found[:EXAMPLES]:
            lines.append(f"    {v.sid or '-'}: {v.detail}")
    lines += ["", "figures", "-------"]
    lines.append("faults:     " + ", ".join(f"{k} {v}" for k, v in figs["faults"].items()))
    for error in figs["fault_errors"]:
        lines.append(f"  fault error: {error[:300]}")
    for failure in figs["start_failures"]:
        lines.append(f"  a node start exited (started again): {failure[:300]}")
    lines.append("operations: " + ", ".join(f"{k}: {v}" for k, v in figs["ops"].items()))
    lines.append(
        f"sessions {figs['sessions']}, stream connections {figs['stream_connections']}, "
        f"edge connections {figs['edge_connections']}"
    )
    t = figs["transcripts"]
    lines.append(
        f"edge transcripts: said {t['said']}, taken {t['taken']}, sends {t['sends']}, acks {t['acks']}, "
        f"command_failed {t['command_failed']}"
    )
    for kind in ("kill", "pause"):
        f = figs[f"failover_{kind}"]
        lines.append(
            f"failover after {kind}: {f['sessions']} sessions, p50 {_seconds(f['p50'])}, p99 "
            f"{_seconds(f['p99'])}, max {_seconds(f['max'])}, never owned again {f['never']}"
        )
    d = figs["drain_answers"]
    lines.append(
        f"inputs accepted during a drain: {d['inputs']}, answered p50 {_seconds(d['p50'])}, p99 "
        f"{_seconds(d['p99'])}, max {_seconds(d['max'])}, unanswered {d['unanswered']}"
    )
    return "\n".join(lines)
