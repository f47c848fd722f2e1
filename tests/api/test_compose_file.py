"""docker-compose.yml: a valid Compose file (`docker compose config` where Docker Compose is installed, else the
Compose schema vendored in tests/schemas/compose-spec), which stops early with a pointer to the quickstart when no API
key is set, and whose quickstart (docs/deploy.md) makes a key that every profile accepts, monitoring included."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from switchboard.control.settings import ALL_SCOPES, Settings
from tests.waiting import WAIT_S

from .test_compose_cluster import interpolate, node_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "tests" / "schemas" / "compose-spec" / "compose-spec.json"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
QUICKSTART = "### Quickstart with auth on"
REQUIRED = re.compile(r"^\$\{(\w+):\?(.+)\}$")


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE_FILE.read_text()))


def schema_errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def shell_blocks(section: str) -> list[str]:
    """The ```sh blocks of one section of docs/deploy.md (from its heading to the next one)."""
    text = DEPLOY_DOC.read_text()
    start = text.index(section)
    end = text.find("\n#", start + len(section))
    return re.findall(r"```sh\n(.*?)```", text[start : end if end > 0 else None], re.S)


def exported(*blocks: str) -> dict[str, str]:
    """What the `export` lines of ``blocks`` leave in a shell: run by bash, from an empty environment."""
    exports = [line for block in blocks for line in block.splitlines() if line.startswith("export ")]
    done = subprocess.run(
        ["bash", "-c", "set -eu\n" + "\n".join(exports) + "\nenv -0"],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        check=True,
        timeout=WAIT_S,
    )
    pairs = (entry.split("=", 1) for entry in done.stdout.decode().split("\0") if "=" in entry)
    return {name: value for name, value in pairs if name.startswith("SWITCHBOARD_")}


def quickstart_environment() -> dict[str, str]:
    return exported(shell_blocks(QUICKSTART)[0])


def test_the_compose_file_follows_the_compose_schema():
    assert schema_errors(compose()) == []


def test_the_schema_check_finds_a_mistake():
    """The check can fail: a misspelt key and a wrong type are each reported."""
    broken = copy.deepcopy(compose())
    broken["services"]["switchboard"]["depends_on"]["migrate"]["condition"] = "service_finished"
    broken["services"]["db"]["volumes"] = "pgdata:/var/lib/postgresql/data"  # a list in Compose
    broken["services"]["grafana"]["port"] = ["127.0.0.1:3000:3000"]
    errors = schema_errors(broken)
    assert len(errors) == 3, errors


@pytest.mark.skipif(
    subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0
    if shutil.which("docker")
    else True,
    reason="Docker Compose is not installed; the schema test checks the file",
)
def test_docker_compose_reads_the_file_of_every_profile(tmp_path: Path):
    env = {**os.environ, **quickstart_environment(), "SWITCHBOARD_CLUSTER_SECRET": "c" * 40}
    env["SWITCHBOARD_TOKEN_SECRET"] = "t" * 40
    for profile in ("", "monitoring", "cluster"):
        command = ["docker", "compose", "-f", str(COMPOSE_FILE), *(["--profile", profile] if profile else [])]
        done = subprocess.run([*command, "config", "--quiet"], env=env, capture_output=True, timeout=WAIT_S)
        assert done.returncode == 0, (profile, done.stderr.decode())
    unset = {k: v for k, v in env.items() if k != "SWITCHBOARD_API_KEYS"}
    done = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE_FILE), "config", "--quiet"], env=unset, capture_output=True
    )
    assert done.returncode != 0 and "docs/deploy.md" in done.stderr.decode()


def test_without_api_keys_compose_stops_and_points_to_the_quickstart(monkeypatch: pytest.MonkeyPatch):
    """In a container the service listens on every interface, which needs API keys: compose refuses to start without
    them (``${VAR:?message}``), and the message says where the quickstart is."""
    service = compose()["services"]["switchboard"]
    required = REQUIRED.match(service["environment"]["SWITCHBOARD_API_KEYS"])
    assert required is not None and required.group(1) == "SWITCHBOARD_API_KEYS"
    message = required.group(2)
    assert "docs/deploy.md" in message and "Quickstart with auth on" in message and QUICKSTART in DEPLOY_DOC.read_text()
    assert not set("{}") & set(message)  # plain text: Compose counts braces inside the expression
    keyless = {"environment": {k: v for k, v in service["environment"].items() if k != "SWITCHBOARD_API_KEYS"}}
    with pytest.raises(ValueError, match=re.escape("refusing to bind '0.0.0.0' with authentication off")):
        node_settings(keyless, monkeypatch, {}).check_bind()


def test_the_quickstart_key_serves_every_route_and_the_monitoring_profile(monkeypatch: pytest.MonkeyPatch):
    given = quickstart_environment()
    key = given["SWITCHBOARD_KEY"]
    assert len(key) >= 32
    services = compose()["services"]
    settings = node_settings(services["switchboard"], monkeypatch, given)
    settings.check_bind()
    [api_key] = settings.api_keys
    assert api_key.key == key and set(api_key.scopes) == set(ALL_SCOPES)
    # Prometheus reads its key from the config the monitoring profile mounts: the quickstart's key, with metrics:read
    [mount] = services["prometheus"]["configs"]
    content = interpolate(compose()["configs"][mount["source"]]["content"], given)
    assert content == key and "metrics:read" in api_key.scopes
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert prometheus["scrape_configs"][0]["authorization"]["credentials_file"] == mount["target"]


def test_the_quickstart_key_starts_the_cluster_profile(monkeypatch: pytest.MonkeyPatch):
    given = exported(shell_blocks(QUICKSTART)[0], *shell_blocks("### The cluster profile"))
    settings: Settings = node_settings(compose()["services"]["node1"], monkeypatch, given)
    settings.check_bind()
    settings.check_cluster()
    assert settings.cluster_mode and settings.api_keys[0].key == given["SWITCHBOARD_KEY"]
