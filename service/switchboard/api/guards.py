"""What browsers may do, as pure ASGI middleware (docs/security.md has the whole picture).

``BrowserGuard``: with auth off the service trusts whoever can reach it, which must not include web pages. A page on
another origin can open WebSockets and send "simple" cross-origin POSTs to a loopback service, and DNS rebinding
lets a remote page talk to it under its own host name. So, with auth off, only a loopback ``Host`` (or one of
``allowed_hosts``) is served and an ``Origin``, when a browser sends one, must be a loopback origin, the request's
own origin or one of ``allowed_origins``; on HTTP and WebSocket alike. With auth on a page holds no credential, so
any ``Host`` is served (behind proxies); WebSocket origins are checked when ``allowed_origins`` is set.
A refused HTTP request gets a 403 problem; a refused WebSocket is accepted and closed with 1008 (policy violation).

``JsonBodies``: a command's body must be ``application/json`` (415 otherwise). Browsers send form and text bodies
cross-origin without asking (no CORS preflight), never JSON, so this closes "simple request" forgery for good.

``PrivatePaths``: the API's documentation and ``/metrics`` are public or need a credential, as the settings say.

``SecurityHeaders``: nosniff, no referrer, no framing, and a content security policy on every response.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..control.settings import Settings, is_loopback_name
from .auth import AuthError, authenticate, bearer, check
from .headers import DOCS_PATHS, security_headers
from .problems import problem_response

CLOSE_POLICY_VIOLATION = 1008
COMMAND_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
METRICS_PATH = "/metrics"
METRICS_SCOPE = "metrics:read"
SEEN_MAX = 1024  # BrowserGuard's decisions kept


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8080`` -> ``::1``, ``Ab.COM.`` -> ``ab.com``."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        host = host[1:end] if end > 0 else host
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def _is_loopback_origin(origin: str) -> bool:
    try:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and is_loopback_name(parts.hostname or "")
    except ValueError:  # a malformed port or bracket
        return False


class BrowserGuard:
    """Host and Origin checks (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        # (kind, Host, Origin) -> the refusal: the same few values on every request (parsing an address cost more than
        # the rest of the check); bounded, emptied when full, since a client chooses them
        self._seen: dict[tuple[str, str | None, str | None], str | None] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = self._refusal_seen(scope)
        if refusal is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            response = problem_response(403, refusal, _DETAILS[refusal])
            await response(scope, receive, send)
        else:
            message = await receive()
            if message["type"] == "websocket.connect":
                await send({"type": "websocket.accept"})
                await send({"type": "websocket.close", "code": CLOSE_POLICY_VIOLATION, "reason": refusal})

    def _refusal_seen(self, scope: Scope) -> str | None:
        key = (scope["type"], _header(scope, b"host"), _header(scope, b"origin"))
        try:
            return self._seen[key]
        except KeyError:
            pass
        if len(self._seen) >= SEEN_MAX:
            self._seen.clear()
        found = self._seen[key] = self.refusal(scope)
        return found

    def refusal(self, scope: Scope) -> str | None:
        """The problem code for a request browsers must not make, or None."""
        host, origin = _header(scope, b"host"), _header(scope, b"origin")
        if not self.settings.auth_enabled:
            # no Host at all is no browser (they always send one): leave such clients be
            if host is not None and not self._host_allowed(host):
                return "host_not_allowed"
            if origin is not None and not self._origin_allowed(origin, host):
                return "origin_not_allowed"
            return None
        checked = scope["type"] == "websocket" and self.settings.allowed_origins
        if checked and origin is not None and not self._origin_allowed(origin, host):
            return "origin_not_allowed"
        return None

    def _host_allowed(self, host: str) -> bool:
        name = host_name(host)
        return is_loopback_name(name) or name in self.settings.allowed_hosts

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if origin in self.settings.allowed_origins:
            return True
        if host is not None and origin.partition("://")[2] == host.strip().lower():
            return True  # the page is the service's own (the console)
        return not self.settings.auth_enabled and _is_loopback_origin(origin)


_DETAILS = {
    "host_not_allowed": "This host name is not served with authentication off (see SWITCHBOARD_ALLOWED_HOSTS).",
    "origin_not_allowed": "Requests from this web origin are refused (see SWITCHBOARD_ALLOWED_ORIGINS).",
}


class JsonBodies:
    """415 for a command whose body is not ``application/json`` (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in COMMAND_METHODS and _has_body(scope):
            media_type = (_header(scope, b"content-type") or "").partition(";")[0].strip().lower()
            if media_type != "application/json":
                shown = media_type or "none"
                detail = f"The request body must be application/json (got {shown})."
                response = problem_response(415, "unsupported_media_type", detail)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    if length is not None:
        return length.strip() != "0"
    return _header(scope, b"transfer-encoding") is not None


class PrivatePaths:
    """The docs and ``/metrics`` with auth on: public, or a credential (``metrics:read`` for the metrics)."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        private_docs = path in DOCS_PATHS and not self.settings.public_docs
        private_metrics = path == METRICS_PATH and not self.settings.public_metrics
        if scope["type"] == "http" and self.settings.auth_enabled and (private_docs or private_metrics):
            try:
                principal = authenticate(self.settings, bearer(None, _header(scope, b"authorization")))
                if private_metrics:
                    check(principal, METRICS_SCOPE)
            except AuthError as err:
                headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
                response = problem_response(err.status, err.code, err.detail, headers=headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SecurityHeaders:
    """Headers every HTTP response carries (see the module docstring); a route's own values win."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = security_headers(scope.get("path", ""))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                present = {bytes(k).lower() for k, _ in headers}
                headers += [(k, v) for k, v in extra if k not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
