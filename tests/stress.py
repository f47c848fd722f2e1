"""Run a chosen part of the suite (default: all of it) many times, optionally on a loaded machine, and say which tests
failed in which runs: a way to see a flaky test before CI does.

    python -m tests.stress --runs 5 --hog 2 tests/api/test_tool_call_pages.py tests/e2e/test_cluster_wide.py

Each run is a fresh ``pytest -q -n WORKERS --dist loadfile`` (as ``make test``) writing a JUnit report of its own; the
hog is ``--hog`` busy-looping processes at normal priority, so the tests compete with them for the cores the way they
do on a busy CI machine. Exit status 0 when every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.waiting import WAIT_S


@dataclass
class RunResult:
    number: int
    exit_code: int
    seconds: float
    passed: int = 0
    failed: list[str] = field(default_factory=list)  # node ids of the tests that failed or errored
    skipped: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.failed


def _spin() -> None:  # pragma: no cover - runs in the hog processes
    while True:
        pass


@contextmanager
def cpu_hog(processes: int) -> Iterator[list[int]]:
    """``processes`` busy loops beside the tests for as long as the block runs; their pids."""
    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=_spin, daemon=True, name=f"hog-{i}") for i in range(processes)]
    for hog in hogs:
        hog.start()
    try:
        yield [hog.pid for hog in hogs if hog.pid is not None]
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join(WAIT_S)


def _node_id(case: ET.Element) -> str:
    """``tests/api/test_x.py::test_y[param]`` from a JUnit test case (its classname is the dotted module path)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    # a test in a class: the module is the dotted prefix whose file exists
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if path.exists():
            return "::".join([str(path), *parts[cut:], name])
    return f"{classname}::{name}"


def read_report(path: Path) -> tuple[int, list[str], int]:
    """(passed, failed node ids, skipped) from a JUnit XML report; a run that wrote none counts as nothing."""
    if not path.exists():
        return 0, [], 0
    passed, failed, skipped = 0, [], 0
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            failed.append(_node_id(case))
        elif "skipped" in tags:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def pytest_command(selection: Sequence[str], workers: int, report: Path, extra: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    if workers > 0:
        cmd += ["-n", str(workers), "--dist", "loadfile"]
    return [*cmd, *extra, *selection]


def run_once(number: int, cmd: list[str], report: Path, log: Path) -> RunResult:
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    passed, failed, skipped = read_report(report)
    if code != 0 and not failed:  # it failed before or outside a test (collection, a crash, an interrupt)
        failed = [f"(run ended with exit status {code}; see {log})"]
    return RunResult(number, code, time.monotonic() - started, passed, failed, skipped)


def summary(results: Sequence[RunResult]) -> list[str]:
    good = sum(r.ok for r in results)
    lines = [f"{good} of {len(results)} runs passed"]
    streak = 0
    for r in results:
        streak = streak + 1 if r.ok else 0
    lines.append(f"consecutive passing runs at the end: {streak}")
    counts = Counter(test for r in results for test in r.failed)
    if counts:
        lines.append("failed tests (runs that failed it):")
        lines += [f"  {n:3d}  {test}" for test, n in counts.most_common()]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("selection", nargs="*", help="pytest selection (files, node ids); default: the whole suite")
    parser.add_argument("--runs", type=int, default=5, help="how many runs (default 5)")
    parser.add_argument("--hog", type=int, default=0, help="busy-looping processes beside the tests (default 0)")
    parser.add_argument("--workers", type=int, default=3, help="pytest-xdist workers, 0 for one process (default 3)")
    parser.add_argument("--keep-going", action="store_true", help="run all the runs even after one failed")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--logs", type=Path, help="where the run logs go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.hog < 0 or args.workers < 0:
        parser.error("--runs must be at least 1; --hog and --workers at least 0")

    logs = args.logs or Path(tempfile.mkdtemp(prefix="switchboard-stress-"))
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["-k", args.keyword] if args.keyword else []
    what = " ".join(args.selection) or "the whole suite"
    print(f"{args.runs} runs of {what}; {args.workers} workers, {args.hog} hog processes; logs in {logs}", flush=True)
    results: list[RunResult] = []
    with cpu_hog(args.hog):
        for number in range(1, args.runs + 1):
            report, log = logs / f"run-{number}.xml", logs / f"run-{number}.log"
            result = run_once(number, pytest_command(args.selection, args.workers, report, extra), report, log)
            results.append(result)
            verdict = "passed" if result.ok else "FAILED"
            counts = f"{result.passed} passed, {len(result.failed)} failed, {result.skipped} skipped"
            print(f"run {number}/{args.runs}: {verdict} ({counts}) in {result.seconds:.0f} s", flush=True)
            for test in result.failed:
                print(f"    {test}", flush=True)
            if not result.ok and not args.keep_going:
                break
    for line in summary(results):
        print(line)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
