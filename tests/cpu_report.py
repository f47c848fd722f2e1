"""Where the suite's CPU goes, per test and per file: the time a test took says little on a shared machine (it is
mostly the wait for a core), the CPU it spent says what it costs every other test running beside it.

With ``SWITCHBOARD_TEST_CPU_REPORT=FILE`` set, each test (setup, call and teardown) appends a line to ``FILE``: its
node id, the CPU seconds of its worker and of the processes the worker reaped meanwhile (its servers, its command-line
runs), and its wall seconds. A server a fixture shares between tests counts for the test after which it is stopped.
``python -m tests.cpu_report FILE`` sums them per file, the most expensive first.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections import Counter
from collections.abc import Generator
from pathlib import Path

import pytest

REPORT_ENV = "SWITCHBOARD_TEST_CPU_REPORT"


def _cpu() -> float:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None]:
    report = os.environ.get(REPORT_ENV)
    if not report:
        yield
        return
    cpu, wall = _cpu(), time.monotonic()
    yield
    line = f"{item.nodeid}\t{_cpu() - cpu:.3f}\t{time.monotonic() - wall:.3f}\n"
    with open(report, "a") as out:  # one short append per test: the workers' lines do not interleave
        out.write(line)


def per_file(lines: list[str]) -> tuple[Counter[str], Counter[str], Counter[str]]:
    cpu: Counter[str] = Counter()
    wall: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for line in lines:
        nodeid, spent, took = line.rstrip("\n").split("\t")
        name = nodeid.split("::", 1)[0]
        cpu[name] += float(spent)
        wall[name] += float(took)
        count[name] += 1
    return cpu, wall, count


def main(argv: list[str]) -> None:
    lines = Path(argv[0]).read_text().splitlines()
    cpu, wall, count = per_file(lines)
    top = int(argv[1]) if len(argv) > 1 else 40
    print(f"{sum(cpu.values()):.0f} s of CPU, {sum(wall.values()):.0f} s of test time, {len(lines)} tests")
    print(f"{'cpu s':>8} {'wall s':>8} {'tests':>5}  file")
    for name, spent in cpu.most_common(top):
        print(f"{spent:8.1f} {wall[name]:8.1f} {count[name]:5d}  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
