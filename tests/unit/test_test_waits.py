"""The suite's own rule for waits (tests/waiting.py): a wait for a state has one ceiling, ``WAIT_S``, large enough for
a loaded machine. A shorter ceiling given at the call turned a slow machine into a failing test several times; this
check finds any such ceiling written as a number: ``until(..., timeout=10)`` and the other wait helpers (their
defaults too), ``asyncio.timeout(10)``, ``asyncio.wait_for(x, 10)``, a process's ``wait(10)`` or a thread's
``join(10)``, ``subprocess.run(..., timeout=10)``, ``communicate(timeout=10)`` and Playwright's ``timeout=``
(milliseconds). A wait whose bound is the point of the test (a promptness claim, or a wait expected to run out to show
that something does not happen) says so with ``# bound: <why>`` on one of the call's lines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.waiting import WAIT_S

TESTS = Path(__file__).resolve().parent.parent
CEILINGS = {"timeout", "timeout_s"}
WAITS = {"until", "wait_until", "wait_for_state", "idle", "recv"}  # and every ``wait_*`` but Playwright's
SUBPROCESS = {"run", "call", "check_call", "check_output", "communicate"}
PLAYWRIGHT = {"wait_for_selector", "wait_for_function", "wait_for_url", "wait_for_load_state", "wait_for_event"}
Ceiling = tuple[ast.expr, float]  # the expression given as a ceiling, and the unit it is in (1000: milliseconds)


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _owner(func: ast.expr) -> str:
    return _name(func.value) if isinstance(func, ast.Attribute) else ""


def _keywords(call: ast.Call, names: set[str]) -> list[ast.expr]:
    return [k.value for k in call.keywords if k.arg in names]


def _is_expect(func: ast.expr) -> bool:
    """``expect(locator).to_be_visible(...)``: a Playwright assertion, which waits."""
    value = func.value if isinstance(func, ast.Attribute) else None
    return isinstance(value, ast.Call) and _name(value.func) == "expect" and _name(func).startswith("to_")


def _ceilings(call: ast.Call) -> list[Ceiling]:
    """The ceilings ``call`` is given, if it is a wait."""
    name, owner = _name(call.func), _owner(call.func)
    if owner == "asyncio" and name == "timeout":
        found = call.args[:1] + _keywords(call, {"delay"})
    elif owner == "asyncio" and name == "wait_for":
        found = call.args[1:2] + _keywords(call, {"timeout"})
    elif owner == "asyncio" and name == "to_thread" and call.args and _name(call.args[0]) in SUBPROCESS:
        found = _keywords(call, {"timeout"})
    elif name in PLAYWRIGHT or _is_expect(call.func):
        return [(value, 1000) for value in _keywords(call, {"timeout"})]
    elif name in SUBPROCESS:
        found = _keywords(call, {"timeout"})
    elif name in {"wait", "join"}:  # a process's or a thread's (an event's wait and a string's join take no number)
        found = call.args[:1] + _keywords(call, {"timeout"}) if owner != "asyncio" else _keywords(call, {"timeout"})
    elif name in WAITS or name.startswith("wait_"):
        found = _keywords(call, CEILINGS)
    else:
        return []
    return [(value, 1) for value in found]


def _number(value: ast.expr | None) -> float | None:
    if isinstance(value, ast.Constant) and isinstance(value.value, int | float) and not isinstance(value.value, bool):
        return value.value
    return None


def _short_defaults(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, float]]:
    """A helper's own ceiling: a ``timeout``/``timeout_s`` parameter whose default is short and that it waits under
    (given as the ceiling of a wait in its body)."""
    args = node.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
    pairs += [(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True) if default]
    calls = [call for call in ast.walk(node) if isinstance(call, ast.Call)]
    for arg, default in pairs:
        seconds = _number(default)
        if arg.arg not in CEILINGS or seconds is None or seconds >= WAIT_S:
            continue
        given = [value for call in calls for value, _ in _ceilings(call)]
        if any(isinstance(value, ast.Name) and value.id == arg.arg for value in given):
            yield arg.arg, seconds


def _marked(lines: list[str], node: ast.stmt | ast.expr) -> bool:
    return any("# bound:" in line for line in lines[node.lineno - 1 : node.end_lineno])


def _short_ceilings(source: str, where: str) -> list[str]:
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and not _marked(lines, node):
            for value, unit in _ceilings(node):
                number = _number(value)
                if number is not None and number < WAIT_S * unit:
                    found.append(f"{where}:{node.lineno}: {_name(node.func)}(..., {number:g})")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _marked(lines[: node.lineno], node):
            for arg, seconds in _short_defaults(node):
                found.append(f"{where}:{node.lineno}: def {node.name}(..., {arg}={seconds:g})")
    return found


def test_no_wait_for_a_state_has_a_ceiling_below_the_shared_one():
    paths = sorted(TESTS.rglob("*.py"))
    found = [hit for path in paths for hit in _short_ceilings(path.read_text(), str(path.relative_to(TESTS)))]
    advice = "use the shared WAIT_S, or say `# bound: <why>` on the line if the bound is the point"
    assert not found, f"waits with their own short ceiling ({advice}):\n" + "\n".join(found)


def test_the_check_finds_each_form_of_a_short_ceiling_and_lets_a_marked_or_shared_one_be():
    source = """
async def f(proc, page, h):
    async with asyncio.timeout(5):
        pass
    await asyncio.wait_for(x, 5)
    await asyncio.wait_for(x, timeout=5)
    proc.wait(10)
    thread.join(5)
    subprocess.run(["x"], timeout=30)
    proc.communicate(timeout=3)
    await asyncio.to_thread(subprocess.run, ["x"], timeout=30)
    page.wait_for_selector(".row", timeout=20000)
    expect(page.locator(".row")).to_be_visible(timeout=5000)
    await h.wait_for("tool.ended", timeout=5.0)
    await until(check, timeout_s=10)
async def helper(timeout: float = 2.0):
    async with asyncio.timeout(timeout):
        pass
async def fine(proc, page, h, timeout_s: float = 1.0):
    async with asyncio.timeout(WAIT_S):
        pass
    async with asyncio.timeout(0.5):  # bound: released within ticks
        pass
    page.wait_for_selector(".row", timeout=WAIT_S * 1000)
    page.wait_for_timeout(200)
    await asyncio.wait(tasks, timeout=WAIT_S)
    await event.wait()
    ", ".join(names)
    httpx.Client(timeout=10)
    tool(timeout_s=timeout_s)
"""
    found = _short_ceilings(source, "sample.py")
    assert sorted(int(hit.split(":")[1]) for hit in found) == [3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], found
