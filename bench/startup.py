"""What a server costs before it serves: `switchboard serve` on a new SQLite database (migrated at start), from the
process's start until `/readyz` answers 200, in CPU seconds of the server process and in wall seconds. A restarted
node, a rolling deploy's new process and every test that starts a real server pay it.

    .venv/bin/python bench/startup.py --runs 8                          # this checkout
    .venv/bin/python bench/startup.py --runs 8 --source OTHER_CHECKOUT  # and another one's code, alternately

``--source DIR`` runs DIR/service's code (e.g. a worktree of the commit before a change) with this environment's
packages, one start of each in turn, so both see the same machine. CPU time is read from ``/proc`` when `/readyz`
first answers: on a shared machine it moves far less than the wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
READY_WITHIN_S = 120.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def start_once(source: Path) -> tuple[float, float]:
    """(CPU s, wall s) of one server start from ``source``'s code until `/readyz` answers."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "PYTHONPATH": f"{source / 'service'}{os.pathsep}{ROOT}",
            "SWITCHBOARD_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/start.db",
            "SWITCHBOARD_LOG_LEVEL": "WARNING",
        }
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "switchboard.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server from {source} exited with {proc.returncode}")
                if time.monotonic() - started > READY_WITHIN_S:
                    raise RuntimeError(f"the server from {source} was not ready in {READY_WITHIN_S:g} s")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as answer:
                        if answer.status == 200:
                            return _cpu_s(proc.pid), time.monotonic() - started
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                time.sleep(0.02)
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--source", type=Path, help="another checkout, run alternately with this one")
    args = parser.parse_args()
    sources = {"this": ROOT} | ({"other": args.source.resolve()} if args.source else {})
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in sources}
    for run in range(args.runs):
        for name, source in sources.items():
            cpu, wall = start_once(source)
            seen[name].append((cpu, wall))
            print(f"run {run + 1} {name}: {cpu:.2f} s CPU, {wall:.2f} s wall", flush=True)
    for name, runs in seen.items():
        cpus, walls = [c for c, _ in runs], [w for _, w in runs]
        print(
            f"{name} ({sources[name]}): CPU median {statistics.median(cpus):.2f} s (min {min(cpus):.2f}), "
            f"wall median {statistics.median(walls):.2f} s, {len(runs)} starts"
        )


if __name__ == "__main__":
    main()
