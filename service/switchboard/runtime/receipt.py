"""Receipts: how an operator command sent with an idempotency key is answered by its own effect (I7).

The service reserves the key before the command runs and hands the command a ``Receipt``. The command gives the
receipt the result of the one change that is its effect, and commits the ``Completion`` it gets back in that change's
``Commit`` (``ports.Commit.receipts``): the store writes the answer in the same transaction as the effect. The
runtime never knows what an answer looks like; the service renders it.

A leaf module (pydantic only): the speech, the tools and the ports all refer to it.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, PrivateAttr


class Completion(BaseModel):
    """The answer of an operator command sent with an idempotency key (I7), written with the command's effect.

    The key was reserved for ``holder`` (a node and its process incarnation) before the command ran; the store
    completes that reservation in the transaction of the commit that carries this, and refuses the whole commit when
    ``holder`` no longer holds it (another request took the key over: it runs the command instead). The effect and
    its answer are therefore durable together or not at all: a retry finds the answer, or runs the command."""

    key: str
    scope: str
    holder_node: str
    holder_incarnation: str
    status_code: int
    body: Any = None
    _landed: bool = PrivateAttr(default=False)
    _refused: Exception | None = PrivateAttr(default=None)

    @property
    def landed(self) -> bool:
        """The commit that carried it is durable (set by the store)."""
        return self._landed

    def mark_landed(self) -> None:
        self._landed = True

    @property
    def refused(self) -> Exception | None:
        """The store's error when the commit that carried it failed for good (set by the store): nothing of that
        commit landed, the effect included."""
        return self._refused

    def mark_refused(self, err: Exception) -> None:
        if not self._landed:
            self._refused = err


T_contra = TypeVar("T_contra", contravariant=True)


class Receipt(Protocol[T_contra]):
    """What an operator command is given to answer for its effect: the command hands it the result of the one change
    that is its effect, and commits the ``Completion`` it returns in that change's ``Commit``. The runtime never
    knows what the answer looks like (the service renders it)."""

    def complete(self, result: T_contra) -> Completion | None:
        """The completion for an effect that produced ``result``; None when ``result`` does not answer this command,
        or when a completion was already taken (a command has one effect)."""
        ...


def completions(result: T_contra, *receipts: Receipt[T_contra] | None) -> list[Completion]:
    """What ``receipts`` (None: a command without one) complete with an effect that produced ``result``: the
    ``Commit.receipts`` of that effect."""
    return [done for receipt in receipts if receipt is not None and (done := receipt.complete(result)) is not None]


__all__ = ["Completion", "Receipt", "completions"]
