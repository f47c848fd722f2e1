"""The compose `cluster` profile: three nodes whose settings are valid cluster settings (the service's own ``Settings``
reads them), on the profile's PostgreSQL and Redis, each advertising an address the others and the load balancer
reach, behind an nginx that passes WebSocket upgrades through."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy.engine import make_url

from switchboard.control.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
NODES = ("node1", "node2", "node3")
VARIABLE = re.compile(r"\$\{(\w+)(?::?[-?][^}]*)?\}")
GIVEN = {
    "SWITCHBOARD_CLUSTER_SECRET": "s" * 40,
    "SWITCHBOARD_TOKEN_SECRET": "t" * 40,
    "SWITCHBOARD_API_KEYS": '[{"key":"change-me-0123456789","scopes":["sessions:read"]}]',
}


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def interpolate(value: str, given: dict[str, str]) -> str:
    """Compose's ``${VAR}``/``${VAR:-default}``/``${VAR:?error}`` with the variables an operator sets."""
    return VARIABLE.sub(lambda m: given.get(m.group(1), ""), value)


def node_settings(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch, given: dict[str, str]) -> Settings:
    dockerfile_env = dict(re.findall(r"(SWITCHBOARD_\w+)=(\S+)", (ROOT / "Dockerfile").read_text()))
    with monkeypatch.context() as env:
        for name in [n for n in os.environ if n.startswith("SWITCHBOARD_")]:
            env.delenv(name)
        for name, value in {**dockerfile_env, **service["environment"]}.items():
            env.setenv(name, interpolate(str(value), given))
        return Settings()


def test_the_cluster_profile_runs_three_nodes_with_valid_cluster_settings(monkeypatch: pytest.MonkeyPatch):
    services = compose()["services"]
    seen: set[str] = set()
    for name in NODES:
        service = services[name]
        assert service["profiles"] == ["cluster"]
        settings = node_settings(service, monkeypatch, GIVEN)
        settings.check_cluster()  # PostgreSQL, a secret: what a node on a non-loopback address needs
        assert settings.cluster_mode
        assert settings.node_id == name and settings.node_id not in seen
        seen.add(settings.node_id)
        assert settings.advertise_url == f"http://{name}:{settings.port}"
        assert settings.host == "0.0.0.0" and not settings.migrate_on_start and settings.auth_enabled
        database = make_url(settings.database_url)
        assert database.drivername == "postgresql+asyncpg" and database.host == "cluster-db"
        assert urlsplit(settings.redis_url or "").hostname == "redis"
        assert {"cluster-migrate", "redis"} <= set(service["depends_on"])
    # the profile's database and migration are its own: the single node (no profile) never shares them
    for name in ("cluster-db", "cluster-migrate", "redis", "lb"):
        assert services[name]["profiles"] == ["cluster"]
    migrate = services["cluster-migrate"]["environment"]["SWITCHBOARD_DATABASE_URL"]
    assert make_url(migrate).host == "cluster-db"
    assert set(services["lb"]["depends_on"]) == set(NODES)


def test_a_node_without_the_secret_does_not_start(monkeypatch: pytest.MonkeyPatch):
    """The secret is the operator's to set (the file names none): without it a node refuses its settings."""
    service = compose()["services"]["node1"]
    with pytest.raises(ValueError, match=r"cluster_secret|CLUSTER_SECRET"):
        node_settings(service, monkeypatch, {**GIVEN, "SWITCHBOARD_CLUSTER_SECRET": ""}).check_cluster()


def test_a_node_without_the_token_secret_does_not_start(monkeypatch: pytest.MonkeyPatch):
    """Every node checks the session tokens and report credentials any node minted: the profile passes the operator's
    SWITCHBOARD_TOKEN_SECRET to each of them, and without it a node refuses its settings."""
    services = compose()["services"]
    secrets = {node_settings(services[name], monkeypatch, GIVEN).token_secret for name in NODES}
    assert secrets == {GIVEN["SWITCHBOARD_TOKEN_SECRET"]}
    with pytest.raises(ValueError, match="SWITCHBOARD_TOKEN_SECRET"):
        node_settings(services["node1"], monkeypatch, {**GIVEN, "SWITCHBOARD_TOKEN_SECRET": ""}).check_cluster()


def test_the_load_balancer_reaches_every_node_and_passes_websockets_through():
    lb = compose()["services"]["lb"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in lb["volumes"]}
    conf = mounts["/etc/nginx/conf.d/default.conf"].read_text()
    upstream = re.search(r"upstream switchboard \{(.*?)\}", conf, re.S)
    assert upstream is not None
    assert re.findall(r"server (\w+):8080", upstream.group(1)) == list(NODES)
    assert "proxy_set_header Upgrade $http_upgrade;" in conf
    assert "proxy_set_header Connection $connection_upgrade;" in conf
    assert "proxy_http_version 1.1;" in conf
    assert re.search(r"proxy_read_timeout\s+\d+[hm];", conf)  # a quiet event stream is not cut after 60 s
