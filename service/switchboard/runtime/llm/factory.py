"""Building a provider from a session's ``llm`` configuration (kept apart from the protocol it implements)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .base import LLM

PROVIDERS = ("scripted", "openai", "fallback")


def build_llm(config: dict[str, Any] | None) -> LLM:
    """Build a provider from a session's ``llm`` configuration."""
    # imported here: a provider's module (and its client library) loads only when a session uses it
    from .fallback import FallbackLLM
    from .openai import OpenAILLM
    from .scripted import ScriptedLLM

    config = dict(config or {"provider": "scripted"})
    provider = config.pop("provider", "scripted")
    if provider == "scripted":
        return ScriptedLLM.from_config(config)
    if provider == "openai":
        return OpenAILLM.from_config(config)
    if provider == "fallback":
        return FallbackLLM.from_config(config, build_llm)
    raise ValueError(f"unknown llm provider {provider!r} (available: {', '.join(PROVIDERS)})")


def prepare_llm(config: dict[str, Any] | None) -> Callable[[], LLM]:
    """A maker of providers of one configuration (an agent's default, built for each of its sessions): each provider
    is its own (its position in a script, its client), and what they can share is made once, here: a scripted
    model's parsed script. The configuration is checked when each provider is built, as ``build_llm`` does."""
    from .scripted import ScriptedLLM, parse_script

    config = dict(config or {"provider": "scripted"})
    if config.get("provider", "scripted") != "scripted":
        return functools.partial(build_llm, config)
    config.pop("provider", None)
    return functools.partial(ScriptedLLM.from_script, parse_script(config))
