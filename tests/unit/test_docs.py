"""The documentation: the site builds with no broken link, anchor or page left out, and every link of the README
reaches a file (and a heading) of the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """The anchor a heading gets (GitHub's and the site's, for the headings used here)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_of_docs_is_in_the_site() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", config, flags=re.M))
    assert listed == {p.name for p in (ROOT / "docs").glob("*.md")}


@pytest.mark.parametrize("target", sorted(set(LINK.findall((ROOT / "README.md").read_text()))))
def test_each_readme_link_reaches_something(target: str) -> None:
    if re.match(r"^[a-z]+://", target):
        assert target.startswith("http://127.0.0.1:8080/"), "the README links only to the local service"
        return
    path, _, anchor = target.partition("#")
    assert (ROOT / path).exists(), f"{target}: no such file"
    if anchor:
        assert anchor in anchors(ROOT / path), f"{target}: no such heading"
