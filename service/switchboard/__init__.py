"""Switchboard: a control plane for live AI agent sessions."""

from .runtime.agent import Agent, AgentRegistry
from .runtime.options import SessionOptions
from .runtime.session import AgentSession
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
