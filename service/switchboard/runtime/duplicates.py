"""A tool's ``on_duplicate`` policy: what a call does when the same tool is already running.

What "the same" means is the tool's ``duplicate_scope``: the name alone, or the name and the arguments, compared by
what they mean (``validate_arguments`` keys each call on its validated arguments when it starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from .arguments import canonical, nulls_to_defaults
from .companions import COMPANION_TOOLS
from .tool_call import Outcome, RunningCall, cancel_refusal
from .tools import CONFIRM_FIELD, FunctionTool, ToolStatus, format_validation_error


@dataclass(frozen=True)
class DuplicateVerdict:
    """Whether a call may run: ``refusal`` ends it unstarted; otherwise the calls in ``replaces`` are cancelled
    first (``on_duplicate="replace"``), then it runs."""

    refusal: Outcome | None = None
    replaces: tuple[RunningCall, ...] = ()


def validate_arguments(rc: RunningCall, tool: FunctionTool) -> None:
    """Validate the call's arguments as a real model writes them (a ``null`` for a parameter with a default is
    that default) and key it on what they mean, for ``duplicate_scope="name_and_args"``."""
    try:
        rc.args = tool.parse_arguments(nulls_to_defaults(tool.args_model, rc.item.arguments))
    except ValidationError as err:
        rc.invalid = format_validation_error(rc.info.name, err)
        return
    rc.args_key = canonical({k: v for k, v in rc.args.items() if k != CONFIRM_FIELD})


def duplicate_verdict(rc: RunningCall, args: dict[str, Any], earlier: Sequence[RunningCall]) -> DuplicateVerdict:
    """Apply ``rc``'s tool policy against the ``earlier`` calls (those started before it).

    >>> verdict = duplicate_verdict(rc, rc.args, started_before_rc)
    >>> verdict.refusal is None  # it may run (once ``verdict.replaces`` are cancelled)
    """
    tool = rc.tool
    assert tool is not None
    if tool.policy.on_duplicate == "allow" or rc.info.name in COMPANION_TOOLS:
        return DuplicateVerdict()
    same = [
        other
        for other in earlier
        if not other.ended
        and other.info.name == rc.info.name
        and (tool.policy.duplicate_scope == "name" or other.args_key == rc.args_key)
    ]
    if not same:
        return DuplicateVerdict()
    ids = ", ".join(o.info.call_id for o in same)
    if tool.policy.on_duplicate == "reject":
        return _refused(f"Not started: {tool.name} is already running (call {ids}). Wait for its result.")
    if tool.policy.on_duplicate == "confirm":
        if args.get(CONFIRM_FIELD):
            return DuplicateVerdict()
        return _refused(
            f"Not started: {tool.name} is already running (call {ids}). Ask the user to confirm they want "
            f"it run again; if they do, call it again with {CONFIRM_FIELD}=true."
        )
    # replace: the running duplicates are cancelled (the tool's author opted into this), then this one runs;
    # but a call that cannot be cancelled now is never replaced: the new call is refused instead
    kept = [o for o in same if cancel_refusal(o) is not None]
    if kept:
        return _refused(
            f"Not started: {tool.name} is already running (call {', '.join(o.info.call_id for o in kept)}) "
            f"and {cancel_refusal(kept[0])}, so it was not replaced. Wait for its result."
        )
    return DuplicateVerdict(replaces=tuple(same))


def _refused(output: str) -> DuplicateVerdict:
    return DuplicateVerdict(refusal=Outcome(ToolStatus.REJECTED, output, is_error=True))


__all__ = ["DuplicateVerdict", "duplicate_verdict", "validate_arguments"]
