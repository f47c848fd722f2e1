"""What the tests that run the real espeak-ng engine share."""

from __future__ import annotations

import os
import shutil

import pytest


def require_espeak() -> None:
    """Skip without espeak-ng on a developer machine; fail under CI, where .ci/run installs it."""
    if shutil.which("espeak-ng") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("espeak-ng is missing: .ci/run installs it (apt-get install espeak-ng)")
        pytest.skip("needs espeak-ng (apt-get install espeak-ng)")
