"""The ordered view of a chat context is worked out once per append and is always the current one."""

from __future__ import annotations

from datetime import timedelta

from switchboard.runtime.chat import ChatContext, ChatMessage, FunctionCall, FunctionCallOutput, utcnow


def test_the_ordered_view_follows_every_append_and_is_a_list_of_its_own():
    t0 = utcnow()
    call = FunctionCall(id="c", call_id="k", name="t", created_at=t0)
    later = ChatMessage(id="m", role="user", text="later", created_at=t0 + timedelta(seconds=2))
    chat = ChatContext([call, later])
    first = chat.items
    assert [it.id for it in first] == ["c", "m"]
    first.clear()  # a caller's copy: the context is not changed through it
    assert [it.id for it in chat.items] == ["c", "m"]
    chat.append(FunctionCallOutput(id="o", call_id="k", name="t", output="x", created_at=t0 + timedelta(seconds=5)))
    assert [it.id for it in chat.items] == ["c", "o", "m"]  # the output right after its call
    chat.append(ChatMessage(id="e", role="user", text="early", created_at=t0 - timedelta(seconds=1)))
    assert [it.id for it in chat.items] == ["e", "c", "o", "m"]
