"""The container image: the service never runs as root."""

from __future__ import annotations

from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def test_the_image_runs_as_an_unprivileged_user():
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    users = [line.split(None, 1)[1] for line in lines if line.upper().startswith("USER ")]
    assert users, "the image runs as root: no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    # the last USER is in force for CMD: nothing after it switches back
    last_user = max(i for i, line in enumerate(lines) if line.upper().startswith("USER "))
    assert any(line.upper().startswith("CMD") for line in lines[last_user:])


def test_the_image_installs_the_server():
    """`pip install .` is the client alone (the server is the `server` extra): an image built that way answered every
    start with "the server is not installed"."""
    text = DOCKERFILE.read_text()
    installs = text.split("pip install")[1:]
    assert installs, "the image installs nothing"
    requirement = installs[0].split("\\")[0].split()[-1].strip("\"'")
    assert requirement == ".[server]", requirement
