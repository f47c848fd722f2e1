"""Webhook tools: a declared tool whose calls are POSTed, signed, to a backend that answers at once or reports later.

Delivery: ``POST url`` with ``{call_id, session_id, tool, arguments, report_token}``, signed per Standard Webhooks,
the service's earlier scheme, or both (``signing``). The backend answers ``200 {"output": str, "is_error"?: bool}``
(the result), or ``202`` and later reports progress and the result through the API (``WebhookBroker`` routes those
reports to the waiting call), sending the call's ``report_token`` in the ``X-Switchboard-Report-Token`` header: a
report credential that names one call, so a backend can report on its own calls and on no one else's
(``ReportCredentials``). Connection failures and 5xx are retried with backoff until the call's ``timeout_s``; any
other status ends the call with an ``is_error`` output. Deliveries are at least once: a backend dedupes on
``call_id``, or on ``webhook-id`` (``message_id``: the same on every attempt and re-delivery of one message).
Cancellation is cooperative, as for Python tools: the call ends ``cancelled`` at once and the backend is told by a
signed POST to ``cancel_url`` in the background.

A call whose session stops where it runs while the backend works (a crash, a restart, a move to another node) goes
on where the session runs next (``on_restart="resume"``, the default of webhook tools): it is not delivered again,
it waits there for the backend's reports until its deadline (its start plus ``timeout_s``).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import hmac
import json
import logging
import random
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, create_model

from .. import __version__
from ..runtime.aio import cancel_and_wait, first_of, spawn
from ..runtime.ports import Receipt
from ..runtime.text import read_json, valid_json, valid_text
from ..runtime.tools import (
    CONFIRM_DESCRIPTION,
    CONFIRM_FIELD,
    FunctionTool,
    RunContext,
    ToolCallInfo,
    ToolCancelled,
    ToolError,
    ToolPolicy,
)
from .schema_model import dump, object_model
from .signing import Signature, signed_headers, signing_key
from .signing import verify_signature as verify_signature  # for backends, where it always was

logger = logging.getLogger("switchboard.integrations.webhooks")

REPORT_TOKEN_HEADER = "X-Switchboard-Report-Token"
REPORT_TOKEN_PREFIX = "sbr_"
RETRY_BASE_S = 0.1
RETRY_MAX_S = 2.0
CONNECT_TIMEOUT_S = 5.0
CANCEL_ATTEMPTS = 4
CANCEL_TIMEOUT_S = 5.0
CLOSE_GRACE_S = 2.0
REMEMBER_ENDED = 10_000
DETAIL_MAX_CHARS = 300
#: The most of a backend's answer that is read: a bigger one fails the call (a JSON answer cut short is no answer).
MAX_RESPONSE_BYTES = 1024 * 1024
#: A webhook tool's policy unless it names one: its calls go on where their session runs next.
RESUMING_POLICY = ToolPolicy(on_restart="resume")


# -- report credentials -------------------------------------------------------------------------------------------


class ReportCredentials:
    """Per-call report credentials: ``sbr_<base64url HMAC-SHA256 of the session and call ids>``.

    Each delivery carries its call's credential (``report_token``), and a report must present it: only the backend
    that received a call can report on it, whatever its API key's scopes. Derived, not stored, so the rightful
    backend is recognised also after its call ended (it gets a precise 409) and on any process sharing the secret;
    anyone else gets one answer that says nothing about which sessions or calls exist.
    """

    def __init__(self, secret: str | None = None) -> None:
        root = (secret if secret is not None else secrets.token_urlsafe(32)).encode()
        # a key of its own: a report credential is never a valid session token or signature, and the reverse
        self._key = hmac.new(root, b"switchboard report credential v1", hashlib.sha256).digest()

    def issue(self, session_id: str, call_id: str) -> str:
        subject = json.dumps([session_id, call_id], ensure_ascii=True).encode()  # unambiguous, any characters
        mac = hmac.new(self._key, subject, hashlib.sha256).digest()
        return REPORT_TOKEN_PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def check(self, session_id: str, call_id: str, token: str | None) -> bool:
        """Whether ``token`` is the credential of this call (constant time; False for anything unusable)."""
        if not token or not token.isascii():
            return False
        return hmac.compare_digest(self.issue(session_id, call_id), token)


# -- reports from backends ----------------------------------------------------------------------------------------


class BackendResult(BaseModel):
    """A tool result from a backend: the ``200`` answer to a delivery, or a reported result."""

    model_config = ConfigDict(extra="ignore")

    output: str
    is_error: bool = False

    @classmethod
    def from_answer(cls, content: bytes) -> BackendResult:
        """From a backend's JSON answer; its lone surrogates become U+FFFD (``runtime.text``). Parsed by ``json``:
        pydantic's own parser rejects a ``\\ud800`` escape outright."""
        # ValueError (not JSON, not UTF-8) or ValidationError (itself a ValueError): not a valid result
        data = read_json(content)
        return cls.model_validate(valid_json(data))


class NotAwaitingReport(LookupError):
    """No webhook call of this process is waiting for reports under this id."""


class CallAlreadyEnded(Exception):
    """The webhook call has its result, was cancelled, or timed out: a report changes nothing."""


@dataclass(eq=False)
class PendingCall:
    """A webhook call between its delivery and its end. ``lock`` orders progress reports before the end.
    ``session`` is the live session the call runs in (``ctx.session``: one incarnation of the session on this node),
    so that whoever hands it a report waits for the end of this very call."""

    session_id: str
    call_id: str
    tool: str
    ctx: RunContext
    session: object | None = None
    result_fut: asyncio.Future[BackendResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    sent: bool = False  # a delivery got past connecting: the backend may have the call
    last_error: str | None = None

    @property
    def accepting(self) -> bool:
        return not self.closed and not self.result_fut.done() and not self.ctx.cancelled


class WebhookBroker:
    """The webhook calls of this process waiting for reports, keyed by (session_id, call_id)."""

    def __init__(self, remember: int = REMEMBER_ENDED) -> None:
        self._pending: dict[tuple[str, str], PendingCall] = {}
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = remember

    def __len__(self) -> int:
        return len(self._pending)

    def open(self, ctx: RunContext, tool: str) -> PendingCall:
        """Take the call's reports from now on. A call resumed here (its session moved to this node, or came back to
        it) replaces the pending call of an earlier incarnation still being stopped: reports go to the one that
        runs."""
        try:
            session: object | None = ctx.session
        except RuntimeError:  # a call outside of any session (a bare executor)
            session = None
        pending = PendingCall(ctx.session_id, ctx.call_id, tool, ctx, session)
        key = (pending.session_id, pending.call_id)
        self._pending[key] = pending
        self._ended.pop(key, None)
        return pending

    async def close(self, pending: PendingCall, *, ended: bool = True) -> None:
        """No report is accepted from now on; returns once a report being applied has landed. ``ended=False``: the
        call did not end, its session stopped here (a move, a shutdown) and it goes on where the session runs next,
        so this process does not remember it as ended."""
        pending.closed = True
        key = (pending.session_id, pending.call_id)
        if self._pending.get(key) is pending:  # not the pending call of a newer incarnation that resumed it
            del self._pending[key]
            if ended:
                self._ended[key] = None
                while len(self._ended) > self._remember:
                    self._ended.popitem(last=False)
        async with pending.lock:
            pass

    def ended(self, session_id: str, call_id: str) -> bool:
        """Whether this process saw the webhook call end (recently)."""
        return (session_id, call_id) in self._ended

    def _accepting(self, session_id: str, call_id: str) -> PendingCall:
        pending = self._pending.get((session_id, call_id))
        if pending is None:
            if self.ended(session_id, call_id):
                raise CallAlreadyEnded(call_id)
            raise NotAwaitingReport(call_id)
        if not pending.accepting:
            raise CallAlreadyEnded(call_id)
        return pending

    async def progress(
        self,
        session_id: str,
        call_id: str,
        message: str,
        progress: float | None,
        receipt: Receipt[ToolCallInfo] | None = None,
        *,
        silent: bool = False,
    ) -> None:
        """Apply a progress report as the tool's own ``ctx.update()`` (the first moves the call to the background;
        ``silent``: without a reply that answers it); its commit completes ``receipt``."""
        pending = self._accepting(session_id, call_id)
        async with pending.lock:
            if not pending.accepting:
                raise CallAlreadyEnded(call_id)
            await pending.ctx.update(message, progress, silent=silent, receipt=receipt)

    def result(
        self, session_id: str, call_id: str, result: BackendResult, receipt: Receipt[ToolCallInfo] | None = None
    ) -> PendingCall:
        """Hand a reported result to the waiting call (which then ends with it: its end completes ``receipt``).
        Returns the call it was handed to."""
        pending = self._accepting(session_id, call_id)
        if receipt is not None:
            pending.ctx.receipt_on_end(receipt)
        pending.result_fut.set_result(result)
        return pending

    def waiting(self, session_id: str, call_id: str) -> PendingCall | None:
        """The call waiting for reports under these ids on this process, if any."""
        pending = self._pending.get((session_id, call_id))
        return pending if pending is not None and pending.accepting else None


# -- delivery -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WebhookEndpoint:
    url: str
    cancel_url: str
    timeout_s: float
    secret: str = field(repr=False)
    #: the signatures its requests carry; None: the default for its secret (``signing.default_signature``)
    signature: Signature | None = None

    def __post_init__(self) -> None:
        signing_key(self.secret)  # a malformed whsec_ secret is refused here, never at a delivery

    def headers(self, body: bytes, msg_id: str) -> dict[str, str]:
        """The headers of one attempt to send ``body``, message ``msg_id``: signed as ``signature`` says."""
        return signed_headers(self.secret, body, message_id=msg_id, signature=self.signature)


def message_id(call_id: str, notice: str | None = None) -> str:
    """The ``webhook-id`` of a call's delivery, or of a ``notice`` about the call: the same on every attempt and every
    re-delivery of that message, so a backend dedupes on it; unique across sessions, as call ids are (the service
    names every call itself: ``call_<hex>``, never holding the ``.`` that the signed content separates with)."""
    return f"msg_{call_id}" if notice is None else f"msg_{call_id}_{notice}"


def default_cancel_url(url: str) -> str:
    """``<url>/cancel``, keeping the query string."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(path=parsed.path.rstrip("/") + "/cancel"))


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class Webhooks:
    """Per-process webhook machinery: the shared HTTP client, the broker, and background cancel notices."""

    def __init__(
        self,
        *,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        report_secret: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.max_response_bytes = max_response_bytes
        self._transport = transport  # None: the network
        self.broker = WebhookBroker()
        self.credentials = ReportCredentials(report_secret)
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: (session id, call id) -> headers naming the call's trace (W3C ``traceparent``), set when tracing is on
        self.trace_headers: Callable[[str, str], dict[str, str]] | None = None

    def _headers(
        self, endpoint: WebhookEndpoint, body: bytes, pending: PendingCall, notice: str | None = None
    ) -> dict[str, str]:
        headers = endpoint.headers(body, message_id(pending.call_id, notice))
        if self.trace_headers is not None:
            headers.update(self.trace_headers(pending.session_id, pending.call_id))
        return headers

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),  # the call's timeout_s bounds the rest
                follow_redirects=False,
                headers={"user-agent": f"switchboard/{__version__}"},
                transport=self._transport,
            )
        return self._client

    async def deliver(self, endpoint: WebhookEndpoint, body: bytes, pending: PendingCall) -> httpx.Response:
        """POST until the backend answers with a status below 500 (the caller bounds this by the call's timeout)."""
        delay = RETRY_BASE_S

        async def trace(event: str, info: dict[str, Any]) -> None:
            # the request is out: a backend that then never answers has the call and must hear of its end
            if event.endswith(".send_request_body.complete"):
                pending.sent = True

        while True:
            request = self.client.build_request(
                "POST", endpoint.url, content=body, headers=self._headers(endpoint, body, pending)
            )
            request.extensions["trace"] = trace
            try:
                response = await self._answer_of(request, pending)
            except ToolError:
                raise  # the backend answered, unusably: not worth another attempt
            except httpx.TransportError as err:
                pending.sent = pending.sent or not isinstance(err, httpx.ConnectError | httpx.ConnectTimeout)
                pending.last_error = _describe(err)
            except Exception as err:
                # the HTTP stack let an error of its own through (an OS error from a socket reset while it closed the
                # connection): still a failed attempt, not a reason to fail the call with an internal error
                logger.warning(
                    "webhook delivery of %s failed with an unexpected error",
                    pending.tool,
                    exc_info=err,
                    extra={"session_id": pending.session_id, "call_id": pending.call_id},
                )
                pending.sent = True
                pending.last_error = _describe(err)
            else:
                pending.sent = True
                if response.status_code < 500:
                    pending.last_error = None
                    return response
                pending.last_error = f"HTTP {response.status_code}"
            logger.warning(  # a backend that fails is an operator's business: not INFO
                "webhook delivery of %s failed (%s); retrying",
                pending.tool,
                pending.last_error,
                extra={"session_id": pending.session_id, "call_id": pending.call_id},
            )
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, RETRY_MAX_S)

    async def _answer_of(self, request: httpx.Request, pending: PendingCall) -> httpx.Response:
        """Send ``request`` and read its answer, at most ``max_response_bytes`` of it (streamed: a bigger answer is
        never held in memory). An answer that is too big fails the call; one of a failed attempt is not read."""
        response = await self.client.send(request, stream=True)
        try:
            if response.status_code >= 500:
                return response
            content = bytearray()
            async for chunk in response.aiter_bytes():
                content += chunk
                if len(content) > self.max_response_bytes:
                    raise ToolError(
                        f"{pending.tool} failed: its backend answered more than {self.max_response_bytes} bytes."
                    )
            return httpx.Response(response.status_code, content=bytes(content), request=request)
        finally:
            await response.aclose()

    def notify_cancel(self, endpoint: WebhookEndpoint, pending: PendingCall, reason: str) -> None:
        """Tell the backend to stop, in the background (best effort, retried); never delays the cancellation."""
        if not pending.sent:
            return  # the backend never got the call: there is nothing to stop
        body = json.dumps(
            {"call_id": pending.call_id, "session_id": pending.session_id, "tool": pending.tool, "reason": reason},
            separators=(",", ":"),
        ).encode()
        spawn(self._send_cancel(endpoint, body, pending), name=f"webhook-cancel:{pending.call_id}", tasks=self._tasks)

    async def _send_cancel(self, endpoint: WebhookEndpoint, body: bytes, pending: PendingCall) -> None:
        delay = RETRY_BASE_S
        error = ""
        for attempt in range(CANCEL_ATTEMPTS):
            if attempt:
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, RETRY_MAX_S)
            try:
                response = await self.client.post(
                    endpoint.cancel_url,
                    content=body,
                    headers=self._headers(endpoint, body, pending, "cancel"),
                    timeout=CANCEL_TIMEOUT_S,
                )
            except httpx.TransportError as err:
                error = _describe(err)
                continue
            if response.status_code < 500:
                if response.status_code >= 400:
                    logger.warning(
                        "the backend of %s refused the cancel notice (HTTP %d)",
                        pending.tool,
                        response.status_code,
                        extra={"session_id": pending.session_id, "call_id": pending.call_id},
                    )
                return
            error = f"HTTP {response.status_code}"
        logger.warning(
            "could not tell the backend of %s that the call was cancelled (%s)",
            pending.tool,
            error,
            extra={"session_id": pending.session_id, "call_id": pending.call_id},
        )

    async def aclose(self) -> None:
        """Give cancel notices a moment to go out, then close the client."""
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=CLOSE_GRACE_S)
            await cancel_and_wait(*late)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


# -- the tool -----------------------------------------------------------------------------------------------------


class WebhookTool(FunctionTool):
    """A tool declared with a JSON Schema whose body runs on a backend. Policies, progress and cancellation are
    exactly those of a Python ``FunctionTool``: the executor cannot tell them apart."""

    #: A call goes on where its session runs next (``on_restart="resume"``, the default): it waits there for its
    #: backend's report, without a second delivery.
    can_resume = True

    def __init__(
        self,
        *,
        name: str,
        description: str,
        parameters: dict[str, Any],
        endpoint: WebhookEndpoint,
        webhooks: Webhooks,
        policy: ToolPolicy = RESUMING_POLICY,
    ) -> None:
        self.declared_parameters = parameters
        self.endpoint = endpoint
        self._webhooks = webhooks
        # FunctionTool wants an async callable for its body; a webhook tool's body is invoke() itself
        super().__init__(self.invoke, name=name, description=description, policy=policy)

    def __repr__(self) -> str:
        return f"<WebhookTool {self.name} -> {self.endpoint.url}>"

    def _build_model(self) -> tuple[str | None, type[BaseModel]]:
        model = object_model(self.declared_parameters, "", f"{self.name}_arguments")
        if self.policy.on_duplicate == "confirm":
            confirm: Any = (bool, Field(default=False, description=CONFIRM_DESCRIPTION))
            model = create_model(f"{self.name}_arguments", __base__=model, **{CONFIRM_FIELD: confirm})
        return None, model

    @property
    def parameters(self) -> dict[str, Any]:
        schema = copy.deepcopy(self.declared_parameters)
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        schema.setdefault("additionalProperties", False)
        if self.policy.on_duplicate == "confirm":
            schema["properties"][CONFIRM_FIELD] = {
                "type": "boolean",
                "default": False,
                "description": CONFIRM_DESCRIPTION,
            }
        return schema

    def parse_arguments(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Validate against the declared schema; raises ``ValidationError`` (the executor words it for the model)."""
        parsed = dump(self.args_model.model_validate(raw))
        assert isinstance(parsed, dict)
        return parsed

    async def invoke(self, ctx: RunContext, arguments: dict[str, Any]) -> Any:
        pending = self._webhooks.broker.open(ctx, self.name)
        # resumed: delivered by an earlier run, so the backend may hold the call: a cancel or a timeout must tell it
        pending.sent = ctx.resumed
        stopped = False
        try:
            result = await ctx.wait_if_not_cancelled(self._result(pending, arguments, ctx))
        except ToolCancelled:
            self._webhooks.notify_cancel(self.endpoint, pending, ctx.cancel_reason or "cancelled")
            raise
        except asyncio.CancelledError:
            # stopped without an end when its session stops here (a move, a shutdown): the call goes on where the
            # session runs next; a forced cancel of a cancelled call ends it, as ``ToolCancelled`` does
            stopped = not ctx.cancelled
            raise
        finally:
            await self._webhooks.broker.close(pending, ended=not stopped)
        if result.is_error:
            raise ToolError(result.output)
        return result.output

    async def _result(self, pending: PendingCall, arguments: dict[str, Any], ctx: RunContext) -> BackendResult:
        """The call's result: delivered and answered, or reported; a resumed call (its session stopped where it ran
        while the backend worked) is not delivered again and waits for the report until the call's own deadline."""
        timeout_s = self.endpoint.timeout_s
        left_s = timeout_s
        if ctx.resumed:
            # from the call's start on the node that made it: its clock and this one's may differ a little (no
            # lease is judged by it, only how long a call waits)
            left_s -= (datetime.now(UTC) - ctx.started_at).total_seconds()
        try:
            if left_s <= 0:
                raise TimeoutError
            async with asyncio.timeout(left_s):
                if not ctx.resumed:
                    result = await self._delivered(pending, arguments)
                    if result is not None:
                        return result
                # accepted (202), resumed, or a report overtook the answer: wait for the reported result
                await asyncio.wait({pending.result_fut})
                return pending.result_fut.result()
        except TimeoutError:
            self._webhooks.notify_cancel(self.endpoint, pending, "timed out")
            if pending.last_error is not None:
                raise ToolError(
                    f"{self.name} failed: its backend could not be reached within {timeout_s:g} s "
                    f"({pending.last_error})."
                ) from None
            raise ToolError(f"{self.name} failed: no result from its backend within {timeout_s:g} s.") from None

    async def _delivered(self, pending: PendingCall, arguments: dict[str, Any]) -> BackendResult | None:
        """Deliver the call: its result when the backend answered with it, None when it accepted the call (202) or a
        report overtook the answer."""
        args = {k: v for k, v in arguments.items() if k != CONFIRM_FIELD}
        delivery = {
            "call_id": pending.call_id,
            "session_id": pending.session_id,
            "tool": self.name,
            "arguments": args,
            "report_token": self._webhooks.credentials.issue(pending.session_id, pending.call_id),
        }
        body = json.dumps(delivery, separators=(",", ":")).encode()
        answered, response = await first_of(self._webhooks.deliver(self.endpoint, body, pending), pending.result_fut)
        if not answered:
            return None
        assert response is not None
        return self._answer(pending, response)

    def _answer(self, pending: PendingCall, response: httpx.Response) -> BackendResult | None:
        status = response.status_code
        if status == 202:
            return None
        extra = {"session_id": pending.session_id, "call_id": pending.call_id}
        if 200 <= status < 300:
            try:
                return BackendResult.from_answer(response.content)
            except ValueError:
                logger.warning("the backend of %s answered %d without a valid result", self.name, status, extra=extra)
                raise ToolError(f"{self.name} failed: its backend answered without a valid result.") from None
        detail = _detail(response)
        logger.warning("the backend of %s refused the call (HTTP %d): %s", self.name, status, detail, extra=extra)
        reason = f"HTTP {status}: {detail}" if detail else f"HTTP {status}"
        raise ToolError(f"{self.name} failed: its backend refused the call ({reason}).")


def _detail(response: httpx.Response) -> str:
    """A short reason from an error answer: ``output``, ``detail``, ``error`` or ``message`` of a JSON body."""
    try:
        body = response.json()
    except ValueError:
        return ""
    if isinstance(body, dict):
        for key in ("output", "detail", "error", "message"):
            if isinstance(body.get(key), str):
                return valid_text(str(body[key])[:DETAIL_MAX_CHARS])
    return ""
