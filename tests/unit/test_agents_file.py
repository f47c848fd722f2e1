"""Declared agents: the agents file, JSON Schema arguments (validated like Python tools) and webhook signatures."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import ValidationError

from switchboard import function_tool
from switchboard.api.app import create_app
from switchboard.cli.main import main
from switchboard.control.settings import Settings
from switchboard.integrations.agents_file import AgentsFileError, load_agents_file, read_agents_file
from switchboard.integrations.demo import AGENTS as DEMO_AGENTS
from switchboard.integrations.signing import sign, signed_headers
from switchboard.integrations.webhooks import Webhooks, WebhookTool, verify_signature
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.tools import CONFIRM_FIELD, ToolPolicy, format_validation_error

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agents.yaml"
ENV = {
    "HOOK_SECRET": "hook-secret-0123456789abcdefghijklmn",
    "ORDERS_WEBHOOK_SECRET": "example-secret-0123456789abcdefghijk",
    "SHORT_SECRET": "abc",
}


def tool(**overrides: Any) -> dict[str, Any]:
    spec = {
        "kind": "webhook",
        "name": "search",
        "description": "Search.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "url": "http://127.0.0.1:9/tools/search",
        "secret_env": "HOOK_SECRET",
    }
    return {**spec, **overrides}


def with_city(overrides: dict[str, Any]) -> dict[str, Any]:
    """The default tool's parameters, its ``city`` property changed (a key set to None is removed)."""
    city = {k: v for k, v in ({"type": "string"} | overrides).items() if v is not None}
    return {"type": "object", "properties": {"city": city}, "required": ["city"]}


def write(tmp_path: Path, data: Any, name: str = "agents.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def load_error(tmp_path: Path, data: Any, name: str = "agents.yaml", env: dict[str, str] = ENV) -> str:
    path = write(tmp_path, data, name)
    with pytest.raises(AgentsFileError) as err:
        read_agents_file(path, environ=env)
    text = str(err.value)
    assert text.startswith(f"{path}: "), text
    return text


def webhook(tmp_path: Path, **overrides: Any) -> WebhookTool:
    path = write(tmp_path, [{"name": "a", "instructions": "x", "tools": [tool(**overrides)]}])
    agent = load_agents_file(path, Webhooks(), environ=ENV).factories["a"]()
    found = agent.tools[overrides.get("name", "search")]
    assert isinstance(found, WebhookTool)
    return found


# -- the file -----------------------------------------------------------------------------------------------------


def test_the_example_file_loads(tmp_path: Path):
    declared = load_agents_file(EXAMPLE, Webhooks(), environ=ENV)
    assert list(declared.factories) == ["orders"]
    assert declared.default_llms["orders"]["provider"] == "openai"
    registry = AgentRegistry(DEMO_AGENTS)
    declared.register(registry)
    agent = registry.create("orders")
    assert agent.name == "orders" and "order desk" in agent.instructions
    assert getattr(agent, "greeting", "").startswith("Hello, this is the order desk.")
    lookup, refund = agent.tools["lookup_order"], agent.tools["refund_order"]
    assert isinstance(lookup, WebhookTool) and isinstance(refund, WebhookTool)
    assert type(lookup.policy) is ToolPolicy  # the policy alone, not the whole spec
    assert (lookup.policy.on_duplicate, lookup.policy.duplicate_scope, lookup.policy.allow_cancellation) == (
        "reject",
        "name_and_args",
        False,
    )
    assert refund.policy.allow_cancellation and refund.endpoint.cancel_url.endswith("/tools/refund_order/cancel")
    assert lookup.endpoint.cancel_url == "http://127.0.0.1:9000/tools/lookup_order/cancel"
    assert (
        lookup.endpoint.secret == "example-secret-0123456789abcdefghijk"
        and "example-secret-0123456789abcdefghijk" not in repr(lookup.endpoint)
    )
    # what the model is shown: the declared schema, plus the confirmation flag of on_duplicate="confirm"
    assert lookup.schema()["parameters"]["required"] == ["order_id"]
    assert refund.parameters["properties"][CONFIRM_FIELD]["type"] == "boolean"
    assert refund.parse_arguments({"order_id": "A-1", "amount": "12.5", "reason": "late"}) == {
        "order_id": "A-1",
        "amount": 12.5,
        "reason": "late",
        CONFIRM_FIELD: False,
    }


def test_a_declared_webhook_tool_resumes_its_calls_unless_it_says_otherwise(tmp_path: Path):
    assert webhook(tmp_path).policy.on_restart == "resume"  # its calls go on where their session runs next
    assert webhook(tmp_path, on_restart="fail").policy.on_restart == "fail"
    assert webhook(tmp_path, on_restart="retry").policy.on_restart == "retry"


def test_the_docs_show_the_example_file_as_it_is():
    page = (EXAMPLE.parents[1] / "docs" / "agents-file.md").read_text()
    assert f"```yaml\n{EXAMPLE.read_text()}```" in page


def test_list_mapping_and_json_forms(tmp_path: Path):
    as_list = read_agents_file(write(tmp_path, [{"name": "a", "instructions": "x", "tools": [tool()]}]), environ=ENV)
    as_map = read_agents_file(write(tmp_path, "a:\n  instructions: x\n", "map.yaml"), environ=ENV)
    as_json = read_agents_file(write(tmp_path, {"a": {"instructions": "x"}}, "agents.json"), environ=ENV)
    assert [a.name for a in as_list] == [a.name for a in as_map] == [a.name for a in as_json] == ["a"]
    assert as_list[0].tools[0].timeout_s == 30.0


@pytest.mark.parametrize(
    ("agents", "location", "message"),
    [
        ([{"name": "a", "instructions": "x", "tools": [tool(url="not a url")]}], "agents[0].tools[0].url", "URL"),
        ([{"name": "a", "instructions": "x", "tools": [tool(kind="grpc")]}], "agents[0].tools[0].kind", "'webhook'"),
        (
            [{"name": "a", "instructions": "x", "tools": [tool(timeout_s=0)]}],
            "agents[0].tools[0].timeout_s",
            "greater than 0",
        ),
        ([{"name": "a", "instructions": "x", "tools": [tool(bogus=1)]}], "agents[0].tools[0].bogus", "not permitted"),
        (
            [{"name": "a", "instructions": "x", "tools": [tool(secret_env="NOT_SET_ANYWHERE")]}],
            "agents[0].tools[0].secret_env",
            "environment variable NOT_SET_ANYWHERE is not set",
        ),
        (
            [{"name": "a", "instructions": "x", "tools": [tool(parameters={"type": "object", "oneOf": []})]}],
            "agents[0].tools[0].parameters",
            "unsupported keyword(s): oneOf",
        ),
        (
            [
                {
                    "name": "a",
                    "instructions": "x",
                    "tools": [tool(parameters={"type": "object", "properties": {"n": {"type": "int"}}})],
                }
            ],
            "agents[0].tools[0].parameters",
            "properties.n.type: unknown type 'int'",
        ),
        (
            [{"name": "a", "instructions": "x", "tools": [tool(secret_env="SHORT_SECRET")]}],
            "agents[0].tools[0].secret_env",
            "environment variable SHORT_SECRET holds a webhook signing secret of 3 characters; at least 32",
        ),
        (
            [{"name": "a", "instructions": "x", "tools": [tool(parameters=with_city({"format": "hostname"}))]}],
            "agents[0].tools[0].parameters",
            "properties.city.format: unsupported format 'hostname' (supported on strings: email, uri, date, date-time",
        ),
        (
            [
                {
                    "name": "a",
                    "instructions": "x",
                    "tools": [tool(parameters=with_city({"type": "integer", "format": "int32"}))],
                }
            ],
            "agents[0].tools[0].parameters",
            "properties.city.format: only strings have a format here",
        ),
        (
            [
                {
                    "name": "a",
                    "instructions": "x",
                    "tools": [tool(parameters=with_city({"type": None, "format": "email"}))],
                }
            ],
            "agents[0].tools[0].parameters",
            "properties.city.format: only strings have a format here",
        ),
        (
            [{"name": "a", "instructions": "x", "tools": [tool(), tool()]}],
            "agents[0]",
            "duplicate tool name(s): search",
        ),
        ([{"name": "a", "instructions": "x", "tools": [tool(name="cancel_tool_call")]}], "tools[0].name", "built-in"),
        ([{"name": "a", "instructions": "x", "llm": {"provider": "nope"}}], "agents[0].llm", "unknown llm provider"),
        ([{"name": "a", "instructions": "x"}, {"name": "a", "instructions": "y"}], "agents", "duplicate agent name"),
        ([{"name": "a"}], "agents[0].instructions", "Field required"),
        ({"concierge": {"instructions": "x", "tools": [tool(url=3)]}}, "concierge.tools[0].url", "URL"),
    ],
)
def test_bad_files_name_the_file_and_the_field(tmp_path: Path, agents: Any, location: str, message: str):
    text = load_error(tmp_path, agents)
    line = next((ln for ln in text.splitlines()[1:] if location in ln), None)
    assert line is not None and message in line, text


def test_unreadable_or_malformed_files(tmp_path: Path):
    assert "must hold a list of agents" in load_error(tmp_path, "", name="empty.yaml")
    missing = tmp_path / "nope.yaml"
    with pytest.raises(AgentsFileError, match=f"^{missing}: cannot read the agents file"):
        read_agents_file(missing)
    assert "not valid YAML" in load_error(tmp_path, "- name: [unclosed\n")
    assert "not valid JSON" in load_error(tmp_path, "[{", name="agents.json")
    assert "must hold a list of agents" in load_error(tmp_path, "just text\n")
    assert "differs from the agent's key" in load_error(tmp_path, {"a": {"name": "b", "instructions": "x"}})


def test_an_agent_name_taken_by_python_agents_is_refused(tmp_path: Path):
    declared = load_agents_file(write(tmp_path, [{"name": "demo", "instructions": "x"}]), Webhooks(), environ=ENV)
    with pytest.raises(AgentsFileError, match="already defined by a Python agent or the built-ins: demo"):
        declared.register(AgentRegistry(DEMO_AGENTS))


def test_a_bad_agents_file_stops_startup_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("switchboard.control.logs.configure", lambda *a, **kw: None)  # keep pytest's log handlers
    path = write(tmp_path, [{"name": "a", "instructions": "x", "tools": [tool(url="nope")]}])
    with pytest.raises(AgentsFileError, match=r"agents\[0\]\.tools\[0\]\.url"):
        create_app(Settings(agents_file=path, database_url=f"sqlite+aiosqlite:///{tmp_path}/x.db"))
    code = main(["serve", "--agents-file", str(path), "--database-url", f"sqlite+aiosqlite:///{tmp_path}/x.db"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"switchboard: {path}: invalid agents file:") and "agents[0].tools[0].url" in err


# -- arguments ----------------------------------------------------------------------------------------------------


@function_tool
async def twin(city: str, party: int, kind: Literal["indoor", "outdoor"] = "indoor") -> str:
    """The same parameters as the declared tool below, as a Python tool."""
    return city


TWIN_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "party": {"type": "integer"},
        "kind": {"type": "string", "enum": ["indoor", "outdoor"], "default": "indoor"},
    },
    "required": ["city", "party"],
}


@pytest.mark.parametrize(
    "raw",
    [
        {"party": 2},
        {"city": "Rome", "party": "two"},
        {"city": 5, "party": 2},
        {"city": "Rome", "party": 2, "kind": "roof"},
        {"city": "Rome", "party": 2, "extra": True},
        {},
    ],
)
def test_bad_arguments_read_exactly_like_a_python_tools(tmp_path: Path, raw: dict[str, Any]):
    declared = webhook(tmp_path, name="twin", parameters=TWIN_SCHEMA)
    with pytest.raises(ValidationError) as python_err:
        twin.parse_arguments(raw)
    with pytest.raises(ValidationError) as declared_err:
        declared.parse_arguments(raw)
    expected = format_validation_error("twin", python_err.value)
    assert format_validation_error("twin", declared_err.value) == expected
    assert expected.startswith("Invalid arguments for twin: ")


def test_arguments_forwarded_to_the_backend(tmp_path: Path):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 2},
            "party": {"type": "integer", "minimum": 1, "default": 2},
            "note": {"type": ["string", "null"]},
            "json": {"type": "boolean"},  # a name that is also a BaseModel attribute
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["lat"],
            },
            "meta": {"type": "object"},
        },
        "required": ["city"],
    }
    hook = webhook(tmp_path, parameters=schema)
    # declared defaults are filled in; optional properties the model left out are not sent as null
    assert hook.parse_arguments({"city": "Rome"}) == {"city": "Rome", "party": 2}
    full = {
        "city": "Rome",
        "party": "3",
        "note": None,
        "json": True,
        "where": {"lat": 1, "tags": ["a"]},
        "meta": {"k": 1},
    }
    assert hook.parse_arguments(full) == {**full, "party": 3, "where": {"lat": 1.0, "tags": ["a"]}}
    for bad, field in [
        ({"city": "R"}, "city"),
        ({"city": "Rome", "party": 0}, "party"),
        ({"city": "Rome", "where": {}}, "where.lat"),
        ({"city": "Rome", "where": {"lat": 1, "tags": [1]}}, "where.tags.0"),
    ]:
        with pytest.raises(ValidationError) as err:
            hook.parse_arguments(bad)
        assert format_validation_error("search", err.value).startswith(f"Invalid arguments for search: {field}: ")


def test_additional_properties_and_the_schema_shown_to_the_model(tmp_path: Path):
    open_schema = {"type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": True}
    hook = webhook(tmp_path, parameters=open_schema)
    assert hook.parse_arguments({"q": "x", "other": [1]}) == {"q": "x", "other": [1]}
    assert hook.parameters["additionalProperties"] is True
    closed = webhook(tmp_path, parameters={"type": "object", "properties": {}})
    assert closed.schema() == {
        "name": "search",
        "description": "Search.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    }
    assert closed.parse_arguments({}) == {}


# -- signatures ---------------------------------------------------------------------------------------------------


def test_signatures_verify_and_reject_tampering_and_replays():
    body = b'{"call_id":"c1","session_id":"s1","tool":"t","arguments":{}}'
    now = time.time()
    headers = signed_headers("k", body, message_id="msg_1", signature="switchboard", now=now)
    ts, sig = headers["X-Switchboard-Timestamp"], headers["X-Switchboard-Signature"]
    assert sig.startswith("v1=") and len(sig) == 3 + 64
    assert verify_signature("k", ts, body, sig)
    assert verify_signature("k", ts, body.decode(), sig, now=now + 299, window_s=300)
    assert verify_signature("k", ts, body, f"v1={'0' * 64}, {sig}")  # any of several (secret rotation)
    assert not verify_signature("other", ts, body, sig)  # wrong secret
    assert not verify_signature("k", ts, body + b" ", sig)  # body changed
    assert not verify_signature("k", str(int(ts) + 1), body, sig)  # timestamp changed
    assert not verify_signature("k", ts, body, sig, now=now + 301, window_s=300)  # stale: a replay
    assert not verify_signature("k", ts, body, sig, now=now - 301, window_s=300)  # from the future
    assert not verify_signature("k", "yesterday", body, sig)
    assert not verify_signature("k", None, body, sig)
    assert not verify_signature("k", ts, body, None)
    assert not verify_signature("k", ts, body, sig.removeprefix("v1="))
    old = int(now) - 1000
    assert verify_signature("k", old, body, sign("k", old, body), now=old + 10)


def test_a_webhook_secret_of_32_characters_is_enough(tmp_path: Path):
    secret = "s" * 32
    agents = [{"name": "a", "instructions": "x", "tools": [tool(secret_env="EXACT")]}]
    agent = load_agents_file(write(tmp_path, agents), Webhooks(), environ={"EXACT": secret}).factories["a"]()
    found = agent.tools["search"]
    assert isinstance(found, WebhookTool) and found.endpoint.secret == secret
    text = load_error(tmp_path, agents, env={"EXACT": secret[1:]})
    assert "of 31 characters" in text and secret[1:] not in text  # the error never shows the secret


STANDARD_KEY = base64.b64encode(bytes(range(32))).decode()  # 32 bytes: 43 characters and one "="


@pytest.mark.parametrize("secret", [f"whsec_{STANDARD_KEY}", f"whsec_{STANDARD_KEY.rstrip('=')}", "whsec_" + "A" * 32])
def test_a_whsec_secret_of_24_bytes_or_more_is_a_standard_webhooks_one(tmp_path: Path, secret: str):
    """Its padding is optional, as the Standard Webhooks libraries read it; ``signature`` is as the file says (None:
    the default for the secret, Standard Webhooks alone)."""
    for signature in (None, "both", "switchboard"):
        agents = [{"name": "a", "instructions": "x", "tools": [tool(secret_env="STD", signature=signature)]}]
        agent = load_agents_file(write(tmp_path, agents), Webhooks(), environ={"STD": secret}).factories["a"]()
        found = agent.tools["search"]
        assert isinstance(found, WebhookTool)
        assert (found.endpoint.secret, found.endpoint.signature) == (secret, signature)
    refused = [{"name": "a", "instructions": "x", "tools": [tool(secret_env="STD", signature="hmac")]}]
    text = load_error(tmp_path, refused, env={"STD": secret})
    assert "agents[0].tools[0].signature: Input should be 'standard', 'switchboard' or 'both'" in text


@pytest.mark.parametrize(
    ("secret", "problem"),
    [
        ("whsec_not/quite+base64!" + "A" * 20, "holds a whsec_ secret that is not valid base64 after its prefix"),
        ("whsec_" + "A" * 33, "holds a whsec_ secret that is not valid base64 after its prefix"),  # 4k+1 characters
        ("whsec_" + base64.b64encode(b"k" * 23).decode(), "holds a whsec_ secret of 23 bytes; at least 24 are needed"),
        ("whsec_", "holds a whsec_ secret of 0 bytes; at least 24 are needed"),
    ],
)
def test_a_malformed_whsec_secret_stops_startup_naming_the_variable_never_the_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret: str, problem: str
):
    monkeypatch.setenv("STD_WEBHOOK_SECRET", secret)
    path = write(tmp_path, [{"name": "a", "instructions": "x", "tools": [tool(secret_env="STD_WEBHOOK_SECRET")]}])
    with pytest.raises(AgentsFileError) as err:  # the CLI prints it and exits 2 (above)
        create_app(Settings(agents_file=path, database_url=f"sqlite+aiosqlite:///{tmp_path}/x.db"))
    text = str(err.value)
    assert f"agents[0].tools[0].secret_env: environment variable STD_WEBHOOK_SECRET {problem}" in text, text
    assert "make one with: python -c" in text
    key = secret.removeprefix("whsec_")
    assert not key or key[:8] not in text  # the error never shows the secret


FORMATTED = {
    "type": "object",
    "properties": {
        "email": {"type": "string", "format": "email"},
        "site": {"type": "string", "format": "uri"},
        "day": {"type": "string", "format": "date"},
        "at": {"type": ["string", "null"], "format": "date-time"},
        "ref": {"type": "string", "format": "uuid"},
    },
}
GOOD = {
    "email": "ada@example.com",
    "site": "https://example.com/a?b=c",
    "day": "2026-02-28",
    "at": "2026-11-28T03:04:05.5+01:00",
    "ref": "123e4567-e89b-12d3-a456-426614174000",
}


def test_formats_are_enforced_and_the_strings_pass_unchanged(tmp_path: Path):
    declared = webhook(tmp_path, parameters=FORMATTED)
    assert declared.parse_arguments(GOOD) == GOOD
    assert declared.parse_arguments({"at": None}) == {"at": None}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("email", "ada"),
        ("email", "ada@example"),
        ("email", "a da@example.com"),
        ("site", "example.com/a"),
        ("site", "https://exa mple.com"),
        ("day", "2026-02-30"),
        ("day", "28/02/2026"),
        ("at", "2026-11-28T03:04:05"),  # no offset
        ("at", "2026-11-28"),
        ("ref", "123e4567e89b12d3a456426614174000"),
    ],
)
def test_a_value_not_of_its_format_never_reaches_the_backend(tmp_path: Path, field: str, value: str):
    declared = webhook(tmp_path, parameters=FORMATTED)
    with pytest.raises(ValidationError) as err:
        declared.parse_arguments({field: value})
    text = format_validation_error("search", err.value)
    assert field in text and f"not a valid {FORMATTED['properties'][field]['format']}" in text, text


def test_annotations_are_accepted_and_shown_to_the_model_not_checked(tmp_path: Path):
    annotated = with_city({"title": "City", "examples": ["Rome"], "$comment": "free text", "description": "A city."})
    declared = webhook(tmp_path, parameters={**annotated, "title": "Search", "$comment": "v2"})
    assert declared.parse_arguments({"city": "Paris"}) == {"city": "Paris"}  # not one of the examples
    assert declared.parameters["properties"]["city"]["examples"] == ["Rome"]
