"""Model profiles: sessions reach model servers only through endpoints and credentials the server configured.

A profile is a named provider configuration (``SWITCHBOARD_MODELS``, a JSON object of name -> config, or the
``llm`` of an agent in the agents file). A session asks for one with ``{"profile": "<name>"}`` and may tune only
parameters that cannot send anything anywhere (``temperature``). A session's own ``llm`` can never name a URL or an
environment variable: otherwise a caller with ``sessions:write`` could point the service at a listener of its
choosing and receive whatever secret it names, sent as a bearer token.

The scripted model needs no endpoint and no credential, but a script picks the tool calls a session makes (with
their arguments): it is a test and demo facility. A session may bring a script only while the server lets it
(auth off, or ``SWITCHBOARD_SCRIPTED_MODEL=allow``); an agent's own default script is server configuration.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from ..runtime.llm import MissingCredential, build_llm

logger = logging.getLogger("switchboard.integrations.model_profiles")

PROFILE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
#: What a session may set on top of a profile: nothing here reaches a URL, a variable or a resource limit.
SESSION_TUNABLE = frozenset({"temperature"})
#: Providers a session may configure in full because they talk to nothing outside the process.
SELF_CONTAINED_PROVIDERS = frozenset({"scripted"})


#: Keys of a profile about what happens when its model fails (not passed to the provider).
FALLBACK_KEYS = frozenset({"fallbacks", "ttft_timeout_s"})


def _fallbacks(name: str, given: Mapping[str, Any]) -> tuple[list[str], float | None]:
    chain, timeout = given.get("fallbacks", []), given.get("ttft_timeout_s")
    if not isinstance(chain, list) or not all(isinstance(n, str) for n in chain):
        raise ValueError(f"model profile {name!r}: fallbacks must be a list of profile names")
    if timeout is not None and (not isinstance(timeout, int | float) or not 0 < timeout <= 600):
        raise ValueError(f"model profile {name!r}: ttft_timeout_s must be a number of seconds in (0, 600]")
    return chain, timeout


class ModelProfiles:
    """The server's model profiles, validated once at startup; resolves what a session may use."""

    def __init__(
        self, profiles: Mapping[str, Mapping[str, Any]] | None = None, *, sessions_may_script: bool = True
    ) -> None:
        self.sessions_may_script = sessions_may_script
        self._profiles: dict[str, dict[str, Any]] = {}
        # profile -> (the profiles tried after it, in order; the time each gets to produce a first chunk)
        self._fallbacks: dict[str, tuple[list[str], float | None]] = {}
        for name, given in (profiles or {}).items():
            if not PROFILE_NAME_PATTERN.match(name):
                raise ValueError(f"model profile name {name!r}: use letters, digits, '_', '.', '-' (max 64)")
            if "profile" in given:
                raise ValueError(f"model profile {name!r}: a profile cannot refer to another profile")
            config = {k: v for k, v in given.items() if k not in FALLBACK_KEYS}
            if FALLBACK_KEYS & set(given):
                self._fallbacks[name] = _fallbacks(name, given)
            try:
                build_llm(dict(config))  # checks the config; providers open nothing until used
            except MissingCredential as err:
                # the service starts (the other profiles work); a session asking for this one is refused, naming it
                logger.warning("model profile %r cannot be used: %s", name, err)
            except ValueError as err:
                raise ValueError(f"model profile {name!r}: {err}") from None
            self._profiles[name] = dict(config)
        for name, (chain, _) in self._fallbacks.items():
            missing = [n for n in chain if n not in self._profiles or n == name]
            if missing:
                raise ValueError(f"model profile {name!r}: fallbacks: not other profiles: {', '.join(missing)}")

    def fallbacks(self, name: str) -> list[str]:
        """The profiles tried after ``name`` when its model fails."""
        return list(self._fallbacks.get(name, ([], None))[0])

    def names(self) -> list[str]:
        return sorted(self._profiles)

    def __contains__(self, name: object) -> bool:
        return name in self._profiles

    def _available(self) -> str:
        return ", ".join(self.names()) or "none configured: set SWITCHBOARD_MODELS"

    def _profile(self, config: Mapping[str, Any]) -> dict[str, Any]:
        name = config["profile"]
        if not isinstance(name, str) or name not in self._profiles:
            raise ValueError(f"unknown model profile {name!r} (available: {self._available()})")
        tuning = {k: v for k, v in config.items() if k != "profile"}
        refused = sorted(set(tuning) - SESSION_TUNABLE)
        if refused:
            raise ValueError(
                f"a session may set only {', '.join(sorted(SESSION_TUNABLE))} on a model profile; "
                f"{', '.join(refused)} come(s) from the server's configuration"
            )
        if name not in self._fallbacks:
            return {**self._profiles[name], **tuning}
        chain, ttft_timeout_s = self._fallbacks[name]
        models = [{**self._profiles[n], **tuning} for n in [name, *chain]]
        return {"provider": "fallback", "models": models, "ttft_timeout_s": ttft_timeout_s}

    def for_session(
        self, requested: Mapping[str, Any] | None, default: Mapping[str, Any] | None
    ) -> dict[str, Any] | None:
        """The provider configuration to build for a session.

        ``requested`` is the session's own ``llm`` (from a caller: untrusted); ``default`` is its agent's default
        (server configuration). Raises ``ValueError`` (the API answers 422) for anything a session may not choose.
        """
        if requested is None:
            return self.server_config(default)
        if "profile" in requested:
            return self._profile(requested)
        provider = requested.get("provider", "scripted")
        if isinstance(provider, str) and provider in SELF_CONTAINED_PROVIDERS:
            if not self.sessions_may_script:
                raise ValueError(
                    f"a session cannot bring its own {provider!r} model while API keys are configured: it is a test "
                    "and demo facility (the server allows it with SWITCHBOARD_SCRIPTED_MODEL=allow)"
                )
            return dict(requested)
        raise ValueError(
            f"a session cannot configure the {provider!r} provider itself: model endpoints and credentials come from "
            f'the server\'s configuration. Ask for a model profile instead: {{"profile": "<name>"}} '
            f"(available: {self._available()})"
        )

    def server_config(self, config: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """Resolve a configuration written by the operator (an agent's default): a full provider configuration,
        or a reference to a profile."""
        if config is None:
            return None
        if "profile" in config:
            return self._profile(config)
        return dict(config)
