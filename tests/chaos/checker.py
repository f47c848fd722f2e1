"""The chaos checker: reads a run's history and the durable state, and counts violations by class.

Classes (DESIGN.md's invariants, as they must hold across processes):

- ``lost-input``: a create, input or `say` answered 2xx whose effect is not durable (no session, no chat item, no
  speech); a media edge's final transcript answered `transcript.taken` that is not in the chat as a user message
  with the answered `item_id`, or one never taken by the end while its session lives.
- ``duplicate-effect``: one Idempotency-Key applied twice (two sessions, two chat messages, two speeches, or two
  different answers for one key); a media edge's final transcript stored as more than one chat message.
- ``idempotency-record``: a keyed command answered 2xx with no record of its key (a retry would apply it again).
- ``unanswered-input``: an accepted final input with no `generation.started` after its `user.input` in the durable
  log; the documented exception is an input whose queued reply a client's interrupt ended before it started.
- ``held-generation``: a `generation.started` while an operator held the session (between its `session.taken_over` and
  the next `session.handed_back`): the model is asked for nothing while held. An input accepted while held is not
  answered then (its answer names no speech); a hand-back that owes a reply (`reply_speech_id`) must generate it.
- ``unreplied-result``: a completed tool result, in a session no client interrupts, with no generation after it.
- ``call-ends``: a call left `running`, without exactly one `function_call` and one `function_call_output`, or whose
  row disagrees with its one durable `tool.ended` (also how a stale epoch's late write shows).
- ``event-log``: a session's `seq` not 1..N, an effect reported twice (an input, a speech created or done, a chat
  item), an accepted input or `say` durable without its event.
- ``stream``: a client stream that missed or repeated an event, saw one the database does not hold, or never caught
  up at the end.
- ``unowned-session``: a session not owned by a live node at the end, or failed.
- ``answer-5xx``: a 5xx other than 503 (to a command, or to a media edge's handshake); ``answer-503-other``: a 503
  whose code is not one of docs/cluster.md's retryable ones ("Retryable answers"); ``no-answer``: a command still
  failing (transport error, 503) when its client's retry time ran out.
- ``report-refused``: a webhook backend's report refused (403/404, or 409 `not_awaiting_report` to the end).
- ``edge-close``: a "session ended"-style close (1000, 4404) to a media edge while the session lived on, or any
  4409 (the edge's live connection replaced, though each of its attempts is numbered).
- ``not-settled``: the cluster did not settle (every node up, every session owned, no call running) in time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tests.retryable import RETRYABLE

from .history import History, Record

Row = dict[str, Any]
CLIENT_INTERRUPTS = ("interrupt", "barge_in", "takeover")
ENDED_STATES = ("closed", "failed")
KEYED_OPS = ("create", "input", "say", "interrupt", "cancel", "progress", "result", "takeover", "takeover_say")
SAY_SOURCES = {"say": "say", "takeover_say": "operator"}  # a say op -> its speech's source
EDGE_REPLACED = 4409
INTERRUPT_SLACK_S = 0.5  # an interrupt sent this long before the input was accepted may still have ended its reply


@dataclass(frozen=True)
class Violation:
    cls: str
    sid: str | None
    detail: str


def _ok(record: Record) -> bool:
    status = record.get("status")
    return isinstance(status, int) and 200 <= status < 300


class Checker:
    def __init__(self, history: History, durable: dict[str, list[Row]]) -> None:
        self.history = history
        self.durable = durable
        self.violations: list[Violation] = []
        self.sessions = {row["id"]: row for row in durable.get("sessions", [])}
        self.events: dict[str, list[Row]] = defaultdict(list)
        for row in sorted(durable.get("events", []), key=lambda r: (r["session_id"], r["seq"])):
            self.events[row["session_id"]].append(row)
        self.chat: dict[str, list[Row]] = defaultdict(list)
        for row in durable.get("chat_items", []):
            self.chat[row["session_id"]].append(row)
        self.roles = {r["sid"]: r["role"] for r in history.of("session")}
        self.ops = list(history.of("op"))
        self.edges = list(history.of("edge"))

    def add(self, cls: str, sid: str | None, detail: str) -> None:
        self.violations.append(Violation(cls, sid, detail))

    def run(self) -> list[Violation]:
        for check in (
            self.check_creates,
            self.check_inputs,
            self.check_says,
            self.check_transcripts,
            self.check_idempotency_records,
            self.check_answers,
            self.check_unanswered,
            self.check_held,
            self.check_unreplied,
            self.check_calls,
            self.check_event_log,
            self.check_streams,
            self.check_multi_stream,
            self.check_ownership,
            self.check_edges,
            self.check_settled,
        ):
            check()
        return self.violations

    # -- helpers ------------------------------------------------------------------------------------------------

    def _by_key(self, op: str) -> dict[str, list[Record]]:
        found: dict[str, list[Record]] = defaultdict(list)
        for record in self.ops:
            if record["op"] == op and record.get("key"):
                found[record["key"]].append(record)
        return found

    def _event_seq(self, sid: str, kind: str, field: str, value: Any) -> int | None:
        for event in self.events.get(sid, []):
            if event["type"] == kind and event["data"].get(field) == value:
                return int(event["seq"])
        return None

    def _generation_after(self, sid: str, seq: int) -> Row | None:
        for event in self.events.get(sid, []):
            if event["seq"] > seq and event["type"] == "generation.started":
                return event
        return None

    # -- effects ------------------------------------------------------------------------------------------------

    def check_creates(self) -> None:
        created: Counter[str] = Counter()
        for row in self.sessions.values():
            key = (row.get("metadata") or {}).get("chaos_key")
            if key:
                created[key] += 1
        for key, records in self._by_key("create").items():
            ids = {r["body"]["id"] for r in records if _ok(r) and r.get("body")}
            if len(ids) > 1 or created[key] > 1:
                self.add("duplicate-effect", None, f"create {key}: answered {sorted(ids)}, {created[key]} sessions")
            elif ids and created[key] == 0:
                self.add("lost-input", next(iter(ids)), f"create {key} answered 2xx, no such session is durable")

    def check_inputs(self) -> None:
        for key, records in self._by_key("input").items():
            accepted = [r for r in records if r.get("status") == 202]
            if not accepted:
                continue
            sid, text = accepted[0]["sid"], accepted[0]["text"]
            items = {r["body"]["item_id"] for r in accepted}
            chat = self.chat.get(sid, [])
            same_text = [i for i in chat if i["type"] == "message" and i["data"].get("text") == text]
            if len(items) > 1 or len(same_text) > 1:
                self.add("duplicate-effect", sid, f"input {key}: item ids {sorted(items)}, {len(same_text)} messages")
            for item_id in items:
                if not any(i["item_id"] == item_id for i in chat):
                    self.add("lost-input", sid, f"input {key} answered 202 (item {item_id}), not in the chat")

    def check_says(self) -> None:
        for op, source in SAY_SOURCES.items():
            self._check_says(op, source)

    def _check_says(self, op: str, source: str) -> None:
        speeches = self.durable.get("speeches", [])
        for key, records in self._by_key(op).items():
            accepted = [r for r in records if r.get("status") == 202]
            if not accepted:
                continue
            sid, text = accepted[0]["sid"], accepted[0]["text"]
            rows = [s for s in speeches if s["session_id"] == sid and s["text"] == text and s["source"] == source]
            said = [i for i in self.chat.get(sid, []) if i["type"] == "message" and i["data"].get("text") == text]
            if len(rows) > 1 or len(said) > 1:
                self.add("duplicate-effect", sid, f"say {key}: {len(rows)} speeches, {len(said)} chat messages")
            speech_id = accepted[0]["body"]["speech_id"]
            if self._event_seq(sid, "speech.created", "speech_id", speech_id) is None:
                if any(row["id"] == speech_id for row in speeches):
                    self.add("event-log", sid, f"say {key}: speech {speech_id} is durable without speech.created")
                else:
                    self.add("lost-input", sid, f"say {key} answered 202 (speech {speech_id}), no such speech")

    def check_transcripts(self) -> None:
        """Each final transcript an edge said is one user message: the one `transcript.taken` named."""
        for edge in self.edges:
            sid = edge["sid"]
            lives = self.sessions.get(sid, {}).get("state") not in ENDED_STATES
            chat = self.chat.get(sid, [])
            for said in edge.get("transcripts", []):
                what = f"transcript {said['id']} ({said['text']!r}, sent {said['sends']}, acks {said['acks']})"
                stored = [
                    i["item_id"]
                    for i in chat
                    if i["type"] == "message"
                    and i["data"].get("role") == "user"
                    and i["data"].get("text") == said["text"]
                ]
                if len(stored) > 1:
                    self.add("duplicate-effect", sid, f"{what}: {len(stored)} chat messages {stored}")
                if said["taken_at"] is None:
                    if lives:
                        self.add("lost-input", sid, f"{what}: never taken ({len(stored)} chat messages)")
                elif said["item_id"] not in stored:
                    self.add("lost-input", sid, f"{what}: taken as {said['item_id']}, the chat has {stored}")

    def check_idempotency_records(self) -> None:
        recorded = {row["key"] for row in self.durable.get("idempotency_keys", [])}
        for record in self.ops:
            if record["op"] in KEYED_OPS and record.get("key") and _ok(record) and record["key"] not in recorded:
                self.add("idempotency-record", record.get("sid"), f"{record['op']} {record['key']} has no record")

    # -- answers ------------------------------------------------------------------------------------------------

    def check_answers(self) -> None:
        for record in self.ops:
            what = f"{record['op']} {record.get('key')}"
            for at, status, code in record.get("attempts", []):
                if not isinstance(status, int) or status < 500 or (status == 503 and code in RETRYABLE):
                    continue
                cls = "answer-503-other" if status == 503 else "answer-5xx"
                self.add(cls, record.get("sid"), f"{what}: {status} {code} at {at:.3f}")
            status = record.get("status")
            if status == "transport" or status == 503:  # still failing when its client's retry time ran out
                self.add("no-answer", record.get("sid"), f"{what}: gave up after {len(record['attempts'])} tries")
            if record["op"] in ("progress", "result") and (
                status in (403, 404) or (status == 409 and record.get("code") == "not_awaiting_report")
            ):
                self.add(
                    "report-refused",
                    record.get("sid"),
                    f"{what} for {record.get('call_id')}: {status} {record.get('code')}",
                )

    # -- liveness -----------------------------------------------------------------------------------------------

    def _client_interrupted(self, sid: str, since: float) -> bool:
        """A client interrupt sent after ``since``: an interrupt, an interrupting input, a barge-in, or a final
        transcript taken after it (taken may be later than applied, never earlier)."""
        for edge in self.edges:
            if edge["sid"] != sid:
                continue
            for said in edge.get("transcripts", []):
                if said["taken_at"] is not None and said["taken_at"] >= since - INTERRUPT_SLACK_S:
                    return True
        for record in self.ops:
            if record.get("sid") != sid or record["t0"] < since - INTERRUPT_SLACK_S:
                continue
            interrupting = record["op"] in CLIENT_INTERRUPTS or (record["op"] == "input" and record.get("interrupt"))
            if interrupting and (record["op"] == "barge_in" or _ok(record)):
                return True
        return False

    def _ended_queued(self, sid: str, speech_id: str | None) -> bool:
        """The input's own reply ended interrupted before it generated (the documented exception)."""
        if speech_id is None or self._event_seq(sid, "generation.started", "speech_id", speech_id) is not None:
            return False
        return any(
            e["type"] in ("speech.done", "speech.interrupted") and e["data"].get("speech_id") == speech_id
            for e in self.events.get(sid, [])
        )

    def check_unanswered(self) -> None:
        seen: set[str] = set()
        for record in self.ops:
            if record["op"] != "input" or record.get("status") != 202 or not record.get("body"):
                continue
            sid, item_id = record["sid"], record["body"]["item_id"]
            if item_id in seen or self.sessions.get(sid, {}).get("state") in ENDED_STATES:
                continue
            seen.add(item_id)
            seq = self._event_seq(sid, "user.input", "item_id", item_id)
            if seq is None:
                if any(i["item_id"] == item_id for i in self.chat.get(sid, [])):
                    self.add("event-log", sid, f"input item {item_id} is in the chat without its user.input event")
                continue
            if self._generation_after(sid, seq) is not None:
                continue
            speech_id = record["body"].get("speech_id")
            if speech_id is None and self._held_at(sid, seq):
                continue  # taken while an operator held the session: not answered then (``check_held``)
            if self._ended_queued(sid, speech_id) and self._client_interrupted(sid, record["t0"]):
                continue
            self.add("unanswered-input", sid, f"input item {item_id} (user.input seq {seq}, speech {speech_id})")

    def _held_windows(self, sid: str) -> list[tuple[int, int | None]]:
        """The seq ranges in which an operator held the session: (taken_over, handed_back or None: to the end)."""
        windows: list[tuple[int, int | None]] = []
        start: int | None = None
        for event in self.events.get(sid, []):
            if event["type"] == "session.taken_over" and start is None:
                start = int(event["seq"])
            elif event["type"] == "session.handed_back" and start is not None:
                windows.append((start, int(event["seq"])))
                start = None
        if start is not None:
            windows.append((start, None))
        return windows

    def _held_at(self, sid: str, seq: int) -> bool:
        return any(start < seq and (end is None or seq < end) for start, end in self._held_windows(sid))

    def check_held(self) -> None:
        """No generation while held; the reply a hand-back owes is generated (or a client's interrupt, or another
        takeover, ended it before it started)."""
        for sid, events in self.events.items():
            for event in events:
                if event["type"] == "generation.started" and self._held_at(sid, int(event["seq"])):
                    speech = event["data"].get("speech_id")
                    self.add("held-generation", sid, f"generation of {speech} at seq {event['seq']} while held")
                if event["type"] == "session.handed_back" and event["data"].get("reply_speech_id"):
                    speech_id = event["data"]["reply_speech_id"]
                    generated = self._event_seq(sid, "generation.started", "speech_id", speech_id) is not None
                    cut = any(  # ended by an interrupt, or by another takeover, before it started
                        e["type"] == "speech.done"
                        and e["data"].get("speech_id") == speech_id
                        and e["data"]["interrupted"]
                        for e in events
                    )
                    if not generated and not cut:
                        self.add("unanswered-input", sid, f"hand-back at seq {event['seq']}: {speech_id} never ran")

    def check_unreplied(self) -> None:
        for sid, events in self.events.items():
            if self.roles.get(sid) not in ("tools", "webhook"):
                continue
            for event in events:
                data = event["data"]
                completed = event["type"] == "tool.ended" and data.get("status") == "completed"
                if completed and self._generation_after(sid, event["seq"]) is None:
                    self.add("unreplied-result", sid, f"call {data.get('call_id')} completed at seq {event['seq']}")

    # -- tool calls ---------------------------------------------------------------------------------------------

    def check_calls(self) -> None:
        ended: dict[tuple[str, str], list[Row]] = defaultdict(list)
        for sid, events in self.events.items():
            for event in events:
                if event["type"] == "tool.ended":
                    ended[(sid, event["data"].get("call_id"))].append(event)
        items: Counter[tuple[str, str | None, str]] = Counter(
            (i["session_id"], i["call_id"], i["type"]) for rows in self.chat.values() for i in rows
        )
        for row in self.durable.get("tool_calls", []):
            sid, call_id, status = row["session_id"], row["call_id"], row["status"]
            what = f"call {call_id} ({row['name']}, {status})"
            if status == "running":
                self.add("call-ends", sid, f"{what} left running")
                continue
            pairs = (items[(sid, call_id, "function_call")], items[(sid, call_id, "function_call_output")])
            if pairs != (1, 1):
                self.add("call-ends", sid, f"{what}: {pairs[0]} function_call, {pairs[1]} outputs")
            statuses = [e["data"].get("status") for e in ended.get((sid, call_id), [])]
            if statuses != [status]:
                self.add("call-ends", sid, f"{what}: durable tool.ended statuses {statuses}")
        for (sid, call_id, kind), count in items.items():
            if call_id is not None and call_id.endswith("/final") and count > 1:
                self.add("call-ends", sid, f"{count} {kind} items for {call_id}")

    # -- the event log and the streams --------------------------------------------------------------------------

    def check_event_log(self) -> None:
        unique = {
            "user.input": "item_id",
            "speech.created": "speech_id",
            "speech.done": "speech_id",
            "tool.started": "call_id",
        }
        for sid, events in self.events.items():
            seqs = [e["seq"] for e in events]
            if seqs != list(range(1, len(seqs) + 1)):
                self.add("event-log", sid, f"seq not 1..{len(seqs)}: first wrong at {_first_wrong(seqs)}")
            counts: Counter[tuple[str, Any]] = Counter()
            for event in events:
                field = unique.get(event["type"])
                if event["type"] == "chat.item":
                    counts[("chat.item", (event["data"].get("item") or {}).get("id"))] += 1
                elif field is not None:
                    counts[(event["type"], event["data"].get(field))] += 1
            for (kind, subject), count in counts.items():
                if count > 1 and not (kind == "tool.started" and self._rerun(sid, subject)):
                    self.add("event-log", sid, f"{kind} for {subject} {count} times")

    def _rerun(self, sid: str, call_id: Any) -> bool:
        """A call re-run after its node died (on_restart=retry) is started again by design."""
        return any(r["call_id"] == call_id and r["name"] == "rerun" for r in self.durable.get("tool_calls", []))

    def check_streams(self) -> None:
        durable = {(sid, e["seq"]): e["type"] for sid, events in self.events.items() for e in events}
        for stream in self.history.of("stream"):
            sid = stream["sid"]
            seqs = [f[0] for f in stream["frames"]]
            wrong = _first_wrong(seqs)
            if wrong is not None:
                kind = "repeated" if wrong < len(seqs) and wrong > 0 and seqs[wrong] <= seqs[wrong - 1] else "missed"
                near = [
                    f"{f[0]}@{f[3] if len(f) > 3 else '?'}" for f in stream["frames"][max(0, wrong - 2) : wrong + 2]
                ]
                self.add("stream", sid, f"session stream {kind} an event (seq@connection): ... {near}")
            for seq, kind, *_ in stream["frames"]:
                if durable.get((sid, seq)) != kind:
                    self.add(
                        "stream",
                        sid,
                        f"session stream saw seq {seq} {kind}; the database has {durable.get((sid, seq))}",
                    )
                    break
            last = len(self.events.get(sid, []))
            if (seqs[-1] if seqs else 0) < last:
                self.add("stream", sid, f"session stream behind at the end: {seqs[-1] if seqs else 0} of {last}")

    def check_multi_stream(self) -> None:
        durable = {e["id"]: e for events in self.events.values() for e in events}
        for multi in self.history.of("multi"):
            cursors = [f[0] for f in multi["frames"]]
            for i in range(1, len(cursors)):
                if cursors[i] <= cursors[i - 1]:
                    self.add(
                        "stream", None, f"multi-session stream repeated: cursor {cursors[i]} after {cursors[i - 1]}"
                    )
                    break
            for cursor, sid, seq, kind in multi["frames"]:
                event = durable.get(cursor)
                if event is None or (event["session_id"], event["seq"], event["type"]) != (sid, seq, kind):
                    self.add(
                        "stream",
                        sid,
                        f"multi-session stream saw cursor {cursor} ({sid} {seq} {kind}), not in the database",
                    )
                    break
            seen = set(cursors)
            missed = [c for c in sorted(durable) if cursors and c <= max(cursors) and c not in seen]
            if missed:
                self.add("stream", None, f"multi-session stream missed {len(missed)} events, first cursor {missed[0]}")
            if durable and (not cursors or max(cursors) < max(durable)):
                self.add(
                    "stream",
                    None,
                    f"multi-session stream behind at the end: {max(cursors, default=0)} of {max(durable)}",
                )

    # -- the end state ------------------------------------------------------------------------------------------

    def check_ownership(self) -> None:
        live = {n["id"] for n in self.durable.get("nodes", []) if n["state"] == "live" and n["leased"]}
        for sid, row in self.sessions.items():
            if row["state"] == "failed":
                self.add("unowned-session", sid, "session failed")
            elif row["state"] != "closed" and row["owner_node"] not in live:
                self.add("unowned-session", sid, f"owner {row['owner_node']} is not a live node ({row['state']})")

    def check_edges(self) -> None:
        for edge in self.edges:
            sid = edge["sid"]
            ended = self.sessions.get(sid, {}).get("state") in ENDED_STATES
            for at, code, reason in edge["closes"]:
                if code == EDGE_REPLACED or (code in (1000, 4404) and not ended):
                    self.add("edge-close", sid, f"media edge closed {code} {reason!r} at {at:.3f}")
                elif reason == "handshake" and code >= 500 and code != 503:  # a node stopping answers 503
                    self.add("answer-5xx", sid, f"media edge's handshake answered {code} at {at:.3f}")

    def check_settled(self) -> None:
        for record in self.history.of("settle"):
            if not record["ok"]:
                self.add("not-settled", None, f"after {record['seconds']:.0f} s: {record['detail']}")


def _first_wrong(seqs: list[int]) -> int | None:
    for i, seq in enumerate(seqs):
        if seq != i + 1:
            return i
    return None


def check(history: History, durable: dict[str, list[Row]]) -> list[Violation]:
    return Checker(history, durable).run()


def by_class(violations: Iterable[Violation]) -> dict[str, list[Violation]]:
    found: dict[str, list[Violation]] = defaultdict(list)
    for violation in violations:
        found[violation.cls].append(violation)
    return dict(sorted(found.items()))
