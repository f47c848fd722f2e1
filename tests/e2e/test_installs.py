"""The two installs the README names, each in a clean virtual environment: `pip install <switchboard>` is the client
(httpx, websockets and pydantic, nothing of the server), and `pip install "<switchboard>[server]"` serves an agent
module of the user's own project, with the README's example agent as written."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port
from tests.waiting import WAIT_S, wait_until

from .server import ROOT
from .test_first_screen import clean_checkout, fenced, section

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

INSTALL_S = 600.0  # bound: pip resolves and installs from the package index
SERVER_ONLY = ("fastapi", "sqlalchemy", "uvicorn", "openai", "alembic", "redis", "opentelemetry", "pydantic_settings")


def new_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(where)
    return where / "bin"


def pip_install(bin_dir: Path, requirement: str) -> None:
    done = subprocess.run(
        # --no-compile: what is imported is compiled when it is; compiling every file of every package first
        # doubled the install's time and CPU (beside the suite's other workers), and is not what these tests check
        [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-compile", requirement],
        capture_output=True,
        text=True,
        timeout=INSTALL_S,
    )
    assert done.returncode == 0, done.stderr


def clean_env(bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHBOARD_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("source") / "switchboard"
    clean_checkout(where)
    return where


def test_the_client_install_has_nothing_of_the_server(source: Path, tmp_path: Path) -> None:
    bin_dir = new_venv(tmp_path / "venv")
    pip_install(bin_dir, str(source))
    probe = (
        "import importlib.util, sys\n"
        "import switchboard.client\n"
        f"print(','.join(m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m)))\n"
    )
    done = subprocess.run([str(bin_dir / "python"), "-c", probe], capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"installed with the client: {done.stdout}"

    env = clean_env(bin_dir)
    port = free_port()  # nothing listens there
    listed = subprocess.run(
        ["switchboard", "--url", f"http://127.0.0.1:{port}", "sessions"],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert listed.returncode != 0
    assert "Traceback" not in listed.stderr and "No module named" not in listed.stderr, listed.stderr
    serve = subprocess.run(["switchboard", "serve"], env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert serve.returncode == 2
    assert serve.stderr.strip() == 'switchboard: the server is not installed: pip install "switchboard[server]"'


def test_the_server_install_serves_an_agent_of_the_users_project(source: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    own = section(readme, "Your own agent")
    module = fenced(own, "python")
    commands = [line.split("#")[0].strip() for line in fenced(own, "sh").splitlines()]
    assert commands[0] == 'pip install "/path/to/switchboard[server]"'
    assert commands[1] == "SWITCHBOARD_AGENTS=myagents:AGENTS switchboard serve"

    bin_dir = new_venv(tmp_path / "venv")
    pip_install(bin_dir, f"{source}[server]")
    project = tmp_path / "project"
    project.mkdir()
    (project / "myagents.py").write_text(module)
    port = free_port()
    env = clean_env(bin_dir) | {"SWITCHBOARD_AGENTS": "myagents:AGENTS", "SWITCHBOARD_PORT": str(port)}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(["switchboard", "serve"], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"

        def agents() -> dict[str, list[str]] | None:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                listed = httpx.get(f"{url}/v1/agents", timeout=WAIT_S).json()["items"]
            except httpx.HTTPError:
                return None
            return {a["name"]: [t["name"] for t in a["tools"]] for a in listed}

        assert wait_until(agents)["concierge"] == ["search_tables"]
        created = httpx.post(f"{url}/v1/sessions", json={"agent": "concierge"}, timeout=WAIT_S)
        assert created.status_code == 201, created.text
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT_S)
        log.close()
