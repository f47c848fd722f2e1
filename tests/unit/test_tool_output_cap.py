"""A tool's output reaches the chat, the events, the store and the model: it is cut at a fixed size, visibly."""

from __future__ import annotations

from switchboard.runtime.executor import Outcome
from switchboard.runtime.tools import MAX_TOOL_OUTPUT_CHARS, ToolStatus, capped_output


def test_short_outputs_are_untouched() -> None:
    assert capped_output("fine") == "fine"
    assert capped_output("z" * MAX_TOOL_OUTPUT_CHARS) == "z" * MAX_TOOL_OUTPUT_CHARS


def test_every_outcome_is_capped_with_a_marker() -> None:
    for outcome in (
        Outcome(ToolStatus.COMPLETED, "a" * 10_000_000),  # what a Python tool returned
        Outcome(ToolStatus.FAILED, "b" * 10_000_000, is_error=True),  # the message of its ToolError
    ):
        assert len(outcome.output) < MAX_TOOL_OUTPUT_CHARS + 100
        assert outcome.output.endswith(
            f"[output truncated: {10_000_000 - MAX_TOOL_OUTPUT_CHARS} more characters not shown]"
        )
