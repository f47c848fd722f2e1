"""The companion tools offered to the model whenever one of its tools is cancellable: list and cancel calls."""

from __future__ import annotations

import json
from typing import Protocol

from .speech import NotInterruptible
from .tool_call import CANCELLED_BY_THE_MODEL, AlreadyEnded, NotCancellable, RunningCall, ToolCallNotFound
from .tools import FunctionTool, ToolCallInfo, ToolError, function_tool

COMPANION_TOOLS = frozenset({"list_running_tool_calls", "cancel_tool_call"})


class Calls(Protocol):
    """The calls the companion tools list and cancel (the ``ToolExecutor``'s)."""

    def running(self) -> list[RunningCall]: ...

    async def cancel(self, call_id: str, *, reason: str = ..., force: bool = ...) -> ToolCallInfo: ...


class _Companions:
    """The companion tools as methods: each session binds its executor to the same two tools, whose arguments model
    and JSON schema are built once per process (building a tool creates a pydantic model: ~1 ms and cyclic garbage)."""

    def __init__(self, executor: Calls) -> None:
        self.executor = executor

    @function_tool(name="list_running_tool_calls")
    async def list_running_tool_calls(self) -> str:
        """List the tool calls that are still running, with their ids and whether they can be cancelled."""
        rows = [
            {
                "call_id": rc.info.call_id,
                "name": rc.info.name,
                "arguments": rc.info.arguments,
                "cancellable": rc.info.cancellable,
                "status": rc.info.status.value,  # `cancelling`: cancelled, and its tool has not stopped yet
                "progress": rc.info.progress[-1].message if rc.info.progress else None,
            }
            for rc in self.executor.running()
            if rc.info.name not in COMPANION_TOOLS
        ]
        return json.dumps(rows)

    @function_tool(name="cancel_tool_call")
    async def cancel_tool_call(self, call_id: str) -> str:
        """Cancel a running tool call by its id (see list_running_tool_calls)."""
        try:
            info = await self.executor.cancel(call_id, reason=CANCELLED_BY_THE_MODEL)
        except ToolCallNotFound:
            raise ToolError(f"There is no tool call {call_id}.") from None
        except NotCancellable:
            raise ToolError(f"Tool call {call_id} cannot be cancelled.") from None
        except NotInterruptible:
            raise ToolError(
                f"Tool call {call_id} cannot be cancelled now: the speech it belongs to does not allow interruptions."
            ) from None
        except AlreadyEnded as err:
            raise ToolError(f"Tool call {call_id} already ended ({err.info.status.value}).") from None
        if not info.ended:
            return f"Cancelling {info.name} ({call_id}): the tool has not stopped yet."
        return f"Cancelled {info.name} ({call_id})."


def companion_tools(executor: Calls) -> dict[str, FunctionTool]:
    """``list_running_tool_calls`` and ``cancel_tool_call`` for the calls of ``executor``."""
    bound = _Companions(executor)
    return {t.name: t for t in (bound.list_running_tool_calls, bound.cancel_tool_call)}
