"""Chat context: the append-only record of a conversation and the views the model sees.

Storage is append-only; order is a view. Items are ordered by ``created_at`` (ties by insertion), and every
``function_call_output`` is placed immediately after its ``function_call``, which is what provider APIs require.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic.config import JsonDict

PLACEHOLDER_OUTPUT = "This tool call is still in progress; its result will be shared when it is done."


#: the synthetic call id of an async tool's final pair is ``<call_id>/final`` (never a call the model made)
FINAL_SUFFIX = "/final"


class _RandomIds:
    """Random ids drawn from ``os.urandom`` a page at a time: the same randomness as ``secrets.token_hex``, with one
    system call per 512 ids instead of one each. A system call releases the interpreter lock, and the event loop then
    waits for the store's writer thread to give it back: it cost a session create more than the rest of its id."""

    ID_BYTES = 8
    PAGE_BYTES = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._page = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._forget)  # a child never repeats its parent's ids

    def _forget(self) -> None:
        self._page, self._at = b"", 0

    def hex(self) -> str:
        with self._lock:
            at = self._at
            if at + self.ID_BYTES > len(self._page):
                self._page, at = os.urandom(self.PAGE_BYTES), 0
            self._at = at + self.ID_BYTES
            return self._page[at : at + self.ID_BYTES].hex()


_random_ids = _RandomIds()


def new_id(prefix: str) -> str:
    return f"{prefix}_{_random_ids.hex()}"


class _Clock:
    """Wall-clock timestamps that never repeat or go backwards within a process."""

    def __init__(self) -> None:
        self._last_us = 0

    def now(self) -> datetime:
        now_us = time.time_ns() // 1000
        self._last_us = max(now_us, self._last_us + 1)
        return datetime.fromtimestamp(self._last_us / 1_000_000, tz=UTC)


_clock = _Clock()


def utcnow() -> datetime:
    """A strictly increasing UTC timestamp (microsecond resolution)."""
    return _clock.now()


def _type_required(schema: JsonDict) -> None:
    # every item names its type, the tag of the ChatItem union (with its default, the union's members would overlap)
    required = schema.get("required")
    schema["required"] = ["type", *(required if isinstance(required, list) else [])]


class _Item(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra=_type_required)

    id: str
    created_at: datetime = Field(default_factory=utcnow)


class ChatMessage(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    text: str
    interrupted: bool = False


class FunctionCall(_Item):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class FunctionCallOutput(_Item):
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    name: str
    output: str
    is_error: bool = False


class AgentHandoff(_Item):
    type: Literal["agent_handoff"] = "agent_handoff"
    from_agent: str | None
    to_agent: str


ChatItem = Annotated[ChatMessage | FunctionCall | FunctionCallOutput | AgentHandoff, Field(discriminator="type")]
chat_item_adapter: TypeAdapter[ChatItem] = TypeAdapter(ChatItem)


def message(role: Literal["user", "assistant", "system", "developer"], text: str, **kw: Any) -> ChatMessage:
    return ChatMessage(id=new_id("item"), role=role, text=text, **kw)


def order_items(items: Iterable[ChatItem]) -> list[ChatItem]:
    """The conversation view: by ``created_at`` (stable), each output right after its call.

    An output whose call is absent keeps its own position (``validate`` reports it).
    """
    ordered = sorted(items, key=lambda it: it.created_at)  # sorted() is stable: ties keep insertion order
    call_ids = {it.call_id for it in ordered if isinstance(it, FunctionCall)}
    outputs: dict[str, list[FunctionCallOutput]] = {}
    for it in ordered:
        if isinstance(it, FunctionCallOutput) and it.call_id in call_ids:
            outputs.setdefault(it.call_id, []).append(it)
    view: list[ChatItem] = []
    for it in ordered:
        if isinstance(it, FunctionCallOutput) and it.call_id in call_ids:
            continue
        view.append(it)
        if isinstance(it, FunctionCall):
            view.extend(outputs.get(it.call_id, ()))
    return view


def validate(items: Sequence[ChatItem]) -> list[str]:
    """Problems that would make a provider reject this context (empty when valid).

    Checks: every call has exactly one output placed right after it, no output without a call, no duplicate ids.
    """
    problems: list[str] = []
    seen_ids: set[str] = set()
    calls: dict[str, int] = {}
    outputs: dict[str, int] = {}
    for index, it in enumerate(items):
        if it.id in seen_ids:
            problems.append(f"duplicate item id {it.id}")
        seen_ids.add(it.id)
        if isinstance(it, FunctionCall):
            if it.call_id in calls:
                problems.append(f"duplicate function_call {it.call_id}")
            calls[it.call_id] = index
        elif isinstance(it, FunctionCallOutput):
            if it.call_id in outputs:
                problems.append(f"duplicate function_call_output {it.call_id}")
            outputs[it.call_id] = index
    for call_id, index in calls.items():
        if call_id not in outputs:
            problems.append(f"function_call {call_id} has no output")
        elif outputs[call_id] != index + 1:
            problems.append(f"function_call_output {call_id} is not right after its call")
    for call_id in outputs:
        if call_id not in calls:
            problems.append(f"function_call_output {call_id} has no call")
    return problems


#: The progress pairs (``<call_id>/update/<n>``) of one call that a model is shown: the latest ones. The store keeps
#: every pair; the model's view stays bounded however many updates a long tool makes.
UPDATE_PAIRS_SHOWN = 3
UPDATE_MARK = "/update/"


def _latest_updates(view: list[ChatItem]) -> list[ChatItem]:
    """``view`` without the progress pairs of a call older than its latest ``UPDATE_PAIRS_SHOWN``."""
    per_call: dict[str, list[str]] = {}
    for it in view:
        if isinstance(it, FunctionCall) and UPDATE_MARK in it.call_id:
            per_call.setdefault(it.call_id.rsplit(UPDATE_MARK, 1)[0], []).append(it.call_id)
    hidden = {cid for ids in per_call.values() for cid in ids[:-UPDATE_PAIRS_SHOWN]}
    if not hidden:
        return view
    return [it for it in view if not (isinstance(it, (FunctionCall, FunctionCallOutput)) and it.call_id in hidden)]


class ChatContext:
    """The in-memory chat context of one session: append-only items plus ordered views.

    ``version`` changes on every append, so a snapshot can tell whether the context moved on since.
    """

    def __init__(self, items: Iterable[ChatItem] = (), *, ordered: bool = False) -> None:
        """``ordered``: ``items`` are in the order of the view already (as the store reads a chat back), so they are
        not ordered again."""
        self._items: list[ChatItem] = list(items)
        self._ids = {it.id for it in self._items}
        self._version = itertools.count(1)
        self.version = 0
        # the ordered view of ``_items``, until the next append
        self._ordered: list[ChatItem] | None = list(self._items) if ordered else None

    def __len__(self) -> int:
        return len(self._items)

    def append(self, *items: ChatItem) -> None:
        for it in items:
            if it.id in self._ids:
                continue  # idempotent: the same item committed twice is kept once
            self._ids.add(it.id)
            self._items.append(it)
            self._ordered = None
        self.version = next(self._version)

    @property
    def items(self) -> list[ChatItem]:
        """Ordered view (a new list; the order is worked out once per append, items are immutable)."""
        if self._ordered is None:
            self._ordered = order_items(self._items)
        return list(self._ordered)

    def find_call(self, call_id: str) -> FunctionCall | None:
        for it in self._items:
            if isinstance(it, FunctionCall) and it.call_id == call_id:
                return it
        return None

    def count_calls(self, prefix: str) -> int:
        """How many calls have an id starting with ``prefix``."""
        return sum(1 for it in self._items if isinstance(it, FunctionCall) and it.call_id.startswith(prefix))

    def has_output(self, call_id: str) -> bool:
        return any(isinstance(it, FunctionCallOutput) and it.call_id == call_id for it in self._items)

    def for_llm(self, running: Sequence[FunctionCall] = ()) -> list[ChatItem]:
        """The context handed to a model (I2): calls still running get a placeholder output (never persisted).

        ``running`` are calls that started in earlier turns and have not committed a pair yet.
        """
        extra: list[ChatItem] = []
        for call in running:
            if self.find_call(call.call_id) is not None:
                continue
            extra.append(call)
            extra.append(
                FunctionCallOutput(
                    id=f"placeholder_{call.call_id}",
                    call_id=call.call_id,
                    name=call.name,
                    output=PLACEHOLDER_OUTPUT,
                    created_at=call.created_at,
                )
            )
        view = _latest_updates(order_items([*self._items, *extra]))
        # Defence in depth for I2: a call that somehow lacks its output is never shown to the model.
        outputs = {it.call_id for it in view if isinstance(it, FunctionCallOutput)}
        calls = {it.call_id for it in view if isinstance(it, FunctionCall)}
        return [
            it
            for it in view
            if not (isinstance(it, FunctionCall) and it.call_id not in outputs)
            and not (isinstance(it, FunctionCallOutput) and it.call_id not in calls)
        ]
