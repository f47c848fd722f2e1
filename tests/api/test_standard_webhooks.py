"""Webhook tools signed per Standard Webhooks, verified by real backends on loopback with the ``standardwebhooks``
library, as a backend would: the headers, the message id a backend dedupes on, and the ``signature`` option that lets
a backend move over from the earlier ``X-Switchboard-Signature``."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from standardwebhooks import Webhook, WebhookVerificationError

from switchboard.api.app import create_app
from switchboard.integrations.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER
from switchboard.integrations.webhooks import verify_signature
from switchboard.runtime.agent import AgentRegistry
from tests.agents_fixture import AGENTS as TEST_AGENTS
from tests.webhook_backend import Check, FakeBackend

from .conftest import make_settings
from .test_sessions_api import until

STANDARD_ENV = "SB_TEST_STANDARD_SECRET"
STANDARD_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
PLAIN_ENV = "SB_TEST_PLAIN_SECRET"
PLAIN_SECRET = "plain-secret-0123456789abcdefghijklmn"
ORDER = {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}
STANDARD_HEADERS = {"webhook-id", "webhook-timestamp", "webhook-signature"}
EARLIER_HEADERS = {TIMESTAMP_HEADER.lower(), SIGNATURE_HEADER.lower()}


def signed_with(secret: str) -> Check:
    """What a backend checks: the library verifies the Standard Webhooks headers (a ``whsec_`` secret as it is, any
    other as its UTF-8 bytes), ``verify_signature`` the earlier ones. Each set sent must hold, and one must be sent."""
    standard = Webhook(secret if secret.startswith("whsec_") else secret.encode())

    def check(body: bytes, headers: Mapping[str, str]) -> bool:
        sent = 0
        if "webhook-signature" in headers:
            try:
                standard.verify(body, dict(headers))
            except WebhookVerificationError:
                return False
            sent += 1
        if SIGNATURE_HEADER in headers:
            if not verify_signature(secret, headers.get(TIMESTAMP_HEADER), body, headers[SIGNATURE_HEADER]):
                return False
            sent += 1
        return sent > 0

    return check


def signatures(headers: Mapping[str, str]) -> set[str]:
    """The signature headers of a request (lower case)."""
    return set(headers) & (STANDARD_HEADERS | EARLIER_HEADERS)


class Hooks:
    def __init__(self, client: httpx.AsyncClient, standard: FakeBackend, plain: FakeBackend) -> None:
        self.client = client
        self.standard = standard  # the backend of the tools whose secret is a whsec_ one
        self.plain = plain  # the backend of the tools whose secret is not

    async def session(self, *turns: dict[str, Any]) -> str:
        body = {"agent": "hooks", "llm": {"provider": "scripted", "turns": list(turns)}}
        r = await self.client.post("/v1/sessions", json=body)
        assert r.status_code == 201, r.text
        sid = str(r.json()["id"])
        r = await self.client.post(f"/v1/sessions/{sid}/input", json={"text": "go"})
        assert r.status_code == 202, r.text
        return sid

    async def call(self, sid: str, name: str, status: str) -> dict[str, Any]:
        async def find() -> dict[str, Any] | None:
            items = (await self.client.get(f"/v1/sessions/{sid}/tool-calls")).json()["items"]
            found = [c for c in items if c["name"] == name and c["status"] == status]
            return dict(found[-1]) if found else None

        return dict(await until(find))


def agents_file(tmp_path: Path, standard: FakeBackend, plain: FakeBackend) -> Path:
    def hook(name: str, backend: FakeBackend, secret_env: str, **kw: Any) -> dict[str, Any]:
        spec = {
            "kind": "webhook",
            "name": name,
            "parameters": ORDER,
            "url": backend.url(f"/tools/{name}"),
            "timeout_s": 10,
            "secret_env": secret_env,
        }
        return {**spec, **kw}

    agents = [
        {
            "name": "hooks",
            "instructions": "You use webhook tools.",
            "tools": [
                hook("lookup", standard, STANDARD_ENV),
                hook("refund", standard, STANDARD_ENV, allow_cancellation=True),
                hook("legacy", plain, PLAIN_ENV, signature="switchboard"),
                hook("moving", plain, PLAIN_ENV),  # the default for a secret that is not whsec_: both
                hook("moved", plain, PLAIN_ENV, signature="standard"),
            ],
        }
    ]
    path = tmp_path / "agents.yaml"
    path.write_text(yaml.safe_dump(agents))
    return path


@pytest.fixture
async def hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Hooks]:
    monkeypatch.setenv(STANDARD_ENV, STANDARD_SECRET)
    monkeypatch.setenv(PLAIN_ENV, PLAIN_SECRET)
    async with (
        FakeBackend(STANDARD_SECRET, signed_with(STANDARD_SECRET)) as standard,
        FakeBackend(PLAIN_SECRET, signed_with(PLAIN_SECRET)) as plain,
    ):
        settings = make_settings(tmp_path, agents_file=agents_file(tmp_path, standard, plain))
        app = create_app(settings, registry=AgentRegistry(TEST_AGENTS))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                yield Hooks(client, standard, plain)


def call_turn(*names: str) -> dict[str, Any]:
    return {"text": "On it.", "tool_calls": [{"name": n, "arguments": {"order_id": "A-1"}} for n in names]}


async def test_a_delivery_and_its_cancel_notice_verify_with_the_standard_webhooks_library(hooks: Hooks):
    hooks.standard.answers["refund"] = [(202, None)]
    sid = await hooks.session(call_turn("refund"))
    call_id = (await hooks.standard.next("call"))["call_id"]
    r = await hooks.client.post(f"/v1/sessions/{sid}/tool-calls/{call_id}/cancel")
    assert r.status_code == 200, r.text
    notice = await hooks.standard.next("cancel")
    assert notice["call_id"] == call_id and notice["reason"] == "cancelled by an operator"
    # both reached the backend only as the library verified them (anything else is answered 401 and counted)
    assert hooks.standard.bad_signatures == 0
    (delivery,), (cancel,) = hooks.standard.call_headers, hooks.standard.cancel_headers
    # a whsec_ secret: the standard headers alone; a message id per message, which a backend dedupes on
    assert signatures(delivery) == signatures(cancel) == STANDARD_HEADERS
    assert (delivery["webhook-id"], cancel["webhook-id"]) == (f"msg_{call_id}", f"msg_{call_id}_cancel")


async def test_a_retried_delivery_keeps_its_message_id(hooks: Hooks):
    hooks.standard.answers["lookup"] = [(503, None), (200, {"output": "A-1 shipped"})]
    sid = await hooks.session(call_turn("lookup"))
    call = await hooks.call(sid, "lookup", "completed")
    assert call["output"] == "A-1 shipped"
    assert hooks.standard.bad_signatures == 0
    first, retried = hooks.standard.attempt_headers  # each one verified by the library
    assert first["webhook-id"] == retried["webhook-id"] == f"msg_{call['call_id']}"


async def test_the_signature_option_picks_the_headers_a_backend_gets(hooks: Hooks):
    """``switchboard``: the earlier headers alone (as before); ``both``: both sets, so a backend can switch its
    verifier first; ``standard``: the standard ones alone, keyed with a plain secret's UTF-8 bytes."""
    sid = await hooks.session(call_turn("legacy", "moving", "moved"))
    for name in ("legacy", "moving", "moved"):
        await hooks.call(sid, name, "completed")
    assert hooks.plain.bad_signatures == 0
    got = {
        call["tool"]: signatures(headers)
        for call, headers in zip(hooks.plain.calls, hooks.plain.call_headers, strict=True)
    }
    assert got == {
        "legacy": EARLIER_HEADERS,
        "moving": STANDARD_HEADERS | EARLIER_HEADERS,
        "moved": STANDARD_HEADERS,
    }
    both = hooks.plain.call_headers[[c["tool"] for c in hooks.plain.calls].index("moving")]
    assert both["webhook-timestamp"] == both[TIMESTAMP_HEADER.lower()]
