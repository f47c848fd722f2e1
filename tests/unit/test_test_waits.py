"""The suite's own rule for waits (tests/waiting.py): a wait for a state has one ceiling, ``WAIT_S``, large enough for
a loaded machine. A shorter ceiling given at the call (``until(..., timeout=10)``) turned a slow machine into a
failing test several times; this check finds any such call. A wait whose bound is the point of the test (a
promptness claim) says so with ``# bound:`` on the call's first line."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.waiting import WAIT_S

TESTS = Path(__file__).resolve().parent.parent
WAITS = {"until", "wait_until", "wait_for_state"}
CEILINGS = {"timeout", "timeout_s"}


def _short_ceilings(path: Path) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in WAITS:
            continue
        if "# bound:" in lines[node.lineno - 1]:
            continue
        for keyword in node.keywords:
            value = keyword.value
            literal = isinstance(value, ast.Constant) and isinstance(value.value, int | float)
            if keyword.arg in CEILINGS and literal and value.value < WAIT_S:
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}: {name}(..., {keyword.arg}={value.value})")
    return found


def test_no_wait_for_a_state_has_a_ceiling_below_the_shared_one():
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in _short_ceilings(path)]
    assert not found, "waits with their own short ceiling (use the shared WAIT_S):\n" + "\n".join(found)
