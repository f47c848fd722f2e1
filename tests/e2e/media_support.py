"""API keys for the reference media edges' tests (the `media_srv` and `media_client` fixtures use them)."""

from __future__ import annotations

import json

KEY = "edge-key-0123456789abcdef"
NO_MEDIA_KEY = "edge-key-without-media-0123"
SCOPES = ["sessions:read", "sessions:write", "sessions:control", "events:read"]
KEYS = json.dumps([{"key": KEY, "scopes": [*SCOPES, "media:connect"]}, {"key": NO_MEDIA_KEY, "scopes": SCOPES}])
