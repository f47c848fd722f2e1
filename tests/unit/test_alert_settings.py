"""Alert sinks in the server's configuration: what is refused, with a message that never quotes the secret, and the
secrets kept out of the logs."""

from __future__ import annotations

import base64
import json

import pytest
from pydantic import ValidationError

from switchboard.control.settings import AlertSink, Settings

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def sinks(**overrides: object) -> str:
    return json.dumps([{"name": "pager", "url": "https://pager.example.com/hook", "secret": SECRET, **overrides}])


def test_sinks_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_ALERT_SINKS", sinks(reasons=["tool_failed"], agents=["billing"]))
    [sink] = Settings().alert_sinks
    assert sink.name == "pager" and sink.reasons == ["tool_failed"] and sink.agents == ["billing"]
    assert SECRET in Settings().secret_values()  # masked in every log line
    assert SECRET not in repr(sink)


def test_an_empty_value_is_no_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_ALERT_SINKS", "")
    assert Settings().alert_sinks == []


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ({"url": "ftp://pager.example.com/"}, "http:// or https://"),
        ({"url": "not a url"}, "http:// or https://"),
        ({"secret": "a-plain-secret-of-enough-length"}, "Standard Webhooks secret"),
        ({"secret": "whsec_" + base64.b64encode(b"short").decode()}, "at least 24 are needed"),
        ({"name": "has space"}, "name"),
        ({"extra": 1}, "extra"),
    ],
)
def test_a_bad_sink_is_refused_saying_why_never_quoting_its_secret(override: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(alert_sinks=json.loads(sinks(**override)))
    assert says in str(err.value)
    assert SECRET not in str(err.value)


def test_two_sinks_with_one_name_are_refused() -> None:
    both = json.loads(sinks()) * 2
    with pytest.raises(ValidationError, match="distinct names"):
        Settings(alert_sinks=both)


def test_routing_takes_any_reason_code_and_matches_agents() -> None:
    every = AlertSink(name="all", url="http://127.0.0.1:9/", secret=SECRET)
    assert every.subscribes("a_reason_from_a_later_version", ["demo"])
    some = AlertSink(name="s", url="http://127.0.0.1:9/", secret=SECRET, reasons=["operator_quiet"], agents=["desk"])
    assert some.subscribes("operator_quiet", ["desk"])
    assert not some.subscribes("operator_quiet", ["demo"])
    assert not some.subscribes("tool_failed", ["desk"])


def test_a_sink_that_is_refused_is_never_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = "a-plain-secret-of-enough-length"
    with pytest.raises(ValidationError) as err:
        Settings(alert_sinks=json.loads(sinks(secret=bad)))
    assert bad not in str(err.value)
    monkeypatch.setenv("SWITCHBOARD_ALERT_SINKS", sinks()[:-3])  # cut short: not JSON
    with pytest.raises(ValidationError) as err:
        Settings()
    assert "not JSON" in str(err.value) and SECRET not in str(err.value)
