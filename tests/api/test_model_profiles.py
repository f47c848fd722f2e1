"""Model endpoints and credentials come from the server's configuration only.

The attack: a caller with ``sessions:write`` creates a session whose ``llm`` points ``base_url`` at a listener of its
own and names any environment variable in ``api_key_env``; the first reply then sends that variable's value (the token
secret, a webhook secret, every API key) as a bearer token to the listener. Each test below puts a real listener on
loopback and checks that nothing reaches it unless the server's own profile sends it there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchboard.api.app import create_app
from switchboard.runtime.agent import AgentRegistry
from switchboard.store import SessionRecord
from tests.unit.fake_openai import FakeOpenAI

from .conftest import make_settings
from .test_sessions_api import assert_problem, until

SECRET_ENV = "SWITCHBOARD_TEST_LEAK_SECRET"
SECRET = "do-not-send-this-secret-anywhere"
MODEL_KEY_ENV = "SWITCHBOARD_TEST_PROFILE_KEY"
MODEL_KEY = "profile-key-for-the-real-model"


@pytest.fixture
async def listener(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeOpenAI]:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(MODEL_KEY_ENV, MODEL_KEY)
    server = await FakeOpenAI().start()
    try:
        yield server
    finally:
        await server.aclose()


async def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize(
    "llm",
    [
        {"provider": "openai", "model": "m", "base_url": "{url}", "api_key_env": SECRET_ENV},
        {"provider": "openai", "model": "m", "base_url": "{url}"},
        {"provider": "openai", "model": "m", "api_key_env": SECRET_ENV},
        {"profile": "fast", "base_url": "{url}"},
        {"profile": "fast", "api_key_env": SECRET_ENV},
        {"profile": "fast", "model": "other", "timeout_s": 600},
        {"provider": ["openai"], "model": "m", "base_url": "{url}", "api_key_env": SECRET_ENV},
        {"provider": {"name": "openai"}, "model": "m", "base_url": "{url}"},
    ],
    ids=[
        "url-and-variable",
        "url",
        "variable",
        "profile-plus-url",
        "profile-plus-variable",
        "profile-plus-limits",
        "provider-as-a-list",
        "provider-as-an-object",
    ],
)
async def test_a_session_cannot_aim_the_model_at_its_own_url_or_variable(
    tmp_path: Path, registry: AgentRegistry, listener: FakeOpenAI, llm: dict[str, Any]
) -> None:
    llm = {k: v.format(url=listener.base_url) if isinstance(v, str) else v for k, v in llm.items()}
    profiles = {"fast": {"provider": "openai", "model": "fake-model", "base_url": listener.base_url}}
    app = create_app(make_settings(tmp_path, models=profiles), registry=registry)
    async with app.router.lifespan_context(app), await _client(app) as client:
        r = await client.post("/v1/sessions", json={"id": "evil", "agent": "tester", "llm": llm})
        if r.status_code == 201:  # the attack succeeds: show what reached the listener
            await client.post("/v1/sessions/evil/input", json={"text": "hello"})
            await until(lambda: listener.requests)
            pytest.fail(f"the model request went to the caller's URL with {listener.requests[0].headers!r}")
        problem = assert_problem(r, 422, "invalid_session_config")
        assert SECRET not in r.text and "server" in problem["detail"]
        # the session does not exist, so nothing can make it talk to the listener
        r = await client.post("/v1/sessions/evil/input", json={"text": "hello"})
        assert r.status_code == 404
    assert listener.requests == []


async def test_a_profile_reaches_its_own_server_with_its_own_key(
    tmp_path: Path, registry: AgentRegistry, listener: FakeOpenAI
) -> None:
    profiles = {
        "fast": {
            "provider": "openai",
            "model": "fake-model",
            "base_url": listener.base_url,
            "api_key_env": MODEL_KEY_ENV,
        }
    }
    app = create_app(make_settings(tmp_path, models=profiles), registry=registry)
    async with app.router.lifespan_context(app), await _client(app) as client:
        r = await client.post(
            "/v1/sessions", json={"id": "ok", "agent": "tester", "llm": {"profile": "fast", "temperature": 0.25}}
        )
        assert r.status_code == 201, r.text
        assert (await client.post("/v1/sessions/ok/input", json={"text": "hello"})).status_code == 202
        await until(lambda: listener.requests)
    request = listener.requests[0]
    assert request.headers["authorization"] == f"Bearer {MODEL_KEY}"
    assert request.body["model"] == "fake-model" and request.body["temperature"] == 0.25


async def test_an_unknown_profile_is_refused_naming_the_available_ones(
    tmp_path: Path, registry: AgentRegistry, listener: FakeOpenAI
) -> None:
    profiles = {"fast": {"provider": "openai", "model": "fake-model", "base_url": listener.base_url}}
    app = create_app(make_settings(tmp_path, models=profiles), registry=registry)
    async with app.router.lifespan_context(app), await _client(app) as client:
        r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"profile": "slow"}})
        problem = assert_problem(r, 422, "invalid_session_config")
        assert "'slow'" in problem["detail"] and "fast" in problem["detail"]
        assert listener.base_url not in r.text  # profile names are shown, never their endpoints or secrets


async def test_a_stored_session_that_names_an_endpoint_fails_on_recovery_instead_of_calling_it(
    tmp_path: Path, registry: AgentRegistry, listener: FakeOpenAI
) -> None:
    """A session created before profiles existed keeps its config in the store: recovery must not honour it."""
    evil = {"provider": "openai", "model": "m", "base_url": listener.base_url, "api_key_env": SECRET_ENV}
    settings = make_settings(tmp_path)
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app):
        rec = SessionRecord(id="old", agent="tester", state="active", config={"agent": "tester", "llm": evil})
        await app.state.services.store.create_session(rec)
    app = create_app(settings, registry=registry)
    async with app.router.lifespan_context(app), await _client(app) as client:
        body = (await client.get("/v1/sessions/old")).json()
        assert body["state"] == "failed"
        r = await client.post("/v1/sessions/old/input", json={"text": "hello"})
        assert r.status_code == 409
    assert listener.requests == []


def test_profiles_and_agent_defaults_are_checked_at_startup(tmp_path: Path, registry: AgentRegistry) -> None:
    with pytest.raises(ValueError, match="model profile 'bad'"):
        create_app(make_settings(tmp_path, models={"bad": {"provider": "openai"}}), registry=registry)
    agents = tmp_path / "agents.yaml"
    agents.write_text("- name: desk\n  instructions: Help.\n  llm: {profile: missing}\n")
    with pytest.raises(ValueError, match="agent 'desk': llm: unknown model profile 'missing'"):
        create_app(make_settings(tmp_path, agents_file=agents), registry=registry)


@pytest.mark.parametrize(
    "profile",
    [
        {"provider": "openai", "model": "gpt-4o-mini", "api_key_env": "SWITCHBOARD_TEST_UNSET_KEY"},
        {
            "provider": "openai",
            "model": "m",
            "base_url": "http://127.0.0.1:9/v1",
            "api_key_env": "SWITCHBOARD_TEST_UNSET_KEY",
        },
    ],
    ids=["openai", "server-naming-a-variable"],
)
async def test_a_profile_whose_key_is_not_set_is_refused_naming_the_variable(
    tmp_path: Path,
    registry: AgentRegistry,
    profile: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("SWITCHBOARD_TEST_UNSET_KEY", raising=False)
    models = {"cloud": profile, "local": {"provider": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1"}}
    app = create_app(make_settings(tmp_path, models=models), registry=registry)  # the service still starts
    assert "model profile 'cloud' cannot be used" in caplog.text and "SWITCHBOARD_TEST_UNSET_KEY" in caplog.text
    async with app.router.lifespan_context(app), await _client(app) as client:
        r = await client.post("/v1/sessions", json={"id": "s", "agent": "tester", "llm": {"profile": "cloud"}})
        problem = assert_problem(r, 422, "model_not_configured")
        assert "SWITCHBOARD_TEST_UNSET_KEY" in problem["detail"] and "not set" in problem["detail"]
        assert (await client.get("/v1/sessions/s")).status_code == 404
        # a local server needs no key: that profile works without one
        r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"profile": "local"}})
        assert r.status_code == 201, r.text
        monkeypatch.setenv("SWITCHBOARD_TEST_UNSET_KEY", "sk-test-value-0123456789")
        r = await client.post("/v1/sessions", json={"agent": "tester", "llm": {"profile": "cloud"}})
        assert r.status_code == 201 and "sk-test-value" not in r.text
