"""The OpenAPI document's security: the credentials the server accepts and what each operation needs.

An operation guarded by a ``Require`` dependency is documented from it (its scope, and whether a session token of the
path's session may stand for an API key), so the document says what is enforced. An operation guarded otherwise
declares its ``security`` itself (``openapi_extra=security(...)``): the public health routes, ``/metrics``, the AG-UI
stream and the webhook reports. Every operation's description ends with its credentials in words.

OpenAPI 3.1 lets a requirement of a scheme that is not OAuth list role names: each requirement lists the scope the
credential must hold (a key with ``*`` holds them all).
"""

from __future__ import annotations

from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute, iter_route_contexts

from ..integrations.webhooks import REPORT_TOKEN_HEADER
from .auth import MINTABLE_SCOPES, Require
from .problems import ProblemAPI

API_KEY, SESSION_TOKEN, TOKEN_QUERY, REPORT_TOKEN = "apiKey", "sessionToken", "sessionTokenQuery", "reportToken"

SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    API_KEY: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "API key",
        "description": "An API key of the server's configuration (`SWITCHBOARD_API_KEYS`), sent as "
        "`Authorization: Bearer <key>`. A key holds scopes (`*`: all of them); each operation names the one it needs. "
        "API keys are never accepted in URLs. A server with no API keys configured runs without authentication "
        "(it then serves loopback only) and needs no credential.",
    },
    SESSION_TOKEN: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "sbt_<claims>.<signature>",
        "description": "A short-lived token for one session, minted by an API key with `createSessionToken` and "
        "signed by the server (HMAC-SHA256 under `SWITCHBOARD_TOKEN_SECRET`), sent as `Authorization: Bearer "
        "<token>`. It holds `sessions:read` and `events:read` unless minted with others (at most those and "
        "`media:connect`, and never one its key lacks), is valid on its own session's operations only, and "
        "expires.",
    },
    TOKEN_QUERY: {
        "type": "apiKey",
        "in": "query",
        "name": "token",
        "description": "A session token as the `token` query parameter, for clients that cannot set headers "
        "(`EventSource`). Only session tokens: an API key in a URL is refused (401 `key_in_url`).",
    },
    REPORT_TOKEN: {
        "type": "apiKey",
        "in": "header",
        "name": REPORT_TOKEN_HEADER,
        "description": "The `report_token` of a webhook tool call's delivery: a report about that call needs it "
        "beside an API key with `tools:report`.",
    },
}

Requirement = dict[str, list[str]]


def security(*requirements: Requirement) -> dict[str, Any]:
    """An operation's ``openapi_extra`` declaring its security: alternatives, each a scheme -> scopes mapping (all
    of one alternative at once). None: the operation needs no credential."""
    return {"security": list(requirements)}


PUBLIC = security()


def _requires(dependant: Dependant) -> list[Require]:
    found = [dep.call for dep in dependant.dependencies if isinstance(dep.call, Require)]
    return found + [req for dep in dependant.dependencies for req in _requires(dep)]


def required(require: Require, path: str) -> list[Requirement]:
    """What ``require`` lets in on ``path``: an API key with its scope, or a session token of the path's session if
    one may hold that scope."""
    alternatives = [{API_KEY: [require.scope]}]
    if not require.keys_only and "{sid}" in path and require.scope in MINTABLE_SCOPES:
        alternatives.append({SESSION_TOKEN: [require.scope]})
    return alternatives


def _in_words(requirements: list[Requirement]) -> str:
    if not requirements:
        return "**Credentials:** none."
    alternatives = (
        " and ".join(f"`{scheme}`" + (f" with `{', '.join(scopes)}`" if scopes else "") for scheme, scopes in r.items())
        for r in requirements
    )
    return "**Credentials:** " + "; or ".join(alternatives) + "."


class SwitchboardAPI(ProblemAPI):
    """The service's FastAPI: its OpenAPI document holds the security schemes and each operation's requirement."""

    def openapi(self) -> dict[str, Any]:
        spec = super().openapi()
        if "securitySchemes" in spec["components"]:  # documented already
            return spec
        spec["components"]["securitySchemes"] = SECURITY_SCHEMES
        for context in iter_route_contexts(self.routes):
            route = context.original_route
            if isinstance(route, APIRoute) and route.include_in_schema:
                for method in route.methods or ():
                    _document(spec["paths"][route.path_format][method.lower()], route)
        return spec


def _document(operation: dict[str, Any], route: APIRoute) -> None:
    """``operation`` with its security (declared, or read off the route's ``Require``), also in words."""
    if "security" not in operation:
        requires = _requires(route.dependant)
        if not requires:
            raise ValueError(f"{route.path_format}: no Require and no declared security")
        operation["security"] = required(requires[0], route.path_format)
    words = _in_words(operation["security"])
    operation["description"] = f"{operation.get('description', '').rstrip()}\n\n{words}".lstrip()
