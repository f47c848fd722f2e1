"""API keys with scopes, and short-lived per-session tokens for dashboards."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from fastapi import Request

from ..control.settings import Settings
from .deps import SettingsDep
from .problems import ProblemError

TOKEN_PREFIX = "sbt_"
TOKEN_SCOPES = ("sessions:read", "events:read")


@dataclass(frozen=True)
class Principal:
    name: str
    scopes: frozenset[str]
    session_id: str | None = None  # set for per-session tokens: valid for that session only

    def allows(self, scope: str, session_id: str | None = None) -> bool:
        if scope not in self.scopes:
            return False
        return self.session_id is None or self.session_id == session_id


ANONYMOUS = Principal("anonymous", frozenset({"*"}))


class AuthError(Exception):
    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_token(settings: Settings, session_id: str, ttl_s: int | None = None) -> tuple[str, int]:
    expires = int(time.time()) + (ttl_s or settings.token_ttl_s)
    payload = _b64(json.dumps({"sid": session_id, "exp": expires, "n": secrets.token_hex(4)}).encode())
    sig = _b64(hmac.new(settings.token_secret.encode(), payload.encode(), hashlib.sha256).digest())
    return f"{TOKEN_PREFIX}{payload}.{sig}", expires


def _verify_token(settings: Settings, token: str) -> Principal:
    body = token[len(TOKEN_PREFIX) :]
    payload, _, sig = body.partition(".")
    expected = _b64(hmac.new(settings.token_secret.encode(), payload.encode(), hashlib.sha256).digest())
    # as bytes: compare_digest refuses a str holding anything but ASCII, and header values can hold any latin-1
    if not sig or not hmac.compare_digest(sig.encode(), expected.encode()):
        raise AuthError(401, "invalid_token", "The session token is invalid.")
    try:
        data = json.loads(_unb64(payload))  # signed by us, so well-formed unless the secret leaked
        sid, exp = str(data["sid"]), int(data["exp"])
    except (ValueError, KeyError, TypeError):
        raise AuthError(401, "invalid_token", "The session token is invalid.") from None
    if exp < time.time():
        raise AuthError(401, "token_expired", "The session token has expired.")
    return Principal(f"token:{sid}", frozenset(TOKEN_SCOPES), session_id=sid)


def authenticate(settings: Settings, credential: str | None) -> Principal:
    """Who is calling. With no API keys configured, everyone is allowed everything (loopback only)."""
    if not settings.auth_enabled:
        return ANONYMOUS
    if not credential:
        raise AuthError(401, "unauthenticated", "Send 'Authorization: Bearer <key>'.")
    if credential.startswith(TOKEN_PREFIX):
        return _verify_token(settings, credential)
    for api_key in settings.api_keys:
        if hmac.compare_digest(api_key.key.encode(), credential.encode()):
            return Principal(api_key.name or f"key:{api_key.key[:4]}…", frozenset(api_key.scopes))
    raise AuthError(401, "invalid_key", "The API key is not valid.")


def bearer(request_headers: dict[str, str] | None, header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def url_token(value: str | None) -> str | None:
    """A credential passed in a URL (``?token=``): session tokens only. URLs end up in access logs, proxy logs and
    browser history, so an API key there is refused (and so is never accepted from a page that can only set a URL)."""
    if value and not value.startswith(TOKEN_PREFIX):
        raise AuthError(401, "key_in_url", "API keys are not accepted in URLs: send 'Authorization: Bearer <key>'.")
    return value


def refuse_session_token(principal: Principal) -> None:
    """A session token cannot mint tokens: otherwise a short-lived token renews itself forever."""
    if principal.session_id is not None:
        raise AuthError(403, "forbidden", "A session token cannot create tokens; use an API key.")


def check(principal: Principal, scope: str, session_id: str | None = None) -> None:
    if "*" in principal.scopes:
        return
    if not principal.allows(scope, session_id):
        raise AuthError(403, "forbidden", f"This credential lacks the '{scope}' scope for this resource.")


class Require:
    """FastAPI dependency: ``Depends(Require("sessions:write"))``; ``keys_only=True`` refuses session tokens."""

    def __init__(self, scope: str, *, keys_only: bool = False) -> None:
        self.scope = scope
        self.keys_only = keys_only

    def __call__(self, request: Request, settings: SettingsDep) -> Principal:
        try:
            principal = authenticate(settings, bearer(None, request.headers.get("authorization")))
            check(principal, self.scope, request.path_params.get("sid"))
            if self.keys_only:
                refuse_session_token(principal)
        except AuthError as err:
            headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
            raise ProblemError(err.status, err.code, err.detail, headers=headers) from None
        return principal
