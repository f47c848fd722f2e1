"""The history of a chaos run: what every client did and saw, and what the harness did, as plain JSON records.

Every record has a ``kind``:

- ``op``: one client operation, all its attempts included: ``op`` (create, input, say, interrupt, cancel, progress,
  result), ``sid``, ``key`` (its Idempotency-Key, if any), ``t0``/``t1`` (wall clock, seconds), ``attempts``
  (``[t, status or "transport", code]``), the final ``status``/``code``/``body``, and the request's own fields
  (``text``, ``interrupt``, ``role``...).
- ``session``: a session the load created: ``sid``, ``role``, ``key``.
- ``stream``: one session-stream client: ``sid``, ``frames`` (``[seq, type, t]`` in the order received, across its
  reconnections), ``connections``.
- ``multi``: the multi-session stream client: ``frames`` (``[cursor, sid, seq, type]``).
- ``edge``: one media edge: ``sid``, ``edge_id``, ``closes`` (``[t, code, reason]``), ``barge_ins`` (times),
  ``connections`` (opened), ``attempts`` (numbered), ``speeches``, ``transcripts`` (each final transcript it said:
  ``id``, ``text``, ``said_at``, ``taken_at`` and ``item_id`` from its first `transcript.taken` or None, ``sends``,
  ``acks``, ``errors`` (the codes of the `error` frames naming it)).
- ``fault``: ``fault`` (its kind), ``target``, ``t0``/``t1``.
- ``failover``: ``node``, ``sid``, ``seconds`` (from the fault until another live node owned the session).
- ``settle``: ``ok``, ``seconds``, ``detail``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

Record = dict[str, Any]


class History:
    def __init__(self) -> None:
        self.records: list[Record] = []

    def add(self, kind: str, **fields: Any) -> Record:
        record = {"kind": kind, **fields}
        self.records.append(record)
        return record

    def of(self, kind: str) -> Iterator[Record]:
        return (r for r in self.records if r["kind"] == kind)

    def save(self, path: Path) -> None:
        with path.open("w") as out:
            for record in self.records:
                out.write(json.dumps(record, default=str) + "\n")

    @classmethod
    def load(cls, path: Path) -> History:
        return cls.of_records(json.loads(line) for line in path.read_text().splitlines() if line.strip())

    @classmethod
    def of_records(cls, records: Iterable[Record]) -> History:
        history = cls()
        history.records = list(records)
        return history


def now() -> float:
    """Wall-clock time (the harness's own, never faked), comparable with the database's timestamps."""
    return time.time()
