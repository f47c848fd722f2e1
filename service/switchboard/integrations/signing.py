"""How requests to webhook backends are signed: Standard Webhooks 1.0, the service's earlier scheme, or both.

Standard Webhooks: ``webhook-id`` (one per message, the same on every attempt), ``webhook-timestamp`` (Unix seconds
of the attempt) and ``webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``, which backends
verify with an off-the-shelf library (``standardwebhooks`` in Python). Its key is the base64-decoded part of a
``whsec_`` secret, or the UTF-8 bytes of any other secret.

The earlier scheme: ``X-Switchboard-Timestamp`` and ``X-Switchboard-Signature: v1=<hex HMAC-SHA256 of
"<timestamp>.<body>">`` keyed with the secret as written, checked by ``verify_signature``. It is sent alone, or beside
the standard headers while a backend moves over (a tool's ``signature``: ``standard``, ``switchboard`` or ``both``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Literal

Signature = Literal["standard", "switchboard", "both"]

STANDARD_SECRET_PREFIX = "whsec_"
MIN_STANDARD_KEY_BYTES = 24  # Standard Webhooks: a symmetric key of at least 192 bits
MAKE_STANDARD_SECRET = (
    "python -c 'import base64, secrets; print(\"whsec_\" + base64.b64encode(secrets.token_bytes(32)).decode())'"
)
ID_HEADER = "webhook-id"
STANDARD_TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"

TIMESTAMP_HEADER = "X-Switchboard-Timestamp"
SIGNATURE_HEADER = "X-Switchboard-Signature"
SIGNATURE_VERSION = "v1"
REPLAY_WINDOW_S = 300.0  # backends reject a timestamp further than this from their clock


def signing_key(secret: str) -> bytes:
    """The Standard Webhooks key of ``secret``: the base64-decoded part of a ``whsec_`` secret, the UTF-8 bytes of any
    other. Raises ``ValueError`` saying what is wrong, never quoting the secret: its message follows "holds"."""
    if not secret.startswith(STANDARD_SECRET_PREFIX):
        try:
            return secret.encode()
        except UnicodeEncodeError:  # os.environ keeps bytes that are not UTF-8 as lone surrogates
            raise ValueError("a webhook signing secret that is not UTF-8 text") from None
    encoded = secret.removeprefix(STANDARD_SECRET_PREFIX)
    try:
        # standard base64, its padding optional: read exactly as the Standard Webhooks libraries read it
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except ValueError:
        raise ValueError(
            f"a {STANDARD_SECRET_PREFIX} secret that is not valid base64 after its prefix (make one with: "
            f"{MAKE_STANDARD_SECRET})"
        ) from None
    if len(key) < MIN_STANDARD_KEY_BYTES:
        raise ValueError(
            f"a {STANDARD_SECRET_PREFIX} secret of {len(key)} bytes; at least {MIN_STANDARD_KEY_BYTES} are needed "
            f"(make one with: {MAKE_STANDARD_SECRET})"
        )
    return key


def default_signature(secret: str) -> Signature:
    """A ``whsec_`` secret was made for Standard Webhooks: its requests carry only those headers. Any other secret
    was made for the earlier scheme, which its backend may verify: its requests carry both sets."""
    return "standard" if secret.startswith(STANDARD_SECRET_PREFIX) else "both"


def sign(secret: str, timestamp: str | int, body: bytes) -> str:
    """The earlier scheme's signature of ``body`` sent at ``timestamp``: ``v1=<hex HMAC-SHA256>``."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"{SIGNATURE_VERSION}={mac}"


def sign_standard(key: bytes, message_id: str, timestamp: str | int, body: bytes) -> str:
    """The Standard Webhooks signature of message ``message_id`` sent at ``timestamp``: ``v1,<base64 HMAC-SHA256>``."""
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return f"v1,{base64.b64encode(mac).decode()}"


def signed_headers(
    secret: str, body: bytes, *, message_id: str, signature: Signature | None = None, now: float | None = None
) -> dict[str, str]:
    """The headers of one attempt to send ``body``: the content type and the signatures that ``signature`` names
    (default: ``default_signature(secret)``), both sets under one timestamp. ``message_id`` holds no ``.``."""
    timestamp = str(int(time.time() if now is None else now))
    headers = {"content-type": "application/json"}
    scheme = signature or default_signature(secret)
    if scheme != "switchboard":
        headers[ID_HEADER] = message_id
        headers[STANDARD_TIMESTAMP_HEADER] = timestamp
        headers[STANDARD_SIGNATURE_HEADER] = sign_standard(signing_key(secret), message_id, timestamp, body)
    if scheme != "standard":
        headers[TIMESTAMP_HEADER] = timestamp
        headers[SIGNATURE_HEADER] = sign(secret, timestamp, body)
    return headers


def verify_signature(
    secret: str,
    timestamp: str | int | None,
    body: bytes | str,
    signature: str | None,
    now: float | None = None,
    window_s: float = REPLAY_WINDOW_S,
) -> bool:
    """Check a request's signature of the earlier scheme, for backends. Pass the raw body bytes and the two headers
    as received (a Standard Webhooks signature is checked by that standard's own libraries).

    False when the signature does not match, or the timestamp is more than ``window_s`` from ``now`` (a replay).
    ``signature`` may hold several comma-separated values (a backend rotating secrets accepts any that matches).

    >>> ok = verify_signature(secret, request.headers["X-Switchboard-Timestamp"], await request.body(),
    ...                       request.headers["X-Switchboard-Signature"])
    """
    if timestamp is None or not signature:
        return False
    try:
        sent_at = int(timestamp)
    except (TypeError, ValueError):
        return False
    if abs((time.time() if now is None else now) - sent_at) > window_s:
        return False
    try:
        raw = body.encode() if isinstance(body, str) else body
        expected = sign(secret, timestamp, raw)
    except UnicodeEncodeError:  # a lone surrogate: not text any sender could have signed
        return False
    # compare_digest raises on a str holding anything but ASCII; no such value can be one of our hex signatures
    return any(part.isascii() and hmac.compare_digest(expected, part.strip()) for part in signature.split(","))
