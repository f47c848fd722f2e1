"""In cluster mode a load balancer sends a client to any node: a session token or a webhook report credential minted
by one node must check on every other. Both are signed under the token secret, which is random per process when
unset, so cluster mode refuses to start without SWITCHBOARD_TOKEN_SECRET; two nodes configured alike then accept each
other's tokens and report credentials."""

from __future__ import annotations

import os

import pytest

from switchboard.api.auth import authenticate, issue_token
from switchboard.control.settings import Settings
from switchboard.integrations.webhooks import ReportCredentials

CLUSTER = {
    "SWITCHBOARD_DATABASE_URL": "postgresql+asyncpg://postgres@127.0.0.1:5432/test",
    "SWITCHBOARD_REDIS_URL": "redis://127.0.0.1:6379/0",
    "SWITCHBOARD_CLUSTER_SECRET": "c" * 40,
    "SWITCHBOARD_API_KEYS": '[{"key": "a-key-of-the-cluster-0123456789", "scopes": ["sessions:read"]}]',
}
TOKEN_SECRET = "the-cluster-token-secret-0123456789-0123"


def _node(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    """A node's settings, from the environment alone (as `switchboard serve` reads them)."""
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("SWITCHBOARD_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return Settings()


@pytest.mark.parametrize("value", [None, ""])
def test_cluster_mode_refuses_to_start_without_a_token_secret(monkeypatch: pytest.MonkeyPatch, value: str | None):
    env = dict(CLUSTER) if value is None else {**CLUSTER, "SWITCHBOARD_TOKEN_SECRET": value}
    with pytest.raises(ValueError, match=r"^cluster mode needs SWITCHBOARD_TOKEN_SECRET") as refused:
        _node(monkeypatch, env).check_cluster()
    assert "\n" not in str(refused.value)  # one line, as `switchboard serve` prints it
    _node(monkeypatch, {**CLUSTER, "SWITCHBOARD_TOKEN_SECRET": TOKEN_SECRET}).check_cluster()


def test_one_node_alone_still_needs_no_token_secret(monkeypatch: pytest.MonkeyPatch):
    alone = {k: v for k, v in CLUSTER.items() if k != "SWITCHBOARD_REDIS_URL"}
    _node(monkeypatch, alone).check_cluster()


def test_a_token_and_a_report_credential_minted_on_one_node_check_on_another(monkeypatch: pytest.MonkeyPatch):
    env = {**CLUSTER, "SWITCHBOARD_TOKEN_SECRET": TOKEN_SECRET}
    a, b = _node(monkeypatch, env), _node(monkeypatch, env)
    token, _ = issue_token(a, "s1")
    assert authenticate(b, token).session_id == "s1"
    credential = ReportCredentials(a.token_secret).issue("s1", "call-1")
    assert ReportCredentials(b.token_secret).check("s1", "call-1", credential)
    assert not ReportCredentials(b.token_secret).check("s1", "call-2", credential)
