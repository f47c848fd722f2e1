"""How the operator commands print: colours, tables, and one readable line per session event."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TextIO

# -- styles --------------------------------------------------------------------------------------------------------

ANSI = {
    "bold": "1",
    "dim": "2",
    "red": "31",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "magenta": "35",
    "cyan": "36",
}
STATUS_COLOURS = {"completed": "green", "cancelled": "magenta", "running": "yellow", "cancelling": "yellow"}


class Style:
    def __init__(self, colour: bool, unicode: bool) -> None:
        self.colour = colour
        self.unicode = unicode

    def __call__(self, text: str, *names: str) -> str:
        if not self.colour or not names:
            return text
        codes = ";".join(ANSI[n] for n in names)
        return f"\033[{codes}m{text}\033[0m"

    def bar(self, progress: float | None, width: int = 20) -> str:
        """A progress bar with its percentage; without a fraction (the tool knows no total) an indeterminate bar
        with no percentage, never a made-up one."""
        if progress is None:
            return f"[{self(('▒' if self.unicode else '~') * width, 'green')}]"
        filled = max(0, min(width, round(progress * width)))
        full, empty = ("█", "░") if self.unicode else ("#", "-")
        return f"[{self(full * filled, 'green')}{empty * (width - filled)}] {round(progress * 100):3d}%"


def choose_style(choice: str, stream: TextIO) -> Style:
    if choice == "always":
        colour = True
    elif choice == "never":
        colour = False
    else:
        colour = stream.isatty() and not os.environ.get("NO_COLOR")
    unicode = "utf" in (getattr(stream, "encoding", "") or "").lower()
    return Style(colour, unicode)


# What a terminal would act on rather than show: C0 and C1 controls (escape sequences can retitle the window, move the
# cursor, rewrite earlier lines, or, with some terminals, inject input) and bidi overrides (text that reads differently
# from what it is). Session text comes from users, models and tool backends: tail shows these as escapes. Tab stays;
# a newline is escaped too, as tail prints one line per event and a raw one could forge a line.
_TERMINAL_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c != 0x09}
_TERMINAL_CONTROLS |= {c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}
_TERMINAL_CONTROLS |= {0x0A: "\\n", 0x0D: "\\r"}


def printable(value: Any) -> Any:
    """``value`` (decoded JSON) with terminal controls in every string, keys included, replaced by visible escapes."""
    if isinstance(value, str):
        return value.translate(_TERMINAL_CONTROLS)
    if isinstance(value, list):
        return [printable(v) for v in value]
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    return value


# What Style writes on purpose: its colours and the reset, nothing else (no cursor moves, no hidden text)
_STYLE_CODE = "|".join(sorted(ANSI.values(), key=len, reverse=True))
_STYLE_SEQUENCE = re.compile(f"(\x1b\\[(?:0|(?:{_STYLE_CODE})(?:;(?:{_STYLE_CODE}))*)m)")
# a stream carries lines: its own line breaks stay, every other control is shown
_STREAM_CONTROLS = {c: escape for c, escape in _TERMINAL_CONTROLS.items() if c != 0x0A}


def terminal_safe(text: str) -> str:
    """``text`` as a terminal may receive it: Style's colour sequences and line breaks kept, every other control
    (server text a command forgot to escape included) shown as an escape."""
    pieces = _STYLE_SEQUENCE.split(text)  # odd pieces are Style's own sequences
    return "".join(p if i % 2 else p.translate(_STREAM_CONTROLS) for i, p in enumerate(pieces))


class TerminalStream(io.TextIOBase):
    """stdout or stderr as every command writes to it (``terminal_output``): the one place server text passes on
    its way to the operator's terminal, so a command that prints a tool's output or a model's error raw still
    cannot send the terminal an escape sequence."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(terminal_safe(text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]  # the wrapped stream's (choose_style reads it)
        return str(getattr(self.stream, "encoding", None) or "utf-8")


@contextmanager
def terminal_output() -> Iterator[None]:
    """Route ``sys.stdout`` and ``sys.stderr`` through ``TerminalStream`` while a command runs."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = TerminalStream(saved[0]), TerminalStream(saved[1])
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout, sys.stderr = saved


def short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def format_arguments(arguments: Any) -> str:
    if not isinstance(arguments, dict):
        return ""
    return ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items())


def age(created_at: str) -> str:
    try:
        seconds = int((datetime.now(UTC) - datetime.fromisoformat(created_at)).total_seconds())
    except ValueError:
        return "?"
    seconds = max(seconds, 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h"


def table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    """Aligned columns; a cell is one line whatever its text (its controls and line breaks shown as escapes)."""
    rows = [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        out.write("  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row)).rstrip() + "\n")


Formatter = Callable[[dict[str, Any], Style, dict[str, str]], str]


class _Fields(dict[str, Any]):
    """An event's data for ``str.format_map``: a missing field reads as None, like ``data.get(name)``."""

    def __missing__(self, key: str) -> None:
        return None


def _template(text: str, *colours: str) -> Formatter:
    """A formatter that fills ``text`` with the event's data fields."""

    def line(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
        return s(text.format_map(_Fields(d)), *colours)

    return line


def _session_closed(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    reason = f" ({d['reason']})" if d.get("reason") else ""  # closed by the service itself, e.g. idle
    return s(f"session closed{reason}", "bold")


def _session_failed(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    reason = d.get("reason") or "no reason given"
    agent = f" (agent {d['agent']})" if d.get("agent") else ""
    return s(f"session failed: {reason}{agent}", "bold", "red")


def _user_input(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    who = d.get("role") or "user"
    label = f"{who} (interim)" if not d.get("final", True) else who
    return s(f"{label}: ", "green", "bold") + short(d.get("text", ""), 200)


def _speech_interrupted(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    return s(f"interrupted {d.get('speech_id')}; heard: ", "yellow", "bold") + short(d.get("played_text", ""), 200)


def _speech_done(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    flag = " (interrupted)" if d.get("interrupted") else ""
    return s(f"speech {d.get('speech_id')} done{flag}", "dim")


def _message_item(item: dict[str, Any], s: Style) -> str:
    flag = " [interrupted]" if item.get("interrupted") else ""
    return s(f"{item.get('role')}: ", "cyan", "bold") + short(item.get("text", ""), 200) + s(flag, "yellow")


def _call_item(item: dict[str, Any], s: Style) -> str:
    return s(f"call {item.get('name')}({format_arguments(item.get('arguments'))})", "dim")


def _output_item(item: dict[str, Any], s: Style) -> str:
    return s(f"output of {item.get('name')}: {short(item.get('output', ''))}", "dim")


def other_item(item: dict[str, Any], s: Style) -> str:
    return s(f"chat item {item.get('type')}", "dim")


CHAT_ITEM_FORMATTERS: dict[str, Callable[[dict[str, Any], Style], str]] = {
    "message": _message_item,
    "function_call": _call_item,
    "function_call_output": _output_item,
}


def _chat_item(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    item: dict[str, Any] = d.get("item") or {}
    return CHAT_ITEM_FORMATTERS.get(str(item.get("type")), other_item)(item, s)


def _tool_started(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    flag = " [cancellable]" if d.get("cancellable") else ""
    started = s(f"tool {d.get('name')}({format_arguments(d.get('arguments'))}) started", "yellow")
    return started + s(f" {d.get('call_id')}{flag}", "dim")


def _tool_progress(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    progress = d.get("progress")
    name = names.get(str(d.get("call_id")), str(d.get("call_id")))
    bar = s.bar(float(progress) if isinstance(progress, int | float) else None)
    return " ".join(str(p) for p in (s(name, "yellow"), bar, d.get("message")) if p)


def _tool_ended(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    status = str(d.get("status"))
    colour = STATUS_COLOURS.get(status, "red")
    line = s(f"tool {d.get('name') or d.get('call_id')} {status}", colour, "bold") + f": {short(d.get('output'))}"
    error = d.get("error")  # why it failed (redacted); the model was given only the output
    return line + s(f" ({short(error)})", "dim") if error else line


def _operator_action(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    line = s(f"operator {d.get('actor')}: {d.get('action')}", "blue", "bold")
    call = d.get("call_id")
    shown = (names.get(str(call), call) if call else None, d.get("speech_id"), d.get("scheduled_id"))
    details = [str(x) for x in shown if x]
    if d.get("force"):
        details.append("forced")
    if d.get("displaced"):
        details.append(f"displacing {d.get('displaced')}")
    if d.get("idempotency_key"):
        details.append(f"key {d.get('idempotency_key')}")
    return line + (s(f" ({', '.join(details)})", "dim") if details else "")


def _taken_over(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    details = [f"from {d['displaced']}"] if d.get("displaced") else []
    if d.get("interrupted_speech_id"):
        details.append(f"interrupted {d['interrupted_speech_id']}")
    extra = f" ({', '.join(details)})" if details else ""
    return s(f"taken over by operator {d.get('operator')}{extra}: the model is asked for nothing", "bold", "yellow")


def _handed_back(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    by = f" by {d['by']}" if d.get("by") else ""
    reply = f"; the agent replies in {d['reply_speech_id']}" if d.get("reply_speech_id") else ""
    held = f"held by operator {d.get('operator')} since {d.get('since')}"
    return s(f"handed back to the agent{by} ({held}){reply}", "bold", "yellow")


def _operator_spoke(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    who = s(f"operator {d.get('operator')} as the agent ({d.get('speech_id')}, {d.get('item_id')}): ", "blue", "bold")
    return who + short(d.get("text", ""), 200)


def _scheduled_created(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    waits = [str(x) for x in (names.get(str(d.get("call_id")), d.get("call_id")), d.get("speech_id")) if x]
    line = f"{d.get('kind')} {d.get('id')} scheduled ({d.get('at')}{' ' + ', '.join(waits) if waits else ''})"
    return s(line, "blue")


def _scheduled_applied(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    what = [str(x) for x in (d.get("item_id"), d.get("speech_id")) if x]
    if d.get("interrupted") is not None:
        what.append("interrupted" if d["interrupted"] else "nothing to interrupt")
    return s(f"{d.get('kind')} {d.get('id')} applied" + (f" ({', '.join(what)})" if what else ""), "blue")


def _unknown(d: dict[str, Any], s: Style, names: dict[str, str]) -> str:
    return s(short(d), "dim")


EVENT_FORMATTERS: dict[str, Formatter] = {
    "session.started": _template("session started with agent {agent}", "bold"),
    "session.recovered": _template("──── session recovered after a restart (agent {agent}) ────", "bold", "yellow"),
    "session.closed": _session_closed,
    "session.failed": _session_failed,
    "agent.state": _template("agent is {state}", "dim"),
    "agent.handoff": _template("handoff {from_agent} → {to_agent}", "magenta"),
    "user.input": _user_input,
    "speech.created": _template("speech {speech_id} queued ({source})", "dim"),
    "generation.started": _template("thinking (speech {speech_id}, step {step})", "dim"),
    "speech.started": _template("speaking {speech_id}", "cyan"),
    "speech.interrupted": _speech_interrupted,
    "speech.done": _speech_done,
    "chat.item": _chat_item,
    "tool.started": _tool_started,
    "tool.progress": _tool_progress,
    "tool.cancelling": _template("tool call {call_id} cancelling ({reason}): the tool has not stopped yet", "yellow"),
    "tool.ended": _tool_ended,
    "generation.failed": _template("generation failed: {error}", "red"),
    "operator.action": _operator_action,
    "session.taken_over": _taken_over,
    "session.handed_back": _handed_back,
    "operator.spoke": _operator_spoke,
    "scheduled.created": _scheduled_created,
    "scheduled.applied": _scheduled_applied,
    "scheduled.cancelled": _template("{kind} {id} cancelled ({reason})", "yellow"),
    "session.coached": _template("coaching note {id}: {note}", "blue"),
}


def describe(event: dict[str, Any], s: Style, names: dict[str, str] | None = None) -> str:
    """One readable line for an event (without seq and time); `names` maps call ids to tool names."""
    formatter = EVENT_FORMATTERS.get(str(event.get("type", "")), _unknown)
    return formatter(event.get("data") or {}, s, names or {})


def event_line(event: dict[str, Any], s: Style, names: dict[str, str] | None = None) -> str:
    at = str(event.get("at", ""))
    try:
        clock = datetime.fromisoformat(at).astimezone().strftime("%H:%M:%S.%f")[:-3]
    except ValueError:
        clock = at
    kind = str(event.get("type", ""))
    return f"{s(str(event.get('seq')).rjust(5), 'dim')} {s(clock, 'dim')} {kind.ljust(19)} {describe(event, s, names)}"
