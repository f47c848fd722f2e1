"""The README's first screen, followed literally on a clean checkout: `make run` (which installs the service into a
new `.venv`), then each command of "A first session" in a second shell, each checked against the output the README
shows under it.

What is not literal, and why: the service listens on a free port (`SWITCHBOARD_PORT`, and `SWITCHBOARD_URL` for the
commands) so that the suite's workers never meet on 8080, and Python writes each line as it goes
(`PYTHONUNBUFFERED`), as it does on a terminal, so that a command the reader stops with ^C can be read while it runs.

In the README's output, `…` stands for any text and a line of its own `…` for any number of lines; every other line
must come in that order, and directly after the one before it unless a `…` line stands between them (spaces are
compared as one).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port
from tests.waiting import WAIT_S, wait_until

from .server import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

INSTALL_S = 600.0  # bound: `make run` creates a virtual environment and installs the service from the package index
ANY = "…"


@dataclass
class Step:
    command: str
    expected: list[str] = field(default_factory=list)
    interrupted: bool = False  # the README stops it with ^C


def section(readme: str, heading: str) -> str:
    return readme.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def fenced(text: str, language: str) -> str:
    return text.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def steps_of(transcript: str) -> list[Step]:
    steps: list[Step] = []
    for line in transcript.splitlines():
        if line.startswith("$ "):
            steps.append(Step(line[2:]))
        elif line == "^C":
            steps[-1].interrupted = True
        elif line.strip():
            steps[-1].expected.append(line)
    return steps


def _squash(line: str) -> str:
    return " ".join(line.split())


def _pattern(line: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in _squash(line).split(ANY)))


class Matcher:
    """Feeds actual lines to the README's expected ones; ``done`` once every expected line was seen in order."""

    def __init__(self, expected: list[str]) -> None:
        self.expected = expected
        self.position = 0
        self.free = False  # a `…` line allows any lines before the next expected one
        self.mismatch: str | None = None

    @property
    def done(self) -> bool:
        while self.position < len(self.expected) and self.expected[self.position] == ANY:
            self.free = True
            self.position += 1
        return self.position == len(self.expected)

    def feed(self, line: str) -> None:
        if self.done or self.mismatch:
            return
        if _pattern(self.expected[self.position]).fullmatch(_squash(line)):
            self.position += 1
            self.free = False
        elif not self.free:
            self.mismatch = f"expected {self.expected[self.position]!r}, got {line!r}"


def run_to_end(step: Step, cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        ["bash", "-c", step.command], cwd=cwd, env=env, capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, f"{step.command}: {done.stderr}"
    matcher = Matcher(step.expected)
    for line in done.stdout.splitlines():
        matcher.feed(line)
    assert matcher.done and not matcher.mismatch, f"{step.command}: {matcher.mismatch}\n{done.stdout}"


def run_until_shown(step: Step, cwd: Path, env: dict[str, str]) -> None:
    """Run a command that goes on until stopped, and stop it (^C) once it has shown what the README shows."""
    proc = subprocess.Popen(["bash", "-c", f"exec {step.command}"], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True)
    matcher = Matcher(step.expected)
    seen: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line.rstrip("\n"))
            matcher.feed(seen[-1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: matcher.done or matcher.mismatch or proc.poll() is not None)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=WAIT_S)
        reader.join(timeout=WAIT_S)
    shown = "\n".join(seen)
    assert matcher.done and not matcher.mismatch, f"{step.command}: {matcher.mismatch}\n{shown}"


def clean_checkout(target: Path) -> None:
    """The repository's files as a clone has them (tracked and new, nothing ignored: no .venv, no var/)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_symlink() or source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name, follow_symlinks=False)  # a link stays a link, as git keeps it


def test_the_readme_first_screen_as_written(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    run_block = fenced(section(readme, "Run it"), "sh").splitlines()
    assert run_block[0].split("#")[0].strip() == "make run"
    steps = steps_of(fenced(section(readme, "A first session"), "console"))
    assert [s.command.split()[:2] for s in steps][:2] == [[".", ".venv/bin/activate"], ["switchboard", "create"]]

    checkout = tmp_path / "switchboard"
    clean_checkout(checkout)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHBOARD_", "VIRTUAL_ENV", "PYTHON"))}
    base["PATH"] = os.pathsep.join(p for p in base["PATH"].split(os.pathsep) if Path(sys.executable).parent != Path(p))
    base["PIP_COMPILE"] = "0"  # as in test_installs: byte-compiling all that pip installs is not what is checked
    base |= {"SWITCHBOARD_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "make-run.log").open("w")
    service = subprocess.Popen(
        ["make", "run"], cwd=checkout, env=base, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert service.poll() is None, (tmp_path / "make-run.log").read_text()
            try:
                return httpx.get(f"{url}/readyz", timeout=WAIT_S).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.5)
                return False

        wait_until(ready, timeout=INSTALL_S)
        shell = base | {"SWITCHBOARD_URL": url}
        for step in steps:
            if step.command == ". .venv/bin/activate":  # what sourcing it does to the commands after it
                shell |= {"VIRTUAL_ENV": str(checkout / ".venv")}
                shell["PATH"] = f"{checkout / '.venv' / 'bin'}{os.pathsep}{shell['PATH']}"
                assert not step.expected
            elif step.interrupted:
                run_until_shown(step, checkout, shell)
            else:
                run_to_end(step, checkout, shell)
        installed = subprocess.run(
            [str(checkout / ".venv" / "bin" / "python"), "-c", "import pytest"], capture_output=True
        )
        assert installed.returncode != 0, "`make run` installed the test toolchain"
    finally:
        os.killpg(service.pid, signal.SIGINT)
        try:
            service.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
        log.close()


def test_the_matcher_holds_the_output_to_what_the_readme_shows() -> None:
    """The checker itself: order, adjacency, wildcards."""
    expected = ["a …", ANY, "c", "d"]
    for lines, ok in (
        (["a 1", "b", "c", "d"], True),
        (["a 1", "c", "d"], True),
        (["a 1", "c", "x", "d"], False),  # d must follow c directly
        (["b", "a 1", "c", "d"], False),  # the first line must be a
        (["a 1", "d", "c"], False),
    ):
        matcher = Matcher(expected)
        for line in lines:
            matcher.feed(line)
        assert (matcher.done and not matcher.mismatch) is ok, lines
