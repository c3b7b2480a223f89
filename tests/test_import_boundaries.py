"""The three floors (DESIGN.md): the core `gptplan` imports neither tool; the runner imports the
core only; the planner imports the core and `runner.probe` only. Checked on the source (every
import statement, including the ones inside functions), not on what happens to be loaded."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED = {
    "gptplan": {"gptplan"},
    "runner": {"gptplan", "runner"},
    "planner": {"gptplan", "planner", "runner.probe"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from runner import probe` names the module runner.probe
            found += [
                (node.lineno, f"{node.module}.{alias.name}")
                for alias in node.names
                if node.module in ALLOWED
            ]
    return found


def violations(package: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top not in ALLOWED or module in ALLOWED[package]:
                continue
            if any(module == a or module.startswith(a + ".") for a in ALLOWED[package]):
                continue
            if top == module and any(a.startswith(top + ".") for a in ALLOWED[package]):
                continue  # `from runner import probe`: judged by the submodule entry
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_only_downward(package):
    assert violations(package) == []


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    (tmp_path / "gptplan").mkdir()
    (tmp_path / "gptplan" / "bad.py").write_text("def f():\n    from runner.train import train\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert violations("gptplan") == ["gptplan/bad.py:2 imports runner.train"]
