"""Building a provider from a session's ``llm`` configuration (kept apart from the protocol it implements)."""

from __future__ import annotations

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
