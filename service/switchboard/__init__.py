"""Switchboard: a control plane for live AI agent sessions.

The names below load on first use, so ``import switchboard.client`` (all a client-only install has) imports nothing
of the runtime or the server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runtime.agent import Agent, AgentRegistry
    from .runtime.options import SessionOptions
    from .runtime.session import AgentSession
    from .runtime.speech import SpeechHandle, SpeechInterrupted
    from .runtime.tools import RunContext, StopResponse, ToolCancelled, ToolError, function_tool

_WHERE = {
    "Agent": ".runtime.agent",
    "AgentRegistry": ".runtime.agent",
    "AgentSession": ".runtime.session",
    "RunContext": ".runtime.tools",
    "SessionOptions": ".runtime.options",
    "SpeechHandle": ".runtime.speech",
    "SpeechInterrupted": ".runtime.speech",
    "StopResponse": ".runtime.tools",
    "ToolCancelled": ".runtime.tools",
    "ToolError": ".runtime.tools",
    "function_tool": ".runtime.tools",
}

__all__ = [
    "Agent",
    "AgentRegistry",
    "AgentSession",
    "RunContext",
    "SessionOptions",
    "SpeechHandle",
    "SpeechInterrupted",
    "StopResponse",
    "ToolCancelled",
    "ToolError",
    "function_tool",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'switchboard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
