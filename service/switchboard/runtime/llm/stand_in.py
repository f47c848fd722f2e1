"""The stand-in for a model: what a session runs when nothing names one (neither the session nor its agent).

It lets a newcomer try an agent's tools before connecting a model. A user message that is a call of one of the
agent's tools, ``search_tables(city="Rome", party=2)`` or ``search_tables {"city": "Rome", "party": 2}``, calls it with
those arguments (the tool validates them, as it would a model's); a tool's result is said in a few words (not its
"running in the background" or progress outputs); anything else is answered with one sentence saying that no model
is configured and how to call a tool, or, for an agent without tools, how to connect a model. It keeps no state.
"""

from __future__ import annotations

import ast
import re
from collections.abc import AsyncIterator
from typing import Any

from ..chat import PLACEHOLDER_OUTPUT, ChatMessage, FunctionCallOutput
from ..companions import COMPANION_TOOLS
from ..text import read_json, valid_json
from ..tools import CONFIRM_FIELD
from .base import LLMChunk, LLMRequest
from .scripted import BACKGROUND_OUTPUT_PREFIX, PROGRESS_OUTPUT_PREFIX, ScriptedToolCall, Turn, aside, play_turn

#: How summaries of a session's model (``GET /v1/agents``, a session's ``model``) name the stand-in.
STAND_IN_PROVIDER = "stand-in"
#: A tool's output is said up to this many characters.
SAID_OUTPUT_CHARS = 200
#: The help sentence names this many of the agent's tools.
SHOWN_TOOLS = 3
#: Outputs that are no result: nothing is said after them.
_NOT_RESULTS = (BACKGROUND_OUTPUT_PREFIX, PROGRESS_OUTPUT_PREFIX, PLACEHOLDER_OUTPUT)
_PYTHON_CALL = re.compile(r"([^\s(){}]+)\s*\((.*)\)", re.DOTALL)
_JSON_CALL = re.compile(r"([^\s(){}]+)\s+(\{.*\})", re.DOTALL)
_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}

NO_MODEL = "No model is configured for this agent"
CONNECT_A_MODEL = (
    f"{NO_MODEL}: set a model profile in SWITCHBOARD_MODELS and give the session or the agent the llm "
    '{"profile": "<name>"}.'
)


def _literal(node: ast.expr) -> Any:
    """The JSON value ``node`` writes (Python's literals, or JSON's ``true``, ``false``, ``null``)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str | int | float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [k.value if isinstance(k, ast.Constant) and isinstance(k.value, str) else None for k in node.keys]
        if None not in keys:
            return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise ValueError("not a literal")


def parse_call(text: str, names: set[str]) -> tuple[str, dict[str, Any]] | None:
    """The tool call ``text`` writes, ``name(key=value, ...)`` or ``name {"key": value}``, if it names one of
    ``names`` and its arguments are literals."""
    text = text.strip()
    if found := _JSON_CALL.fullmatch(text):
        if found.group(1) not in names:
            return None
        try:
            arguments = valid_json(read_json(found.group(2)))
        except ValueError:  # not JSON, or nested too deeply (json itself would raise RecursionError)
            return None
        return (found.group(1), arguments) if isinstance(arguments, dict) else None
    found = _PYTHON_CALL.fullmatch(text)
    if found is None or found.group(1) not in names:
        return None
    try:
        call = ast.parse(f"f({found.group(2)})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            return None
        return found.group(1), valid_json({str(k.arg): _literal(k.value) for k in call.keywords})
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the parser gives up on deep nesting either way
        return None


def _example(tool: dict[str, Any]) -> str:
    parameters = [p for p in tool.get("parameters", {}).get("properties", {}) if p != CONFIRM_FIELD]
    return f"{tool['name']}({', '.join(f'{p}=...' for p in parameters)})"


def help_sentence(tools: list[dict[str, Any]]) -> str:
    """What the stand-in says to anything but a tool call: how to call the agent's tools (the companions that list
    and cancel running calls are not named, though they can be called), or how to connect a model."""
    tools = [tool for tool in tools if tool["name"] not in COMPANION_TOOLS]
    if not tools:
        return CONNECT_A_MODEL
    examples = [_example(tool) for tool in tools[:SHOWN_TOOLS]]
    listed = examples[0] if len(examples) == 1 else f"{', '.join(examples[:-1])} or {examples[-1]}"
    more = len(tools) - len(examples)
    return f"{NO_MODEL}; call a tool by writing it, like {listed}" + (f" (it has {more} more)." if more else ".")


def said_output(output: FunctionCallOutput) -> str:
    """A tool's output in a few words: ``search_tables: 3 tables free``."""
    text = " ".join(output.output.split()) or "(no output)"
    if len(text) > SAID_OUTPUT_CHARS:
        text = text[:SAID_OUTPUT_CHARS].rsplit(" ", 1)[0] + " …"
    return f"{output.name} failed: {text}" if output.is_error else f"{output.name}: {text}"


class StandInLLM:
    """The model of a session that names none. ``calls_tools=False`` (where sessions may not bring a script of their
    own, which would pick tool calls too) makes it only say how to connect a model."""

    def __init__(self, *, calls_tools: bool = True) -> None:
        self.calls_tools = calls_tools

    def save_state(self) -> dict[str, Any] | None:
        return None

    def load_state(self, state: dict[str, Any] | None) -> None:
        return None  # nothing to resume (a session that followed the scripted default kept a position: ignored)

    async def aclose(self) -> None:
        return None

    def stream(self, request: LLMRequest) -> AsyncIterator[LLMChunk]:
        turn = self.answer(request)
        return play_turn(turn, turn.text, request)  # the text is said as is: a tool's output is not a template

    def answer(self, request: LLMRequest) -> Turn:
        """The turn that answers ``request``."""
        # what the request answers: its last item (a handoff is committed with the output of the tool that made it)
        last = next((item for item in reversed(request.items) if not aside(item)), None)
        if isinstance(last, FunctionCallOutput):
            return Turn() if last.output.startswith(_NOT_RESULTS) else Turn(text=said_output(last))
        tools = request.tools if self.calls_tools else []
        if request.tool_choice != "none" and (text := _latest_user_text(request)) is not None:
            call = parse_call(text, {tool["name"] for tool in tools})
            if call is not None:
                return Turn(tool_calls=[ScriptedToolCall(name=call[0], arguments=call[1])])
        return Turn(text=help_sentence(tools))


def _latest_user_text(request: LLMRequest) -> str | None:
    """The user's latest words, unless a tool has answered since (an assistant message cut off after them, say)."""
    for item in reversed(request.items):
        if isinstance(item, FunctionCallOutput):
            return None
        if isinstance(item, ChatMessage) and item.role == "user":
            return item.text
    return None
