"""The committed OpenAPI document passes Redocly's recommended rules (openapi/redocly.yaml) with no error and no
warning, by the linter pinned in openapi/package-lock.json (`make lint-spec` installs it with `npm ci`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

OPENAPI_DIR = Path(__file__).resolve().parents[2] / "openapi"
LINTER = OPENAPI_DIR / "node_modules" / ".bin" / "redocly"
LINT_TIMEOUT_S = 120  # bound: one run of the linter takes about a second; a first npm ci, under a minute


def _linter() -> Path:
    """The pinned linter, installed from the lock file if it is not yet; CI fails without node and npm."""
    if not LINTER.exists() and shutil.which("npm") is not None:
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=OPENAPI_DIR, check=True, timeout=LINT_TIMEOUT_S)
    if shutil.which("node") is None or not LINTER.exists():
        message = "node and npm are needed to lint openapi/openapi.json (`make lint-spec`)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return LINTER


def test_the_spec_passes_the_recommended_rules_without_warnings():
    env = {**os.environ, "REDOCLY_TELEMETRY": "off", "REDOCLY_SUPPRESS_UPDATE_NOTICE": "true"}
    run = subprocess.run(
        [str(_linter()), "lint", "openapi.json", "--format", "json", "--max-problems", "1000"],
        cwd=OPENAPI_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=LINT_TIMEOUT_S,
    )
    report = json.loads(run.stdout)
    problems = [
        f"{p['severity']} {p['ruleId']} at {p['location'][0]['pointer']}: {p['message']}" for p in report["problems"]
    ]
    assert report["totals"]["errors"] == report["totals"]["warnings"] == 0, "\n".join(problems)
    assert run.returncode == 0, run.stderr
