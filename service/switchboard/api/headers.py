"""The security headers every HTTP answer carries: nosniff, no referrer, no framing and a content security policy
fitted to what the path serves. ``guards.SecurityHeaders`` adds them to every answer that passes through the app;
the unexpected-error handler (``problems``), which answers from outside every middleware, adds them itself."""

from __future__ import annotations

# the documents describe the API, the pages show them: public, or for any credential (``PUBLIC_DOCS``)
DOCS_DOCUMENTS = frozenset({"/openapi.json", "/asyncapi.json"})
DOCS_PAGES = frozenset({"/docs", "/redoc"})
DOCS_PATHS = DOCS_PAGES | DOCS_DOCUMENTS

# The console is static ES modules and a stylesheet from its own origin; its streams are same-origin WebSockets.
CONSOLE_CSP = (
    "default-src 'self'; img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
# The interactive docs (``docs_pages``): Swagger UI's files and the page's script from this origin, nothing from
# anywhere else (Swagger UI sets inline style attributes: styles only may be inline).
DOCS_CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
API_CSP = "default-src 'none'; frame-ancestors 'none'"  # JSON answers: nothing to load, nothing to frame
COMMON_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)


def csp_for(path: str) -> str:
    if path == "/console" or path.startswith("/console/"):
        return CONSOLE_CSP
    if path in DOCS_PAGES or path.startswith("/docs/"):
        return DOCS_CSP
    return API_CSP


# made once: they are added to every answer
_HEADERS = {
    csp: (*COMMON_HEADERS, (b"content-security-policy", csp.encode())) for csp in (CONSOLE_CSP, DOCS_CSP, API_CSP)
}


def security_headers(path: str) -> tuple[tuple[bytes, bytes], ...]:
    """The headers for an answer on ``path`` (raw ASGI pairs)."""
    return _HEADERS[csp_for(path)]


def problem_headers() -> dict[str, str]:
    """The headers for a problem document (JSON, whatever the path)."""
    return {k.decode(): v.decode() for k, v in (*COMMON_HEADERS, (b"content-security-policy", API_CSP.encode()))}
