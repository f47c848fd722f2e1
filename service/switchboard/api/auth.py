"""API keys with scopes, and short-lived per-session tokens for dashboards."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ..control.settings import Settings
from .cluster.forward import FORWARDED_HEADER
from .deps import services
from .problems import ProblemError
from .rate_limit import COMMAND_METHODS, READ_METHODS, RateLimiter

TOKEN_PREFIX = "sbt_"
TOKEN_SCOPES = ("sessions:read", "events:read")  # what a session token holds unless it was minted with others
MINTABLE_SCOPES = ("sessions:read", "events:read", "media:connect")  # what it may hold


@dataclass(frozen=True)
class Principal:
    name: str
    scopes: frozenset[str]
    session_id: str | None = None  # set for per-session tokens: valid for that session only
    # Who this is, for what is kept per caller (idempotency records, session quotas): an API key by a digest of the
    # key (names are optional and may repeat), a token by its session. Never the secret itself.
    subject: str = ""
    # Who answers for it: a token's minter (the API key that made it), else the credential itself. Every budget
    # (commands, reads, streams, media frames) is charged here, so minting tokens never multiplies a key's share.
    minter: str | None = None

    @property
    def identity(self) -> str:
        return self.subject or self.name

    @property
    def budget(self) -> str:
        """The principal whose budgets this credential spends: a token's minter, else the credential itself."""
        return self.minter or self.identity

    @property
    def operator(self) -> bool:
        """An API key that may control sessions: what keeps a reserve when the server's stream slots run low."""
        return self.session_id is None and ("*" in self.scopes or "sessions:control" in self.scopes)

    def allows(self, scope: str, session_id: str | None = None) -> bool:
        if scope not in self.scopes:
            return False
        return self.session_id is None or self.session_id == session_id


ANONYMOUS = Principal("anonymous", frozenset({"*"}), subject="anonymous")


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


def issue_token(
    settings: Settings,
    session_id: str,
    ttl_s: int | None = None,
    scopes: tuple[str, ...] = TOKEN_SCOPES,
    minter: str | None = None,
) -> tuple[str, int]:
    """A signed token for ``session_id``; ``minter`` (the minting key's subject) is the principal it spends for."""
    expires = int(time.time()) + (ttl_s or settings.token_ttl_s)
    claims: dict[str, Any] = {"sid": session_id, "exp": expires, "n": secrets.token_hex(4)}
    if minter:
        claims["by"] = minter
    if tuple(scopes) != TOKEN_SCOPES:
        claims["sc"] = list(scopes)  # signed with the rest: a holder cannot widen it
    payload = _b64(json.dumps(claims).encode())
    return f"{TOKEN_PREFIX}{payload}.{_token_signature(settings, payload)}", expires


def _token_signature(settings: Settings, payload: str) -> str:
    return _b64(hmac.new(settings.token_secret.encode(), payload.encode(), hashlib.sha256).digest())


def _verify_token(settings: Settings, token: str) -> Principal:
    body = token[len(TOKEN_PREFIX) :]
    payload, _, sig = body.partition(".")
    expected = _token_signature(settings, payload)
    # as bytes: compare_digest refuses a str holding anything but ASCII, and header values can hold any latin-1
    if not sig or not hmac.compare_digest(sig.encode(), expected.encode()):
        raise AuthError(401, "invalid_token", "The session token is invalid.")
    try:
        data = json.loads(_unb64(payload))  # signed by us, so well-formed unless the secret leaked
        sid, exp = str(data["sid"]), int(data["exp"])
        scopes = frozenset(str(scope) for scope in data.get("sc", TOKEN_SCOPES)) & frozenset(MINTABLE_SCOPES)
        minter = str(data["by"]) if data.get("by") else None
    except (ValueError, KeyError, TypeError):
        raise AuthError(401, "invalid_token", "The session token is invalid.") from None
    if exp < time.time():
        raise AuthError(401, "token_expired", "The session token has expired.")
    return Principal(f"token:{sid}", scopes, session_id=sid, subject=f"token:{sid}", minter=minter)


def token_scopes(principal: Principal, asked: list[str] | None) -> tuple[str, ...]:
    """The scopes of a token ``principal`` mints: ``asked``, each one held by the minting key itself, so a token never
    reaches further than the key that made it. Unasked, the default scopes (reading the session and its events) the
    key holds: a key that may only read sessions mints tokens that may only read sessions."""
    if "*" in principal.scopes:
        return tuple(dict.fromkeys(asked)) if asked else TOKEN_SCOPES
    if not asked:
        return tuple(scope for scope in TOKEN_SCOPES if principal.allows(scope))
    scopes = tuple(dict.fromkeys(asked))
    missing = [scope for scope in scopes if not principal.allows(scope)]
    if missing:
        raise ProblemError(
            403, "forbidden", f"A token cannot hold {missing[0]!r}: the API key minting it lacks that scope."
        )
    return scopes


def _seal_key(settings: Settings) -> bytes:
    # derived, so a sealed record's MAC is never a token signature (and the reverse)
    return hmac.new(settings.token_secret.encode(), b"switchboard idempotency seal v1", hashlib.sha256).digest()


def seal_token(settings: Settings, answer: Any) -> Any:
    """What an idempotency record keeps of a minted token's answer: its payload (session, expiry, nonce: no secret)
    with a MAC under a key derived from the token secret, in place of the token. The store then holds nothing that
    authenticates anyone, and nothing that could be turned into a token without the server's secret."""
    token = str(answer["token"])
    payload = token[len(TOKEN_PREFIX) :].partition(".")[0]
    mac = _b64(hmac.new(_seal_key(settings), payload.encode(), hashlib.sha256).digest())
    return {**answer, "token": None, "sealed_token": f"{payload}.{mac}"}


def unseal_token(settings: Settings, record: Any) -> Any:
    """The answer a sealed record replays: the very token first answered, signed again (signing is deterministic).
    A record whose MAC does not check (written under another secret, or not by this service) replays nothing."""
    payload, _, mac = str(record.get("sealed_token") or "").partition(".")
    expected = _b64(hmac.new(_seal_key(settings), payload.encode(), hashlib.sha256).digest())
    if not payload or not hmac.compare_digest(mac.encode(), expected.encode()):
        raise ProblemError(
            409,
            "idempotency_key_reused",
            "The token answered under this Idempotency-Key cannot be replayed (the token secret changed); "
            "use a new key.",
        )
    answer = {k: v for k, v in record.items() if k != "sealed_token"}
    return {**answer, "token": f"{TOKEN_PREFIX}{payload}.{_token_signature(settings, payload)}"}


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
            # an unnamed key goes by its digest: no part of a key is ever shown (audit trail, logs)
            subject = key_subject(api_key.key)
            return Principal(api_key.name or subject, frozenset(api_key.scopes), subject=subject)
    raise AuthError(401, "invalid_key", "The API key is not valid.")


def key_subject(key: str) -> str:
    """An API key's identity where callers are told apart: a digest, so no store or log ever holds the key."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:24]


def bearer(request_headers: dict[str, str] | None, header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def url_token(values: Sequence[str]) -> str | None:
    """The credential passed in a URL (every ``?token=`` of it; the last one counts): session tokens only. URLs end
    up in access logs, proxy logs and browser history, so an API key there is refused, also beside a session token
    (and so is never accepted from a page that can only set a URL)."""
    if any(value and not value.startswith(TOKEN_PREFIX) for value in values):
        raise AuthError(401, "key_in_url", "API keys are not accepted in URLs: send 'Authorization: Bearer <key>'.")
    return values[-1] if values else None


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

    # the settings from the request, not a dependency of their own: FastAPI solves each dependency on every request
    async def __call__(self, request: Request) -> Principal:
        try:
            principal = authenticate(services(request).settings, bearer(None, request.headers.get("authorization")))
            check(principal, self.scope, request.path_params.get("sid"))
            if self.keys_only:
                refuse_session_token(principal)
        except AuthError as err:
            headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
            raise ProblemError(err.status, err.code, err.detail, headers=headers) from None
        limited = await charge(request, principal)
        if limited is not None:
            raise limited
        request.state.principal = principal
        return principal


async def charge(request: Request, principal: Principal) -> ProblemError | None:
    """Charge ``request`` to the budget of its door (commands, or reads of the API) that ``principal`` spends, once:
    the problem to answer when that budget is spent, else None. A request another node forwarded (its header checked
    by ``ForwardedGuard``) was charged where it arrived; so was one the routing seam charged before answering it here
    (``request.state.charged``). With auth off nothing is charged."""
    if principal is ANONYMOUS or FORWARDED_HEADER in request.headers or getattr(request.state, "charged", False):
        return None
    found = services(request)
    if request.method in COMMAND_METHODS:
        limits, what = found.writes, "commands"
    elif request.method in READ_METHODS and request.url.path.startswith("/v1/"):
        limits, what = found.reads, "reads"
    else:
        return None
    request.state.charged = True
    wait_s = await limits.acquire(principal.budget)
    if wait_s is None:
        return None
    return ProblemError(
        429,
        "rate_limited",
        f"Too many {what} from this credential; retry after Retry-After seconds.",
        headers={"Retry-After": RateLimiter.retry_after(wait_s)},
    )


def principal_of(request: Request) -> Principal:
    """The caller a route's ``Require`` let in (authenticated again if no ``Require`` ran)."""
    found = getattr(request.state, "principal", None)
    if isinstance(found, Principal):
        return found
    return authenticate(services(request).settings, bearer(None, request.headers.get("authorization")))
