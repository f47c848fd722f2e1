"""Switchboard: a control plane for live AI agent sessions."""

from .runtime.agent import Agent, AgentRegistry
from .runtime.session import AgentSession, SessionOptions
from .runtime.speech import SpeechHandle, SpeechInterrupted
from .runtime.tools import RunContext, StopResponse, ToolCancelled, ToolError, function_tool

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
