"""No import cycle anywhere in the service, and the check that enforces it does see one."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.import_cycles import import_cycles, main


def write_package(root: Path, name: str, modules: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module, source in modules.items():
        path = package / f"{module.replace('.', '/')}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != package:
            (path.parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(source))


def test_switchboard_has_no_import_cycle() -> None:
    assert import_cycles("switchboard") == []


def test_the_check_finds_cycles_through_type_checking_and_function_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_package(
        tmp_path,
        "knotted",
        {
            # a loop only the type checker sees
            "session": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from .reply import Reply
            """,
            "reply": "from .session import Session\n",
            # a loop through an import inside a function
            "executor": """
                class Executor:
                    def finish(self):
                        from .agents.agent import Agent
            """,
            "agents.agent": "from ..tools import Tool\n",
            "tools": "from .executor import Executor\n",
            # one-way imports are fine
            "chat": "from . import tools\n",
            "leaf": "",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("knotted") == [
        ["knotted.agents.agent", "knotted.executor", "knotted.tools"],
        ["knotted.reply", "knotted.session"],
    ]
    assert main(["knotted"]) == 1
    assert "import cycle in knotted: knotted.agents.agent <-> knotted.executor <-> knotted.tools" in (
        capsys.readouterr().err
    )


def test_the_check_passes_a_package_without_cycles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_package(tmp_path, "layered", {"api": "from . import core\n", "core": "from . import util\n", "util": ""})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("layered") == []
    assert main(["layered"]) == 0
